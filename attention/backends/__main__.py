"""``python -m attention.backends [--device DEV]``: print which attention kernels are installed, what
``backend="auto"`` chooses for each mask and why (:func:`attention.backends.report`)."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from attention.backends.report import report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attention.backends", description=__doc__)
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA device 0 if any, else cpu)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension of the probe tensors (default 128)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(report(args.device, head_dim=args.head_dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
