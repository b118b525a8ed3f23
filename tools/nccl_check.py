"""Multi-GPU check of cp_attention over NCCL, run by torchrun: every method x (plain, sliding window + softcap) in
bf16 with the torch CUDA backend against single-device varlen_attention, output and gradients; also checks that a
"cpu:gloo,cuda:nccl" group sends CUDA tensors over NCCL (comm device = the GPU).

    torchrun --nproc_per_node=2 tools/nccl_check.py                 # GPUs, NCCL
    torchrun --nproc_per_node=2 tools/nccl_check.py --device cpu    # CPU, gloo (how the tests run it)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attention  # noqa: E402
from attention._dist import Group  # noqa: E402


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (NCCL, default) or cpu (gloo)")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device, backend, dtype, tol = torch.device("cuda"), "cpu:gloo,cuda:nccl", torch.bfloat16, (1e-2, 2e-2)
    else:
        device, backend, dtype, tol = torch.device("cpu"), "gloo", torch.float64, (1e-9, 1e-9)
    dist.init_process_group(backend)
    assert Group.of(None, device).comm_device.type == device.type, "CUDA tensors must travel over NCCL"
    lens = (
        np.array([700, 33, 1, 2048, 90, 2 * world + 1])
        if device.type == "cuda"
        else np.array([70, 3, 1, 99, 2 * world + 1])
    )
    cu = np.concatenate([[0], np.cumsum(lens)])
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(int(cu[-1]), h, 64, generator=gen).to(device, dtype) for h in (8, 2, 2, 8))
    layout = attention.CPLayout.build(cu, world)
    for method in ("ring", "allgather", "ulysses"):
        for window, softcap in (((-1, -1), 0.0), ((24, -1), 0.0)):
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            ref = attention.varlen_attention(*x, cu, window_size=window, softcap=softcap)
            ref_g = torch.autograd.grad(ref, x, dout)
            xl = [layout.shard(t, rank).detach().requires_grad_() for t in (q, k, v)]
            out = attention.cp_attention(*xl, layout, method=method, window_size=window, softcap=softcap)
            grads = torch.autograd.grad(out, xl, layout.shard(dout, rank))
            errs = [rel(out, layout.shard(ref, rank))] + [rel(g, layout.shard(r, rank)) for g, r in zip(grads, ref_g)]
            ok = errs[0] <= tol[0] and max(errs[1:]) <= tol[1]
            print(f"rank {rank} {method} window {window}: max rel error {max(errs):.1e} {'ok' if ok else 'FAIL'}")
            assert ok, (method, window, errs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
