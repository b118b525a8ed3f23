"""Spawn real torch.distributed (gloo) worlds on a free local port for tests and benchmarks."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=180),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        sys.stderr.write(f"[rank {rank}/{world}] " + traceback.format_exc())
        sys.stderr.flush()
        raise
    finally:
        dist.destroy_process_group()
    leave_without_finalization()


def leave_without_finalization() -> None:
    """End a finished rank without interpreter finalization: gloo's C++ threads can still hold work objects whose
    tensors are freed while Python tears down, which aborts the process (SIGABRT, "terminate called without an
    active exception": seen in clean-clone CI runs after every rank had finished and checked its results)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(world: int, fn, *args, threads: int = 1) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined in a gloo group; an exception (a
    failed assert) in any process fails the caller. ``fn`` must be a module-level function."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_entry, args=(world, free_port(), fn, args, threads), nprocs=world, join=True)
