"""The single-process simulation of every method's kernel sequence (all CP ranks' shards in one process) is exact
against single-device attention, forward and backward, with masks and GQA; the timed backend sees every call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attn_ref import reference

from attention.backends import get_backend
from attention.simulate import TimedBackend, simulate


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_simulation_is_exact(method):
    lens = [21, 1, 9, 12, 5]
    cu = np.concatenate([[0], np.cumsum(lens)])
    gen = torch.Generator().manual_seed(0)
    T = int(cu[-1])
    q = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(T, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(T, 4, 8, generator=gen, dtype=torch.float64)
    configs = [
        (2, "zigzag", True, (-1, -1), 0.0),
        (4, "zigzag", True, (6, -1), 1.5),
        (2, "contiguous", False, (3, 4), 0.0),
    ]
    for cp, kind, causal, window, softcap in configs[: 1 + ["ring", "allgather", "ulysses"].index(method)]:
        calls = []

        def record(kind_, seconds, pieces, calls=calls):
            calls.append((kind_, len(pieces)))

        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = reference(qr, kr, vr, cu, causal, 0.3, window, softcap)
        ref_g = torch.autograd.grad(ref, (qr, kr, vr), dout)
        be = TimedBackend(get_backend("torch", q, k), record)
        out, grads = simulate(q, k, v, cu, cp, method, kind, causal, 0.3, window, softcap, be, dout)
        ref = ref.detach()
        assert float((out - ref).abs().max()) <= 1e-9 * float(ref.abs().max())
        for g, rg in zip(grads, ref_g):
            assert float((g - rg).abs().max()) <= 1e-9 * max(1.0, float(rg.abs().max()))
        assert {c[0] for c in calls} == {"fwd", "bwd"} and all(n > 0 for _, n in calls)
