"""The bytes counter (``attention._dist.bytes_sent``) counts what every CP attention method really hands to other
ranks, on real gloo worlds: each rank taps torch.distributed (the tap only adds up the sizes of the tensors passed
to each send and collective, then calls the real function) and compares the tally with the counter, for ring,
all-gather and Ulysses, forward + backward; and both with closed formulas computed from the tensor shapes. Also:
the all-gather backward's reduce-scatter uses the collective chosen for the backend and fails naming it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.dist import run_world

from attention import CPLayout, _dist, cp_attention
from attention.ulysses import kv_replication

pytestmark = pytest.mark.slow  # multi-process gloo


def _nbytes(t: torch.Tensor, rows: int | None = None) -> int:
    per_row = math.prod(t.shape[1:]) if t.dim() else 1
    return (t.shape[0] if rows is None else rows) * per_row * t.element_size() if t.dim() else t.element_size()


class _Tap:
    """Wraps the torch.distributed functions cp_attention uses; ``sent`` = bytes addressed to other ranks."""

    NAMES = ("batch_isend_irecv", "all_gather", "all_to_all_single", "all_to_all", "reduce_scatter")

    def __init__(self) -> None:
        self.sent = 0
        self.real = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self):
        for name in self.NAMES:
            setattr(dist, name, getattr(self, name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def batch_isend_irecv(self, ops):
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op.__name__ == "isend")
        return self.real["batch_isend_irecv"](ops)

    def all_gather(self, parts, tensor, group=None, async_op=False):
        if tensor.is_floating_point():  # not the int64 consistency check, which the counter leaves out
            self.sent += (dist.get_world_size(group) - 1) * _nbytes(tensor)
        return self.real["all_gather"](parts, tensor, group=group, async_op=async_op)

    def all_to_all_single(self, out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me = dist.get_rank(group)
        self.sent += _nbytes(inp, inp.shape[0] - input_split_sizes[me])
        return self.real["all_to_all_single"](out, inp, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_to_all(self, outs, ins, group=None, **kw):
        me = dist.get_rank(group)
        self.sent += sum(_nbytes(t) for s, t in enumerate(ins) if s != me)
        return self.real["all_to_all"](outs, ins, group=group, **kw)

    def reduce_scatter(self, out, ins, op=dist.ReduceOp.SUM, group=None, **kw):
        me = dist.get_rank(group)
        self.sent += sum(_nbytes(t) for s, t in enumerate(ins) if s != me)
        return self.real["reduce_scatter"](out, ins, op=op, group=group, **kw)


def _formula(layout: CPLayout, rank: int, method: str, heads: int, kv_heads: int, dim: int, elem: int) -> int:
    """Forward + backward bytes from the shapes (float64: gradients travel in the input dtype)."""
    c = layout.cp_size
    if method == "ulysses":
        kv = kv_heads * kv_replication(heads, kv_heads, c)
        mine, total = int(layout.local_counts[rank]), layout.num_tokens
        out_rows = (c - 1) * mine  # seq -> heads: this rank's tokens, the other ranks' head slices
        back_rows = total - mine  # heads -> seq: the other ranks' tokens of this rank's head slice
        fwd = out_rows * (heads + 2 * kv) // c + back_rows * heads // c  # q, k, v there; the output back
        bwd = out_rows * heads // c + back_rows * (heads + 2 * kv) // c  # dout there; dq, dk, dv back
        return (fwd + bwd) * dim * elem
    counts = layout.kv_counts
    row = 2 * kv_heads * dim * elem  # K and V of one token
    if method == "ring":
        kv_hops = sum(int(counts[(rank - i) % c]) for i in range(c - 1))  # forward; again backward
        dkv_hops = sum(int(counts[(rank - i) % c]) for i in range(1, c))
        return (2 * kv_hops + dkv_hops) * row
    return 3 * (c - 1) * int(counts.max()) * row  # gather forward, gather backward, reduce-scatter dK/dV


def _bytes_worker(rank, world):
    lens = np.array([30, 7, 50, 3, 12, 200, 9, 1])
    cu = np.concatenate([[0], np.cumsum(lens)])
    heads, kv_heads, dim = 2 * world, 2, 8
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(int(cu[-1]), h, dim, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]
    checked = 0
    for kind, opts in (("zigzag", {}), ("hybrid", {"split_threshold": 40}), ("contiguous", {})):
        layout = CPLayout.build(cu, world, kind=kind, **opts)
        for method in ("ring", "allgather", "ulysses"):
            for dtype in (torch.float64, torch.float32):
                x = [layout.shard(t, rank).to(dtype).requires_grad_() for t in full]
                _dist.reset_bytes_sent()
                with _Tap() as tap:
                    cp_attention(*x, layout, method=method).sum().backward()
                got = _dist.bytes_sent()
                assert got == tap.sent, (kind, method, dtype, got, tap.sent)
                assert got > 0, (kind, method, dtype)
                if dtype == torch.float64:
                    want = _formula(layout, rank, method, heads, kv_heads, dim, 8)
                    assert got == want, (kind, method, got, want)
                checked += 1
    assert checked == 18


@pytest.mark.parametrize("world", [2, 3])
def test_every_method_counts_the_bytes_it_sends(world):
    """ring, allgather and ulysses on zigzag, hybrid and contiguous layouts, float64 and float32: the counter equals
    the bytes handed to torch.distributed for other ranks, and the shape formula (float64)."""
    run_world(world, _bytes_worker)


def _reduce_scatter_worker(rank, world):
    g = _dist.Group.of(None, torch.device("cpu"))
    assert _dist.device_backend(g) == "gloo"
    blocks = [torch.full((3,), float(10 * rank + s)) for s in range(world)]
    got = _dist.reduce_scatter_sum(g, blocks)
    assert torch.equal(got, torch.full((3,), float(sum(10 * r + rank for r in range(world)))))
    with pytest.raises(RuntimeError, match="'gloo' process-group backend"):
        _dist.reduce_scatter_sum(g, [torch.zeros(3, dtype=torch.float8_e4m3fn)] * world)  # gloo has no float8


def test_reduce_scatter_is_chosen_by_backend_and_fails_naming_it():
    """gloo: all_to_all plus a local sum, exact; a failing collective raises naming the backend (no retry with
    another collective)."""
    run_world(2, _reduce_scatter_worker)
