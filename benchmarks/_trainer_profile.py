"""Where each trainer_compare contender's process CPU goes: the cProfile files of `trainer_compare.py --profile`
(one per timed run and rank, timed by `time.process_time`) read into named parts, in CPU seconds per rank and epoch
(the mean over the timed runs' profiles).

A part is the cumulative time of the functions it names (path ending, function name), summed; a part with
alternatives (an override and the stock method it replaces without calling it, or each contender's own adapter)
takes the largest alternative, so nothing is counted twice. Parts nest as their names say ("of it"); the rest of
`train()` is the stock loop's own work (callbacks, state, the data loader's iteration) and what no part names."""

from __future__ import annotations

import glob
import pstats
from pathlib import Path

Funcs = list[tuple[str, str]]
STOCK_TRAINER = "transformers/trainer.py"
OURS = "balancer/trainers/trainer.py"
# (part, alternatives: each a list of (path ending, function name) summed)
PARTS: list[tuple[str, list[Funcs]]] = [
    ("train() in all", [[(STOCK_TRAINER, "train")]]),
    ("micro-batches: forward + backward (training_step)", [[(STOCK_TRAINER, "training_step")]]),
    ("  of it: attention kernel (varlen_attention, forward + backward)",
     [[("attention/varlen.py", "varlen_attention"), ("attention/varlen.py", "backward")]]),
    ("  of it: attention adapter, its kernel call included",
     [[("attention/hf.py", "cp_attention_forward")], [("benchmarks/_trainer_worker.py", "flat_varlen_attention")]]),
    ("  of it: loss", [[("balancer/training/loss.py", "token_loss")], [("loss/loss_utils.py", "ForCausalLMLoss")]]),
    ("  of it: balance monitor's timer", [[("balancer/measured/monitor.py", "timer")]]),
    ("step batches (get_batch_samples)", [[(STOCK_TRAINER, "get_batch_samples")]]),
    ("  of it: collator", [[("benchmarks/_trainer_worker.py", "__call__")]]),
    ("  of it: the step's loss-token count (a collective)",
     [[(OURS, "_get_num_items_in_batch")], [(STOCK_TRAINER, "_get_num_items_in_batch")]]),
    ("optimizer step", [[("accelerate/optimizer.py", "step")]]),
    ("gradient clipping", [[(STOCK_TRAINER, "_clip_grad_norm")]]),
    ("FLOPs estimate", [[(OURS, "floating_point_ops")], [(STOCK_TRAINER, "floating_point_ops")]]),
    ("logging (_maybe_log_save_evaluate)", [[(STOCK_TRAINER, "_maybe_log_save_evaluate")]]),
    ("balance monitor: end_step (a collective)", [[("balancer/measured/monitor.py", "end_step")]]),
    ("balance monitor: logged figures", [[("balancer/measured/monitor.py", "log_figures")]]),
    ("planning the epoch", [[("balancer/planning/planner.py", "plan")]]),
    ("memory release at the start of train() (gc.collect)", [[("accelerate/utils/memory.py", "clear_device_cache")]]),
]  # fmt: skip


def _cumulative(stats: pstats.Stats, ending: str, name: str) -> float:
    """Cumulative seconds of the functions `name` in files whose path ends with `ending` (all merged profiles)."""
    table = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table in this public, untyped attribute
    return sum(v[3] for (f, _, fn), v in table.items() if fn == name and f.endswith(ending))


def breakdown(folder: Path, mix: str, contender: str) -> dict | None:
    """{profiles, parts: {part: CPU seconds per rank and epoch}} of the contender's timed runs on `mix` in `folder`;
    None when it has none."""
    files = sorted(glob.glob(str(folder / f"{mix}-{contender}-rep*.prof")))
    if not files:
        return None
    stats = pstats.Stats(*files)
    parts = {}
    for part, alternatives in PARTS:
        seconds = max(sum(_cumulative(stats, e, n) for e, n in funcs) for funcs in alternatives)
        parts[part] = seconds / len(files)
    return dict(profiles=len(files), parts=parts)
