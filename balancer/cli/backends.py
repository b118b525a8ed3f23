"""`balancer backends`: which attention kernels are installed, what `backend="auto"` chooses and why
(attention.backends.report; the same as `python -m attention.backends`)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("backends", help="attention kernels installed, chosen, and why",
                       description=__doc__)  # fmt: skip
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA device 0 if any, else cpu)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension of the probe tensors (default 128)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch  # imported only when the command runs

    from attention.backends.report import report

    if args.device is not None:
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this PyTorch sees no CUDA device")
    if args.head_dim < 1:
        raise ValueError(f"--head-dim must be a positive int, got {args.head_dim}")
    print(report(args.device, head_dim=args.head_dim))
    return 0
