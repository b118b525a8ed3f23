"""Timing forward + backward of a real transformers model on packed micro-batches, on CP groups over gloo.

All micro-batches run in one spawned gloo world as large as the largest CP size (one thread per process by default);
a micro-batch of CP size c runs on ranks 0..c-1 while the others wait. Every process builds the same model from the
config (same seed), and for every micro-batch shards it with `attention.CPLayout`, runs the
model under `attention.hf.cp_context`, and times forward + loss + backward between barriers. A micro-batch's time is
the slowest rank's (all-reduced max), on two clocks: wall time and process CPU time (on a machine shared with other
jobs, CPU time is what a rank would take alone on its core: it does not count time the process waited to be
scheduled). The micro-batches are timed in rounds, each round every micro-batch once (after one warm-up run per CP
size): `repeats` rounds, then more, up to `max_repeats`, for those whose two fastest runs do not agree within 2% yet.
A micro-batch's runs are so spread over the whole timing: a burst of load from other jobs slows one of its runs
rather than all of them, and the fastest stays an undisturbed one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

import datetime
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GC_EVERY = 32  # micro-batches between garbage collections
SETTLE = 0.02  # a micro-batch is re-run (up to max_repeats) until its two fastest runs agree within 2%
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 65536,
}


def build_model(config: dict) -> Any:
    """A randomly initialised causal LM from a transformers config dict, using the CP attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import attention.hf

    attention.hf.register()
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("model config needs a 'model_type' (e.g. \"llama\")")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    hf_config._attn_implementation = attention.hf.NAME
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention.hf.NAME)
    return model.float().train()


def shifted_labels(ids: torch.Tensor, cu: np.ndarray) -> torch.Tensor:
    """Next-token labels of packed documents: each token predicts the next one of its document."""
    labels = ids.roll(-1).clone()
    labels[cu[1:] - 1] = -100  # a document's last token predicts nothing
    return labels


def _time_one(model, layout, rank: int, ids, labels, method: str, group) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of forward + backward, each the max over the CP group."""
    import torch
    import torch.distributed as dist

    import attention.hf

    local_ids = layout.shard(ids, rank)[None]
    local_labels = layout.shard(labels, rank)
    pos = torch.from_numpy(layout.position_ids(rank))[None]
    count = max(1, int((labels != -100).sum()))
    model.zero_grad(set_to_none=True)
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), time.process_time()
    with attention.hf.cp_context(layout, group=group, method=method):
        logits = model(input_ids=local_ids, position_ids=pos).logits
    loss = torch.nn.functional.cross_entropy(logits[0], local_labels, ignore_index=-100, reduction="sum") / count
    loss.backward()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed[0]), float(elapsed[1])


def settled(runs: list[tuple[float, float]], clocks: tuple[int, ...] = (1,)) -> bool:
    """True when the two fastest runs agree within `SETTLE` on every clock in `clocks` (0 wall, 1 CPU): the minimum
    is then a stable estimate of the undisturbed time. Every rank of a CP group sees the same all-reduced times, so
    they all decide alike."""
    if len(runs) < 2:
        return False
    for c in clocks:
        first, second = sorted(r[c] for r in runs)[:2]
        if second > first * (1.0 + SETTLE):
            return False
    return True


def _prepare(model, jobs: list[dict], rank: int, groups: dict, method: str) -> list[tuple | None]:
    """`_time_one`'s arguments for every job this rank takes part in (ranks below the job's cp), None for others."""
    import torch

    from attention.layout import CPLayout

    vocab = int(model.config.vocab_size)
    out: list[tuple | None] = []
    for j, job in enumerate(jobs):
        cp = int(job["cp"])
        if rank >= cp:
            out.append(None)
            continue
        cu = np.concatenate([[0], np.cumsum(job["lengths"])]).astype(np.int64)
        layout = CPLayout.build(cu, cp, kind=job["layout"], **job.get("options", {}))
        ids = torch.randint(0, vocab, (int(cu[-1]),), generator=torch.Generator().manual_seed(j))
        out.append((model, layout, rank, ids, shifted_labels(ids, cu), method, groups[cp]))
    return out


def _run_jobs(model, jobs: list[dict], rank: int, groups: dict, payload: dict, bar) -> list:
    """Time every job this rank takes part in. With `spread` (the default) in rounds: each round runs every job still
    unsettled once, in a seeded order of its own, so that a job's runs are spread over the whole timing instead of
    back to back (a burst of other jobs' load then slows one of its runs, not all); without, each job's runs back to
    back. Runs `repeats` and beyond are skipped for a job whose two fastest runs agree within `SETTLE`; `max_repeats`
    runs at most. The first job of each CP size runs once untimed first (allocator and kernel warm-up)."""
    args = _prepare(model, jobs, rank, groups, payload["method"])
    results: list[list[tuple[float, float]] | None] = [None if a is None else [] for a in args]
    warm: set[int] = set()
    count = 0

    def step(j: int, run: int) -> None:
        nonlocal count
        runs = results[j]
        if runs is None or (run >= payload["repeats"] and settled(runs, payload["settle_on"])):
            return  # ranks outside a job take part in none of its runs
        if count % GC_EVERY == 0:  # automatic collection is off while timing; a full collection costs ~0.1 s
            gc.collect()
        count += 1
        job_args = args[j]
        assert job_args is not None  # runs is not None only for jobs this rank takes part in
        if int(jobs[j]["cp"]) not in warm:
            _time_one(*job_args)
            warm.add(int(jobs[j]["cp"]))
        runs.append(_time_one(*job_args))
        finished = len(runs) >= payload["max_repeats"] or settled(runs, payload["settle_on"])
        if bar is not None and len(runs) >= payload["repeats"] and finished:
            bar.update()

    rng = np.random.default_rng([int(payload["seed"]), 2])  # the same on every rank: all take the same steps
    if payload["spread"]:
        for run in range(payload["max_repeats"]):
            for j in rng.permutation(len(jobs)):
                step(int(j), run)
    else:
        for j in range(len(jobs)):
            for run in range(payload["max_repeats"]):
                step(j, run)
    return results


def _worker(rank: int, world: int, port: int, payload: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(payload["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    try:
        jobs = payload["jobs"]
        # every rank creates every group, in the same order; jobs of CP size c run on ranks 0..c-1
        groups = {cp: dist.new_group(list(range(cp))) for cp in sorted({int(j["cp"]) for j in jobs})}
        model = build_model(payload["config"])
        bar = None
        if rank == 0 and payload["progress"] == "lines":
            bar = ProgressLines(len(jobs))
        elif rank == 0 and payload["progress"]:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="timing", unit="micro-batch")
        gc.disable()
        results = _run_jobs(model, jobs, rank, groups, payload, bar)
        gc.enable()
        if bar is not None:
            bar.close()
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's C++ threads can still hold work objects whose tensors Python
    # frees on the way out, which aborts the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ProgressLines:
    """Progress without a terminal (a log, a pipe, a batch job): a line on stderr at each quarter of the
    micro-batches and at least every PROGRESS_LINE_S seconds, so a long calibration shows it is alive."""

    PROGRESS_LINE_S = 30.0

    def __init__(self, total: int) -> None:
        self.total, self.done, self.quarter = total, 0, 1
        self.started = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        reached = self.done * 4 >= self.quarter * self.total
        if reached or now - self.last >= self.PROGRESS_LINE_S:
            share = self.done / self.total if self.total else 1.0
            sys.stderr.write(
                f"calibrate: timed {self.done:,} of {self.total:,} micro-batches ({share:.0%}), "
                f"{now - self.started:.0f} s\n"
            )
            sys.stderr.flush()
            self.last = now
            while self.quarter <= 4 and self.done * 4 >= self.quarter * self.total:
                self.quarter += 1

    def close(self) -> None:
        """Nothing to tear down (the bar's interface)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_micro_batches(
    config: dict,
    jobs: list[dict],
    *,
    method: str = "ring",
    repeats: int = 3,
    max_repeats: int | None = None,
    settle_on: str = "cpu",
    threads: int = 1,
    progress: bool = False,
    seed: int = 0,
    spread: bool = True,
) -> list[list[tuple[float, float]]]:
    """(wall, CPU) seconds of every run of every job (`{"lengths": [...], "cp": c, "layout": kind,
    "options": {...}}`), all run in one spawned gloo world of the largest `cp` (a job of CP size c runs on ranks
    0..c-1 while the others wait). The jobs run in rounds (each round every job once, in an order drawn from
    `seed`): `repeats` rounds, then further rounds for the jobs whose two fastest runs do not agree within `SETTLE`
    on the `settle_on` clock ("cpu", "wall" or "both") yet, `max_repeats` rounds at most (default: `repeats`, no
    re-runs). `spread=False` runs each job's runs back to back instead of in rounds."""
    import torch.multiprocessing as mp

    if not jobs:
        return []
    world = max(int(j["cp"]) for j in jobs)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    settle = {"cpu": (1,), "wall": (0,), "both": (0, 1)}
    if settle_on not in settle:
        raise ValueError(f"settle_on must be one of {sorted(settle)}, got {settle_on!r}")
    payload = dict(
        config=config, jobs=jobs, method=method, repeats=repeats, threads=threads, progress=progress, seed=seed
    )
    payload.update(max_repeats=max(repeats, max_repeats or repeats), settle_on=settle[settle_on], spread=bool(spread))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(world, _free_port(), payload, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())
