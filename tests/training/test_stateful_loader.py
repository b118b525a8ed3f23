"""torchdata's StatefulDataLoader over BalancedBatchSampler + PackedCollator: a state taken mid-epoch, loaded into a
fresh loader (new sampler, new dataset object), yields exactly the remainder of the uninterrupted epoch, with 0 and
2 workers, and the state survives a JSON-free torch.save round trip; with planning windows too, cut mid-window, at a
window boundary and just after one."""

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


def _loader(workers: int, epoch: int = 1, window_docs=None):
    sampler = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=3, window_docs=window_docs)
    sampler.set_epoch(epoch)
    return tdl.StatefulDataLoader(
        _Docs(), batch_sampler=sampler, collate_fn=PackedCollator(cp_rank=1, cp_size=2), num_workers=workers
    )


def _ids(batches) -> list[list[int]]:
    return [b["input_ids"][0].tolist() for b in batches]


def _cut_and_resume(workers: int, stop: int, window_docs=None) -> None:
    full = _ids(_loader(workers, window_docs=window_docs))
    loader = _loader(workers, window_docs=window_docs)
    it = iter(loader)
    head = _ids(next(it) for _ in range(stop))
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    del it, loader
    fresh = _loader(workers, epoch=0, window_docs=window_docs)  # the state carries the epoch
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    rest = _ids(fresh)
    assert head == full[:stop]
    assert rest == full[stop:], stop
    assert _ids(fresh) == full  # the next pass over the loader is the whole epoch again


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_state_resumes_identical_remainder(workers):
    full = _ids(_loader(workers))
    assert len(full) >= 6
    _cut_and_resume(workers, len(full) // 2 + 1)  # mid-step: not a multiple of micro_batches


@pytest.mark.slow  # DataLoader worker processes
@pytest.mark.parametrize("workers", [0, 2])
def test_windowed_resume_at_and_across_window_boundaries(workers):
    sampler = BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=1, seed=3, window_docs=20)
    sampler.set_epoch(1)
    assert sampler.num_windows == 3
    boundary = sampler.windows.steps(0) * TOPO.micro_batches  # first micro-batch of window 1
    for stop in (boundary - 1, boundary, boundary + 1, boundary + sampler.windows.steps(1) * TOPO.micro_batches):
        _cut_and_resume(workers, stop, window_docs=20)
