"""Training steps of several plans on real processes: the worker behind benchmarks/replay.py.

One spawned gloo world of `dp * cp` processes (rank = replica * cp + cp_rank); every plan gets its own model (same
seed, `balancer.calibration.build_model`) and AdamW optimizer. A step of a plan is what training runs: every
micro-batch of the rank's replica (forward + loss + backward under the plan's CP layout, gradients accumulated),
then the gradients summed over all ranks (one all-reduce of a flat buffer, gloo: the DP all-reduce; with CP the CP
ranks' partial gradients are summed by the same call), then the optimizer step. Plans are interleaved step by step
(step 0 of every plan, then step 1, ...), so a change of load during the run reaches every plan alike, and the order
of the plans within a step rotates from step to step (starting at `payload["offset"]`), so that no plan always runs
first after the others' steps.

Per step and rank: wall and process CPU seconds of every micro-batch, of the all-reduce and of the optimizer step,
and the step's wall time from a barrier before it to the end of the optimizer step.
"""

from __future__ import annotations

import datetime
import gc
import json
import time
from pathlib import Path

import numpy as np


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> list[float]:
    wall, cpu = _clocks()
    return [wall - start[0], cpu - start[1]]


def _run_micro_batch(model, lengths, layout_kind: str, cp: int, cp_rank: int, group, scale: float, seed: int):
    import torch

    import attention.hf
    from attention import CPLayout
    from balancer.calibration.timing import shifted_labels

    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    layout = CPLayout.build(cu, cp, kind=layout_kind)
    ids = torch.randint(0, int(model.config.vocab_size), (int(cu[-1]),), generator=torch.Generator().manual_seed(seed))
    labels = shifted_labels(ids, cu)
    local_ids, local_labels = layout.shard(ids, cp_rank)[None], layout.shard(labels, cp_rank)
    pos = torch.from_numpy(layout.position_ids(cp_rank))[None]
    with attention.hf.cp_context(layout, group=group, method="ring"):
        logits = model(input_ids=local_ids, position_ids=pos).logits
    loss = torch.nn.functional.cross_entropy(logits[0], local_labels, ignore_index=-100, reduction="sum") * scale
    loss.backward()
    return float(loss.detach())


def _step(model, optimizer, step: dict, cp: int, cp_rank: int, cp_group) -> dict:
    """One optimizer step of one plan on this rank: `step["micro_batches"]` (this replica's), `step["tokens"]`
    (label tokens in the whole step, all replicas: the loss is the step's token mean)."""
    import torch
    import torch.distributed as dist

    scale = 1.0 / max(1, step["tokens"])
    dist.barrier()
    begin = _clocks()
    micro, loss = [], 0.0
    for j, lengths in enumerate(step["micro_batches"]):
        start = _clocks()
        loss += _run_micro_batch(model, lengths, step["layout"], cp, cp_rank, cp_group, scale, step["seed"] + j)
        micro.append(_since(start))
    start = _clocks()
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    reduce = _since(start)
    start = _clocks()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    opt = _since(start)
    return {"micro_batches": micro, "all_reduce": reduce, "optimizer": opt, "step": _since(begin), "loss": loss}


def worker(rank: int, world: int, port: int, payload: dict, out_path: str) -> None:
    """`payload`: config, dp, cp, threads, plans ({name: {"layout", "steps": [[replica micro-batches...]...],
    "tokens": [label tokens per step]}}), offset (where the rotation of the plans' order starts, default 0). Writes
    rank-wise results to `out_path`.rank."""
    import torch
    import torch.distributed as dist

    from balancer.calibration import build_model

    torch.set_num_threads(payload["threads"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(hours=2)
    )
    try:
        cp = payload["cp"]
        replica, cp_rank = divmod(rank, cp)
        groups = [dist.new_group(list(range(r * cp, (r + 1) * cp))) for r in range(payload["dp"])]
        plans = payload["plans"]
        models = {name: build_model(payload["config"]) for name in plans}
        optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-4) for name in plans}
        results = {name: [] for name in plans}
        for name, plan in plans.items():  # warm-up: one untimed micro-batch per plan, gradients dropped
            first = plan["steps"][0][replica][0]
            _run_micro_batch(models[name], first, plan["layout"], cp, cp_rank, groups[replica], 1.0, 0)
            models[name].zero_grad(set_to_none=True)
        gc.collect()
        gc.disable()
        longest = max(len(plan["steps"]) for plan in plans.values())
        names = list(plans)
        for k in range(longest):
            shift = (k + payload.get("offset", 0)) % len(names)
            for name in names[shift:] + names[:shift]:
                plan = plans[name]
                if k >= len(plan["steps"]):
                    continue
                step = {
                    "micro_batches": plan["steps"][k][replica],
                    "tokens": plan["tokens"][k],
                    "layout": plan["layout"],
                    "seed": 1000 * k,
                }
                results[name].append(_step(models[name], optimizers[name], step, cp, cp_rank, groups[replica]))
            if k % 16 == 15:
                gc.collect()
        gc.enable()
        Path(f"{out_path}.{rank}").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
