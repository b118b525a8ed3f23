"""Measured in the user's own trainer: balancer.hf.BalancedTrainer against the built-in ways to batch mixed lengths.

    .venv/bin/python benchmarks/trainer_compare.py            # both mixes, 2 timed repetitions, 3 stock seeds
    .venv/bin/python benchmarks/trainer_compare.py --quick    # smaller corpora, 1 repetition (a smoke run)
    .venv/bin/python benchmarks/trainer_compare.py --mixes sft --reps 2 --seeds 1 \
        --contenders balancer,hf_rebalance,hf_group --profile DIR  # where each one's CPU goes (_trainer_profile.py)

Contenders, each one epoch of the same documents on the same tiny Llama (from a config, random weights, the same
initial weights per seed), 2 gloo ranks on CPU (one thread each), AdamW, constant learning rate:
- `balancer`: `balancer.hf.BalancedTrainer` with `Topology(dp=2, micro_batches=M, max_tokens, tokens_per_step)`;
- `hf_rebalance`: stock `transformers.Trainer`, `train_sampling_strategy="batch_rebalance"` (transformers'
  BatchRebalanceSampler), `DataCollatorForLanguageModeling(mlm=False)` padding each micro-batch to its longest row;
- `hf_group`: the same with `train_sampling_strategy="group_by_length"` (LengthGroupedSampler);
- `trl_bfd`: TRL `SFTTrainer(packing=True, packing_strategy="bfd", padding_free=True)`, rows of `max_length`.

Step counts match within 1: the stock trainers take `per_device_train_batch_size` = documents / (steps x M x 2);
BalancedTrainer `tokens_per_step` = corpus tokens / steps; TRL the `max_length` (>= the longest document) whose
packed rows give that many steps at one row per micro-batch. Every contender runs the same attention kernel,
`attention.varlen_attention` (see benchmarks/_trainer_worker.py): the padded contenders pay for padding in the
linear layers only.

Timing: every run is timed on every rank from building the trainer (TRL packs, BalancedTrainer plans there) to the
end of `train()`: wall clock (the ranks meet at a barrier before and after) and process CPU summed over the ranks.
Before a mix's timed runs every contender runs it once untimed (`--warmup`, recorded apart as `warmup_records`):
the first run in a process pays for what the process does once (lazy imports of transformers / accelerate / the
contender's own modules, torch.distributed's and DDP's first use), which would otherwise fall on whichever
contender runs first (BalancedTrainer, first, in a run without warm-up: 9.5 s of CPU against 7.2-7.9 s later).
Repetitions are paired and alternate their order (A B C D, then D C B A). The stock `batch_rebalance` run is
repeated with 2 more seeds (model initialisation and data order) for the spread of its final loss; "final loss" is
the mean next-token loss on held-out documents of the same mix, after training. Writes
benchmarks/results/trainer_compare.json and trainer_compare.png (loss curves), prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

import _render as tb
from _common import RESULTS, write_result  # noqa: E402 - measures the load at start on import

from balancer.data.traces import heavy_tail, sft_mix  # noqa: E402

CONTENDERS = ("balancer", "hf_rebalance", "hf_group", "trl_bfd")
BUILTINS = CONTENDERS[1:]
STOCK = "hf_rebalance"
VOCAB = 256  # token ids; the tokenizer adds <pad> and <eos>
MODEL = dict(
    vocab_size=VOCAB + 2,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
)
DP, M = 2, 2
GOAL = {"longtail": 1.15, "sft": 1.0}  # by wall clock: the best built-in's time / balancer's
GOAL_CPU = 1.0  # by process CPU, every mix: never more CPU than the best built-in


def mix_lengths(mix: str, n: int, seed: int) -> np.ndarray:
    """`sft`: SFT lengths scaled to 50-1,024 tokens; `longtail`: heavy_tail scaled by 1/16 (body median ~240,
    3% of documents 2K-6K tokens)."""
    if mix == "sft":
        return sft_mix(n, seed=seed) // 4
    if mix == "longtail":
        x = heavy_tail(n, seed=seed, tail_share=0.03, lo=32768, hi=98304) // 16
        return np.maximum(x, 8)
    raise ValueError(f"unknown mix {mix!r}")


def documents(lengths: np.ndarray, seed: int) -> list[list[int]]:
    """Token documents from a seeded random walk over the vocabulary (small steps, so there is something to learn)."""
    rng = np.random.default_rng([seed, 31])
    steps = np.array([1, 2, 3, -1, 5])
    docs = []
    for n in lengths:
        walk = np.cumsum(rng.choice(steps, int(n), p=[0.4, 0.25, 0.15, 0.1, 0.1])) + rng.integers(VOCAB)
        docs.append(((walk % VOCAB) + 2).tolist())  # ids 0 and 1 are <pad> and <eos>
    return docs


def build_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the ids, built here (no download), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "right"
    fast.save_pretrained(path)


def trl_seq_length(lengths: np.ndarray, steps: int) -> tuple[int, int]:
    """The smallest max_length (>= the longest document, in steps of 64) whose TRL BFD rows make `steps` (+-1)
    optimizer steps at one row per micro-batch; (max_length, rows)."""
    sys.path.insert(0, str(HERE))
    import peers

    per_step = DP * M
    seq = int(-(-int(lengths.max()) // 64) * 64)
    while True:
        rows = len(peers.trl_pack(lengths, seq)[0])
        if -(-rows // per_step) <= steps + 1:
            return seq, rows
        seq += max(64, seq // 50)


def prepare(tmp: Path, mixes: list[str], n_docs: dict, steps: int) -> dict:
    """Corpora (Arrow folders), held-out documents, the tokenizer, and each contender's batch settings."""
    from datasets import Dataset

    build_tokenizer(tmp / "tokenizer")
    setups = {}
    for k, mix in enumerate(mixes):
        lengths = mix_lengths(mix, n_docs[mix], seed=10 + k)
        Dataset.from_dict({"input_ids": documents(lengths, seed=10 + k)}).save_to_disk(str(tmp / mix))
        held = documents(mix_lengths(mix, 48, seed=90 + k), seed=90 + k)
        (tmp / f"{mix}-heldout.json").write_text(json.dumps(held))
        total = int(lengths.sum())
        tps = -(-total // steps)
        max_tokens = 1 << int(np.ceil(np.log2(max(int(lengths.max()), tps / (DP * M * 0.85)))))
        seq, rows = trl_seq_length(lengths, steps)
        setups[mix] = dict(
            docs=int(len(lengths)),
            tokens=total,
            max_length=int(lengths.max()),
            median_length=float(np.median(lengths)),
            tokens_over_2k_share=float(lengths[lengths > 2048].sum() / total),
            steps_target=steps,
            batch_size=n_docs[mix] // (steps * DP * M),
            tokens_per_step=tps,
            max_tokens=max_tokens,
            seq_length=seq,
            trl_rows=rows,
        )
    return setups


def jobs_for(
    mixes: list[str],
    setups: dict,
    reps: int,
    seeds: int,
    lr: float,
    warmup: int = 1,
    profile: str | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
) -> list[dict]:
    """Per mix: `warmup` untimed runs of every contender, the timed repetitions (alternating order), the stock seeds
    (when the stock contender runs). `profile`: a folder where every run writes one cProfile file per rank."""
    jobs = []
    for mix in mixes:
        s = setups[mix]
        base = dict(mix=mix, dp=DP, micro_batches=M, model=MODEL, lr=lr, **{k: s[k] for k in (
            "batch_size", "tokens_per_step", "max_tokens", "seq_length")})  # fmt: skip
        if profile is not None:
            base["profile"] = profile
        jobs += [dict(base, contender=c, seed=0, rep=-2, warmup=True) for _ in range(warmup) for c in contenders]
        for rep in range(reps):
            order = contenders if rep % 2 == 0 else contenders[::-1]
            jobs += [dict(base, contender=c, seed=0, rep=rep) for c in order]
        if STOCK in contenders:
            jobs += [dict(base, contender=STOCK, seed=s_, rep=-1) for s_ in range(1, seeds)]
    return jobs


def spawn_world(tmp: Path) -> None:
    import _trainer_worker
    import torch.multiprocessing as mp
    from support.dist import free_port
    from support.trainer import _env_entry

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_env_entry, args=(DP, free_port(), _trainer_worker.world, (str(tmp),)), nprocs=DP, join=True)


def summarize(records: list[dict], mixes: list[str], setups: dict) -> dict:
    """Per mix and contender: median wall / CPU seconds over the timed repetitions, tokens/s, padding share, steps,
    held-out loss; the stock seeds' spread; speedups over the best built-in."""
    out = {}
    ran = [c for c in CONTENDERS if any(r["contender"] == c for r in records)]
    builtins = [c for c in ran if c in BUILTINS]
    for mix in mixes:
        rows = {}
        for c in ran:
            timed = [r for r in records if r["mix"] == mix and r["contender"] == c and r["seed"] == 0]
            wall = [r["wall_seconds"] for r in timed]
            cpu = [r["cpu_seconds"] for r in timed]
            r0 = timed[0]
            rows[c] = dict(
                wall_seconds=float(np.median(wall)),
                wall_all=wall,
                cpu_seconds=float(np.median(cpu)),
                cpu_all=cpu,
                setup_seconds=float(np.median([r["setup_seconds"] for r in timed])),
                steps=r0["steps"],
                real_tokens=r0["real_tokens"],
                positions=r0["positions"],
                padding_share=1 - r0["real_tokens"] / r0["positions"],
                tokens_per_second=r0["real_tokens"] / float(np.median(wall)),
                heldout_loss=r0["heldout_loss"],
                final_train_loss=r0["losses"][-1][1] if r0["losses"] else None,
                losses=r0["losses"],
            )
        seeds = [r["heldout_loss"] for r in records if r["mix"] == mix and r["contender"] == STOCK and r["rep"] <= 0]
        lo, hi = (min(seeds), max(seeds)) if seeds else (-math.inf, math.inf)  # the stock contender did not run
        best = min(builtins, key=lambda c: rows[c]["wall_seconds"])
        best_cpu = min(builtins, key=lambda c: rows[c]["cpu_seconds"])
        b = rows["balancer"]
        steps = [rows[c]["steps"] for c in ran]
        out[mix] = dict(
            setup=setups[mix],
            contenders=rows,
            stock_seed_losses=seeds,
            stock_spread=[lo, hi] if seeds else None,
            loss_within_spread={c: lo <= rows[c]["heldout_loss"] <= hi for c in ran} if seeds else {},
            best_builtin_wall=best,
            speedup_wall=rows[best]["wall_seconds"] / b["wall_seconds"],
            best_builtin_cpu=best_cpu,
            speedup_cpu=rows[best_cpu]["cpu_seconds"] / b["cpu_seconds"],
            # per repetition (the contenders of one repetition ran back to back): the best built-in's time / balancer's
            paired_wall=[x / y for x, y in zip(rows[best]["wall_all"], b["wall_all"])],
            paired_cpu=[x / y for x, y in zip(rows[best_cpu]["cpu_all"], b["cpu_all"])],
            # each contender's own spread over its repetitions: (max - min) / median, by CPU
            cpu_noise={c: (max(r["cpu_all"]) - min(r["cpu_all"])) / r["cpu_seconds"] for c, r in rows.items()},
            goal_speedup_cpu=GOAL_CPU,
            goal_met_cpu=rows[best_cpu]["cpu_seconds"] / b["cpu_seconds"] >= GOAL_CPU,
            steps_match=max(steps) - min(steps) <= 1,
            goal_speedup=GOAL[mix],
            goal_met=rows[best]["wall_seconds"] / b["wall_seconds"] >= GOAL[mix],
            corpus_tokens_each_once={c: rows[c]["real_tokens"] == setups[mix]["tokens"] for c in ran},
        )
    return out


def print_profiles(folder: Path, top: int = 25) -> None:
    """Per contender, the timed runs' profiles of every rank merged: the functions with the most cumulative time."""
    import pstats

    for c in CONTENDERS:
        files = sorted(str(f) for f in folder.glob(f"*-{c}-rep*.prof"))
        if not files:
            continue
        stats = pstats.Stats(*files)
        print(f"== {c}: {len(files)} profiles (timed runs x ranks), {stats.total_tt:.2f} s in all")
        stats.sort_stats("cumulative").print_stats(top)


def write_profile(name: str, folder: Path, summary: dict, reps: int) -> int:
    """results/NAME_profile.json: per contender, CPU seconds per rank and epoch in named parts (_trainer_profile.py)
    and the profiled runs' own CPU medians; prints the parts."""
    import _trainer_profile

    parts = {
        mix: {c: _trainer_profile.breakdown(folder, mix, c) for c in s["contenders"]} for mix, s in summary.items()
    }
    cpu = {mix: {c: r["cpu_seconds"] for c, r in s["contenders"].items()} for mix, s in summary.items()}
    out = write_result(f"{name}_profile", dict(reps=reps, parts=parts, profiled_cpu_seconds=cpu), clock="process_cpu")
    for mix, per in parts.items():
        for c, b in per.items():
            print(f"== {mix}, {c} ({b['profiles']} profiles): CPU seconds per rank and epoch")
            print("\n".join(f"  {v:7.3f}  {k}" for k, v in b["parts"].items()))
    print(f"wrote {out}")
    return 0


def markdown(summary: dict) -> str:
    head = (
        "| mix | trainer | steps | wall s (median) | CPU s (median) | tokens/s | padding | held-out loss | "
        "vs balancer (wall) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for mix, s in summary.items():
        b = s["contenders"]["balancer"]["wall_seconds"]
        for c, r in s["contenders"].items():
            lines.append(
                f"| {mix} | {c} | {r['steps']} | {r['wall_seconds']:.1f} | {r['cpu_seconds']:.1f} | "
                f"{r['tokens_per_second']:,.0f} | {r['padding_share']:.1%} | {r['heldout_loss']:.4f} | "
                f"{r['wall_seconds'] / b:.2f}x |"
            )
    return head + "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"balancer": "#1e8449", "hf_rebalance": "#2e86c1", "hf_group": "#9aa5b1", "trl_bfd": "#f5b041"}
    fig, axes = plt.subplots(1, len(summary), figsize=(6.5 * len(summary), 4.2), squeeze=False)
    for ax, (mix, s) in zip(axes[0], summary.items()):
        for c, r in s["contenders"].items():
            x, y = zip(*r["losses"]) if r["losses"] else ((), ())
            ax.plot(x, y, marker="o", ms=3, label=f"{c} (held-out {r['heldout_loss']:.3f})", color=colors[c])
        spread = "; stock seeds' held-out {:.3f}-{:.3f}".format(*s["stock_spread"]) if s["stock_spread"] else ""
        ax.set_title(f"{mix}: training loss per step{spread}", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean token loss (step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resummarize(name: str) -> int:
    """Summary and plot again from a result's recorded runs; the record's measurement fields stay as measured."""
    path = RESULTS / f"{name}.json"
    data = json.loads(path.read_text())
    setups = {mix: s["setup"] for mix, s in data["summary"].items()}
    data["summary"] = summarize(data["records"], list(setups), setups)
    path.write_text(json.dumps(data, indent=1))
    plot(data["summary"], RESULTS / f"{name}.png")
    print(markdown(data["summary"]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small corpora, 1 repetition, 1 stock seed (a smoke run)")
    ap.add_argument("--mixes", default="sft,longtail", help="comma-separated: sft, longtail")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per contender (default 2)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of the stock batch_rebalance run (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of every contender before a mix (default 1)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per epoch (every contender, +-1)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    ap.add_argument("--name", default="trainer_compare", help="results/NAME.json and NAME.png")
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma-separated, balancer and at least one "
        f"built-in (default all: {','.join(CONTENDERS)}); without {STOCK}, no seed spread",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile every run on every rank (by process CPU) into DIR/*.prof, print the top functions and write "
        "where each contender's CPU goes to results/NAME_profile.json (not NAME.json: profiling inflates the times)",
    )
    redo = "recompute the summary and the plot from the runs recorded in results/NAME.json (no training)"
    ap.add_argument("--summarize-only", action="store_true", help=redo)
    args = ap.parse_args(argv)
    if args.summarize_only:
        return resummarize(args.name)
    mixes = args.mixes.split(",")
    bad = [m for m in mixes if m not in GOAL]
    if bad:
        ap.error(f"--mixes: unknown mix {bad[0]!r} (choose from {', '.join(GOAL)})")
    contenders = tuple(c for c in CONTENDERS if c in args.contenders.split(","))
    unknown = sorted(set(args.contenders.split(",")) - set(CONTENDERS))
    if unknown or "balancer" not in contenders or len(contenders) < 2:
        ap.error(f"--contenders: balancer and at least one of {', '.join(BUILTINS)}, got {args.contenders!r}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    per_step = args.steps * DP * M
    n_docs = {"sft": per_step * (4 if args.quick else 6), "longtail": per_step * (6 if args.quick else 12)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trainer_compare-") as tmp:
        tmp = Path(tmp)
        setups = prepare(tmp, mixes, n_docs, args.steps)
        for mix, s in setups.items():
            print(f"== {mix}: {json.dumps(s)}", flush=True)
        print(f"prepared in {time.perf_counter() - t0:.0f} s", flush=True)
        profile = None if args.profile is None else str(Path(args.profile).resolve())
        if profile is not None:
            Path(profile).mkdir(parents=True, exist_ok=True)
        jobs = jobs_for(mixes, setups, reps, seeds, args.lr, args.warmup, profile, contenders)
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        spawn_world(tmp)
        records = json.loads((tmp / "records.json").read_text())
        warmups = json.loads((tmp / "warmup.json").read_text()) if args.warmup else []
    summary = summarize(records, mixes, setups)
    if profile is not None:
        print(markdown(summary))
        print_profiles(Path(profile))
        return write_profile(args.name, Path(profile), summary, reps)
    result = dict(
        config=dict(
            reps=reps,
            seeds=seeds,
            steps=args.steps,
            lr=args.lr,
            dp=DP,
            micro_batches=M,
            threads_per_rank=1,
            quick=args.quick,
            warmup=args.warmup,
            contenders=list(contenders),
        ),  # fmt: skip
        runtime_seconds=time.perf_counter() - t0,
        summary=summary,
        records=records,
        warmup_records=warmups,
    )
    from _trainer_worker import build_model

    params = sum(p.numel() for p in build_model(MODEL, 0, "eager").parameters())
    out = write_result(args.name, result, clock="wall+process_cpu", model=dict(MODEL, parameters=params))
    png = RESULTS / f"{args.name}.png"
    plot(summary, png)
    print(markdown(summary))
    for mix, s in summary.items():
        print(
            f"{mix}: balancer {s['speedup_wall']:.2f}x the best built-in ({s['best_builtin_wall']}) by wall clock, "
            f"{s['speedup_cpu']:.2f}x by CPU ({s['best_builtin_cpu']}); goal {s['goal_speedup']}x "
            f"{'met' if s['goal_met'] else 'missed'}, CPU goal {GOAL_CPU}x {'met' if s['goal_met_cpu'] else 'missed'}; "
            f"losses within the stock spread: {s['loss_within_spread']}"
        )
    print(f"wrote {out} and {png} in {time.perf_counter() - t0:.0f} s")
    return 0


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_trainer_compare() -> str:
    """BalancedTrainer against the built-in trainers: measured time, throughput, padding, loss."""
    data = tb.load("trainer_compare")
    rows = []
    for mix, s in data["summary"].items():
        b = s["contenders"]["balancer"]
        for name, r in s["contenders"].items():
            rows.append([mix, name, tb.fmt(r["steps"], "d"), " / ".join(f"{x:.1f}" for x in r["wall_all"]),
                         " / ".join(f"{x:.1f}" for x in r["cpu_all"]), f"{r['tokens_per_second']:,.0f}",
                         f"{r['padding_share']:.1%}", f"{r['heldout_loss']:.4f}",
                         f"{r['wall_seconds'] / b['wall_seconds']:.2f}x",
                         f"{r['cpu_seconds'] / b['cpu_seconds']:.2f}x"])  # fmt: skip
    header = ["mix", "trainer", "steps", "wall s (reps)", "CPU s (reps)", "tokens/s (wall)", "padding",
              "held-out loss", "time / balancer (wall)", "time / balancer (CPU)"]  # fmt: skip
    notes = []
    for mix, s in data["summary"].items():
        lo, hi = s["stock_spread"]
        inside = [c for c, ok in s["loss_within_spread"].items() if ok]
        notes.append(
            f"{mix}: balancer {s['speedup_wall']:.2f}x the best built-in by wall clock ({s['best_builtin_wall']}), "
            f"{s['speedup_cpu']:.2f}x by CPU ({s['best_builtin_cpu']}), goal {s['goal_speedup']}x "
            f"{'met' if s['goal_met'] else 'missed'}{_paired(s)}; stock batch_rebalance over "
            f"{len(s['stock_seed_losses'])} seeds: "
            f"held-out loss {lo:.4f}-{hi:.4f} (inside: {', '.join(inside) or 'none'})"
        )
    return tb.markdown(header, rows) + "\n\n" + ".\n".join(notes) + "." + tb.record_line(data)


def _paired(s: dict) -> str:
    """The per-repetition ratios and the contenders' own CPU spread (records from before they were kept: none)."""
    if "paired_cpu" not in s:
        return ""
    wall, cpu, noise = s["paired_wall"], s["paired_cpu"], s["cpu_noise"]
    return (
        f" (per paired repetition {min(wall):.2f}-{max(wall):.2f}x by wall clock, {min(cpu):.2f}-{max(cpu):.2f}x by "
        f"CPU; each contender's CPU spread over its repetitions {min(noise.values()):.1%}-{max(noise.values()):.1%} "
        f"of its median), CPU goal {s['goal_speedup_cpu']}x {'met' if s['goal_met_cpu'] else 'missed'}"
    )


def table_trainer_compare_profile() -> str:
    """Where each contender's process CPU goes (`--profile`): CPU seconds per rank and epoch, by part."""
    data = tb.load("trainer_compare_profile")
    out = []
    for mix, per in data["parts"].items():
        names = list(per)
        parts = list(per[names[0]]["parts"])
        rows = [[mix if i == 0 else "", part.replace("  of it:", "- of it:")]
                + [f"{per[c]['parts'][part]:.3f}" for c in names] for i, part in enumerate(parts)]  # fmt: skip
        cpu = data["profiled_cpu_seconds"][mix]
        rows.append([mix, "whole run, both ranks (process CPU, median; profiled)"] + [f"{cpu[c]:.2f}" for c in names])
        out.append(tb.markdown(["mix", "CPU seconds per rank and epoch", *names], rows))
    return "\n\n".join(out) + tb.record_line(data)


TABLES = {  # docs/ marker name -> the table, from the record
    "trainer_compare": table_trainer_compare,
    "trainer_compare_profile": table_trainer_compare_profile,
}


if __name__ == "__main__":
    sys.exit(main())
