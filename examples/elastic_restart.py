"""A balanced training loop that survives a restart on another number of processes (no torchft): run it under
torchrun's elastic agent; when a node dies the agents restart the workers on the nodes left, every worker builds
the sampler for the new world size and resumes from the last checkpoint, every document of the epoch once.

    torchrun --nnodes 1:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --max-restarts 3 \\
        examples/elastic_restart.py --ckpt ckpt/          # the same command on every node

The checkpoint (rank 0 writes it every `--save-every` optimizer steps, atomically) holds the model, the optimizer,
the step and the sampler's state at a step boundary, which `load_state_dict` resumes onto any DP size: the rest of
the window is planned again for the new topology (docs/fault-tolerance.md). `--trace DIR` writes what every rank
trained, one JSON line per step (tests/integrations/test_torchft_restart.py checks it); `--die-at STEP` makes the
last rank's node die (its agent and itself, SIGKILL) after that step of the first run; with `--die-alone` only the
worker dies (a job whose launcher then stops, restarted by hand or by a scheduler on fewer processes);
`--hold-at STEP` makes every rank given it write `held-rank<R>` into the trace folder at the end of that step of the
first start and wait there, to be killed from outside with its node (tests/integrations/test_elastic_restart.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import balancer
from balancer.training import Span


def lengths_of(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return np.minimum(rng.lognormal(3.5, 1.0, n).astype(np.int64) + 2, 200)


def save(path: Path, step: int, model, opt, sampler) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state_dict()},
               tmp)  # fmt: skip
    os.replace(tmp, path)  # a checkpoint is whole or absent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hold-at", type=int, default=-1, help="after tracing this step of a first start, wait (tests)")
    ap.add_argument("--die-alone", action="store_true", help="with --die-at: only the worker dies, not its agent")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = lengths_of(args.docs)
    # the step keeps its tokens (the global batch) whatever the world size: fewer ranks take more micro-batches
    topo = balancer.Topology(dp=world, micro_batches=-(-6 // world), max_tokens=256, tokens_per_step=1000)
    cost = balancer.CostModel(attn_coef=1.0, linear_coef=64.0)
    sampler = balancer.BalancedBatchSampler(lengths, topo, cost, dp_rank=rank, seed=0, window_docs=200)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt, step = Path(args.ckpt) / "last.pt", 0
    if ckpt.exists():  # a restart: the same checkpoint on every rank, whatever the world size was
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.load_state_dict(state["sampler"])
        step = state["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(Path(args.trace) / f"rank{rank}_restart{restart}.jsonl", "a", buffering=1) if args.trace else None
    batches = iter(sampler)
    for k in range(sampler.num_steps):  # the steps left from the checkpoint (its window re-planned for this world)
        mbs = [next(batches) for _ in range(sampler.step_micro_batches(k))]
        loss = sum(model(torch.tensor([[len(mb), 1.0, 0.5, -1.0]], dtype=torch.float64)).sum() for mb in mbs)
        loss.backward()
        for p in model.parameters():  # the gradient reduction (DDP's), where a dead rank shows up
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        step += 1
        if log:
            log.write(json.dumps({"rank": rank, "world": world, "restart": restart, "step": step, "mbs": [
                [[x.doc, x.start, x.end] if isinstance(x, Span) else [int(x)] for x in mb]
                for mb in mbs]}) + "\n")  # fmt: skip
        if rank == 0 and step % args.save_every == 0:
            save(ckpt, step, model, opt, sampler)
        if step == args.die_at and restart == 0 and rank == world - 1:
            if not args.die_alone:
                os.kill(os.getppid(), signal.SIGKILL)  # this node's agent dies, then the node's worker
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hold_at and restart == 0 and args.trace:
            (Path(args.trace) / f"held-rank{rank}").touch()
            while True:  # until killed from outside, with its node (the peers wait in the next reduction)
                time.sleep(1)
    if rank == 0:
        save(ckpt, step, model, opt, sampler)
    dist.barrier()  # no rank tears its gloo connections down while a peer still works (a loaded machine aborted one)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
