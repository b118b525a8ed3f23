"""torchdata's StatefulDataLoader over BalancedBatchSampler + PackedCollator: a state taken mid-epoch, loaded into a
fresh loader (new sampler, new dataset object), yields exactly the remainder of the uninterrupted epoch, with 0 and
2 workers, and the state survives a JSON-free torch.save round trip."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from balancer import BalancedBatchSampler, CostModel, PackedCollator, Topology

tdl = pytest.importorskip("torchdata.stateful_dataloader")

LENGTHS = np.random.default_rng(0).integers(1, 90, 60)
TOPO = Topology(dp=2, cp=2, micro_batches=3, max_tokens=64, tokens_per_step=600)
COST = CostModel(attn_coef=1e-3, linear_coef=1.0)


class _Docs(torch.utils.data.Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        return {"input_ids": torch.arange(int(LENGTHS[i])) + 1000 * int(i)}  # the tokens say which document


def _loader(workers: int, epoch: int = 1):
    sampler = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=3)
    sampler.set_epoch(epoch)
    return tdl.StatefulDataLoader(
        _Docs(), batch_sampler=sampler, collate_fn=PackedCollator(cp_rank=1, cp_size=2), num_workers=workers
    )


def _ids(batches) -> list[list[int]]:
    return [b["input_ids"][0].tolist() for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_state_resumes_identical_remainder(workers):
    full = _ids(_loader(workers))
    assert len(full) >= 6
    stop = len(full) // 2 + 1  # mid-step: not a multiple of micro_batches
    loader = _loader(workers)
    it = iter(loader)
    head = _ids(next(it) for _ in range(stop))
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    del it, loader
    fresh = _loader(workers, epoch=0)  # the state carries the epoch
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    rest = _ids(fresh)
    assert head == full[:stop]
    assert rest == full[stop:]
    assert _ids(fresh) == full  # the next pass over the loader is the whole epoch again
