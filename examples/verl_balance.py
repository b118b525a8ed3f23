#!/usr/bin/env python
"""balancer.integrations.verl on verl's own DataProto: DP balancing and dynamic micro-batches beside verl 0.9.1's.

    python examples/verl_balance.py

Builds a rollout-like batch (heavy-tailed response lengths, 4 responses per prompt), then
1. balances it over 4 DP ranks (equal counts, as verl's dispatch needs) with `balance_batch`, beside verl's
   Karmarkar-Karp partition (`get_seqlen_balanced_partitions`, what `RayPPOTrainer._balance_batch` runs);
2. cuts one rank's share into micro-batches of at most 2,048 real tokens with `prepare_dynamic_batch`, beside
   verl's own, and restores the order with verl's `restore_dynamic_batch`.
Work is verl's own estimate (`calculate_workload`) for both. See docs/verl.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    import torch
    from verl import DataProto
    from verl.utils import seqlen_balancing as vs

    from balancer.integrations import verl as bv

    rng = np.random.default_rng(0)
    n, width = 256, 2048
    lengths = np.minimum(width, np.maximum(8, (rng.pareto(1.2, n) * 80).astype(int)))
    mask = torch.arange(width)[None] < torch.as_tensor(lengths)[:, None]
    ids = torch.randint(0, 32000, (n, width))
    uid = np.repeat(np.arange(n // 4), 4).astype(object)
    batch = DataProto.from_dict({"input_ids": ids, "attention_mask": mask.long()}, {"uid": uid})
    work = bv.VERL_WORKLOAD.cost(lengths)

    theirs = vs.get_seqlen_balanced_partitions(work.tolist(), 4, equal_size=True)
    ours = bv.balance_batch(batch, 4)  # reorders `batch` in place: chunk r is rank r's share
    mean = work.sum() / 4
    print(f"DP balance, heaviest rank / mean: verl {max(work[p].sum() for p in theirs) / mean:.4f}, "
          f"balancer {max(work[p].sum() for p in ours) / mean:.4f}")  # fmt: skip

    share = batch.chunk(4)[0]
    v_mb, v_idx = vs.prepare_dynamic_batch(share, max_token_len=2048)
    o_mb, o_idx = bv.prepare_dynamic_batch(share, max_token_len=2048)
    w = bv.VERL_WORKLOAD.cost(bv.sequence_lengths(share))
    print(f"micro-batches of rank 0: verl {len(v_idx)} (heaviest {max(w[p].sum() for p in v_idx):.3g}), "
          f"balancer {len(o_idx)} (heaviest {max(w[p].sum() for p in o_idx):.3g})")  # fmt: skip
    out = torch.cat([mb.batch["input_ids"] for mb in o_mb])
    assert torch.equal(vs.restore_dynamic_batch(out, o_idx), share.batch["input_ids"])
    print("restore_dynamic_batch undoes balancer's micro-batches: True")


if __name__ == "__main__":
    main()
