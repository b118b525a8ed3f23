"""Drop-ins for verl's sequence balancing and dynamic micro-batching, on verl's own ``DataProto`` (verl 0.9.1).

- ``balance_batch(batch, dp_size, ...)``: what ``RayPPOTrainer._balance_batch`` does - reorder the batch in place so
  that verl's dispatch (equal contiguous chunks, one per DP rank) hands every rank the same number of sequences and
  about the same work - planned by ``balancer.balance_batch(..., equal_counts=True)`` instead of Karmarkar-Karp.
  ``mini_batch_size`` balances every PPO mini-batch slice on its own (verl's ``keep_minibatch``: a mini-batch keeps
  the sequences verl gave it), ``uid_key`` keeps the sequences of one prompt on one rank (verl's prefix grouping).
- ``prepare_dynamic_batch(data, max_token_len, ...)``: the same signature and result as
  ``verl.utils.seqlen_balancing.prepare_dynamic_batch`` (micro-batch ``DataProto``s and the index lists that
  ``verl.utils.seqlen_balancing.restore_dynamic_batch`` undoes), planned by ``balancer.balance_batch(...,
  micro_batches="auto")``: the fewest micro-batches whose real tokens fit ``max_token_len``, balanced by work; with
  ``dp_group`` every rank gets the same count (the largest), as verl does.

Work is the per-sequence cost of ``cost``; the default, ``VERL_WORKLOAD``, is verl's own estimate
(``calculate_workload``: ``24576 * L + L^2``, a 7B model), so both balance the same figure; pass
``CostModel.from_config(config)`` for your model. A sequence's length is the sum of its ``attention_mask`` row.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

try:
    from verl import DataProto
except ImportError as exc:  # pragma: no cover - exercised without verl only
    raise ImportError(
        "balancer.integrations.verl needs verl: pip install --no-deps verl==0.9.1 tensordict omegaconf (tools/setup.sh "
        "test does it)"
    ) from exc

from balancer.planning.batch.balance import balance_batch as plan_batch
from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.training.plan_batches import plan_micro_batches

# verl's calculate_workload(L) = 24576 * L + L^2 = 2 * L(L+1)/2 + 24575 * L
VERL_WORKLOAD = CostModel(attn_coef=2.0, linear_coef=24575.0)


def sequence_lengths(batch: DataProto) -> np.ndarray:
    """Real tokens of every sequence: the row sums of `attention_mask`."""
    mask = batch.batch["attention_mask"]
    return mask.reshape(mask.shape[0], -1).sum(-1).cpu().numpy().astype(np.int64)


def _rank_partitions(lengths: np.ndarray, dp: int, cost: CostModel, groups, seed: int) -> list[list[int]]:
    """`dp` lists of positions, equal counts, balanced work; `groups` (one id per sequence) kept on one rank."""
    if len(lengths) % dp:
        raise ValueError(f"a batch of {len(lengths)} sequences cannot be dealt equally to dp_size={dp} ranks")
    topo = Topology(dp=dp, cp=1, micro_batches=1, max_tokens=int(lengths.sum()), tokens_per_step=None)
    plan = plan_batch(lengths, topo, cost, groups=groups, equal_counts=True, seed=seed)
    parts = [sorted(int(i) for mb in plan_micro_batches(plan, r) for i in mb) for r in range(dp)]
    if len({len(p) for p in parts}) != 1:  # groups of unequal sizes can make equal counts impossible
        raise ValueError(
            f"cannot give every one of the {dp} ranks the same number of sequences with these groups "
            f"(counts {[len(p) for p in parts]}); verl's dispatch needs equal chunks"
        )
    return parts


def dp_partitions(
    batch: DataProto,
    dp_size: int,
    cost: Optional[CostModel] = None,
    *,
    mini_batch_size: Optional[int] = None,
    uid_key: Optional[str] = None,
    seed: int = 0,
) -> list[list[int]]:
    """Per DP rank, the batch positions it trains (equal counts). `mini_batch_size`: balance every slice of that
    many sequences separately (a rank's list holds its share of slice 0, then slice 1, ...). `uid_key`: a
    `non_tensor_batch` column whose equal values stay on one rank."""
    cost = VERL_WORKLOAD if cost is None else cost
    lengths = sequence_lengths(batch)
    groups = None
    if uid_key is not None:
        groups = np.unique(np.asarray(batch.non_tensor_batch[uid_key]), return_inverse=True)[1].reshape(-1)
    size = len(lengths) if mini_batch_size is None else int(mini_batch_size)
    if size < 1 or len(lengths) % size:
        raise ValueError(f"mini_batch_size={mini_batch_size} does not divide the batch of {len(lengths)} sequences")
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, len(lengths), size):
        sl = slice(start, start + size)
        g = None if groups is None else groups[sl]
        for r, part in enumerate(_rank_partitions(lengths[sl], dp_size, cost, g, seed)):
            out[r].extend(start + i for i in part)
    return out


def balance_batch(
    batch: DataProto,
    dp_size: int,
    cost: Optional[CostModel] = None,
    *,
    mini_batch_size: Optional[int] = None,
    uid_key: Optional[str] = None,
    seed: int = 0,
) -> list[list[int]]:
    """Reorder `batch` in place (`DataProto.reorder`) so that its `dp_size` equal contiguous chunks are the ranks'
    balanced shares (`dp_partitions`); returns the partitions. Each rank's sequences are ordered light, heavy,
    light (small at both ends, as verl does, for pipeline warm-up and cool-down)."""
    cost = VERL_WORKLOAD if cost is None else cost
    parts = dp_partitions(batch, dp_size, cost, mini_batch_size=mini_batch_size, uid_key=uid_key, seed=seed)
    work = cost.cost(sequence_lengths(batch))
    if uid_key is None and mini_batch_size is None:
        for r, part in enumerate(parts):
            part = sorted(part, key=lambda i: (work[i], i))
            parts[r] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([i for part in parts for i in part]))
    return parts


def _micro_batch_count(lengths: np.ndarray, max_token_len: int, least: int, multiple: int, cost, dp_group) -> int:
    """The fewest count >= `least` (a multiple of `multiple`) whose balanced micro-batches fit `max_token_len`;
    with `dp_group`, the largest over its ranks."""
    topo = Topology(dp=1, cp=1, micro_batches=max(1, least), max_tokens=max_token_len, tokens_per_step=None)
    plan = plan_batch(lengths, topo, cost, micro_batches="auto", micro_batch_multiple=multiple)
    count = plan.topology.micro_batches
    if dp_group is not None and dist.is_initialized():
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        count = int(t.item())
    return count


def prepare_dynamic_batch(
    data: DataProto,
    max_token_len: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    cost: Optional[CostModel] = None,
) -> tuple[list[DataProto], list[list[int]]]:
    """verl's `prepare_dynamic_batch` on balanced micro-batches (module docstring): `(micro_batches, index lists)`;
    each micro-batch holds at most `max_token_len` real tokens and every sequence is in exactly one."""
    cost = VERL_WORKLOAD if cost is None else cost
    lengths = sequence_lengths(data)
    if max_token_len < int(lengths.max()):
        raise ValueError(f"max_token_len={max_token_len} is less than the longest sequence ({int(lengths.max())})")
    least = max(min_num_micro_batch or 1, math.ceil(int(lengths.sum()) / max_token_len))
    multiple = int(num_batches_divided_by or 1)
    group = dp_group if same_micro_num_in_dp else None
    count = _micro_batch_count(lengths, max_token_len, least, multiple, cost, group)
    if count > len(lengths):
        raise ValueError(f"{count} micro-batches asked of {len(lengths)} sequences: every micro-batch needs one")
    topo = Topology(dp=1, cp=1, micro_batches=count, max_tokens=max_token_len, tokens_per_step=None)
    plan = plan_batch(lengths, topo, cost)
    parts = [sorted(int(i) for i in mb) for mb in plan_micro_batches(plan, 0)]
    if use_dynamic_bsz_balance:  # verl's order: heavy in the middle, light at both ends
        work = cost.cost(lengths)
        parts.sort(key=lambda p: (float(work[p].sum()), p[0]), reverse=True)
        parts = parts[::2][::-1] + parts[1::2]
    micro = []
    for part in parts:
        mb = data.select_idxs(torch.tensor(part, dtype=torch.int64))
        mb.meta_info = copy.deepcopy(data.meta_info)
        micro.append(mb)
    return micro, parts
