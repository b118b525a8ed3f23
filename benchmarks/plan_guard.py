"""Is the planner in this working tree slower or worse than at commit REF? A short paired check to run before merging.

`python benchmarks/plan_guard.py --against REF [REF ...]` checks each REF out into a temporary `git worktree` under
/tmp, then plans a few standard shapes with each side's own `balancer`, every side in its own subprocess (PYTHONPATH
set to that checkout; the worker refuses to run on any other copy), repetitions alternating the order of the sides.
Speed is process CPU time of the planning call (the whole command for the `cli_*` shapes), compared as the median
of the per-repetition ratios working tree / REF. `--best-of K` plans each `balancer.plan` shape K times in a
repetition's process and keeps the least CPU (the first plan of a process pays its warm-up, and a busy machine's
interruptions only ever add time): on a shared machine it resolves a change of 5-10% that one cold plan cannot.
Quality is the plan's excess over the per-step lower bound (`imbalance - 1`); plans are seeded, so the quality of one
side is the same in every repetition.

Verdict per shape and REF: "slower" when the median ratio is above 1 + `--tolerance`, "worse" when the excess grew by
more than `--quality-tolerance` of itself (plus 1e-4 of imbalance, float noise); the check passes when no shape is
either. Exit status 0: passed; 1: a shape is slower or worse; 2: bad arguments or a side failed to run.

Shapes (`--full` adds the whole `balancer plan sft` commands of the README, ~5-25 s each per side):
- sft_short: 50K SFT-like documents (log-normal, median 700 tokens), dp4 x cp2 x M4 x 2,048: most users' data;
- sft_trace / sft_trace_pp4: the first 25K documents of the built-in `sft` trace as `balancer plan sft --dp 4 --cp
  2` plans them (auto max_tokens, 0.85 fill), without and with 4 pipeline stages;
- wlbllm_large: 100K WLB-LLM documents on dp64 x cp4 x M8 x 32,768 (few large steps);
- prolong_pp: the ProLong trace on dp4 x cp2 x pp4 (M8), a planner_quality row with long documents;
- global_batch: `balancer.plan` of one global batch of 1,927 WLB-LLM documents (0.85 of the capacity) on dp8 x M4
  x 262,144 (mean of 20 calls); global_batch_pack_step: `pack_step` of the same documents, as a sampler packs one
  step (mean of 20 calls);
- `--million` adds the 1M-document epochs of benchmarks/planner_speed.py (wlbllm_1m: 1M WLB-LLM documents on dp64 x
  cp4 x M8 x 32,768; sft_1m: 1M SFT-like documents on dp4 x cp2 x M4 x 2,048), ~1 s each per side.
"same plan": the placements (documents, spans, micro-batch boundaries) of the two sides hash alike (the `cli_*`
shapes are not hashed).
Writes benchmarks/results/plan_guard.json (or `--name`) and prints one table per REF.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import COMMIT_AT_START, DEFAULT_COST, table, write_result

from balancer.data.traces import load_trace

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_guard_worker.py"
COST = {"attn_coef": DEFAULT_COST.attn_coef, "linear_coef": DEFAULT_COST.linear_coef}
GLOBAL_BATCH = {"dp": 8, "cp": 1, "pp": 1, "micro_batches": 4, "max_tokens": 262144}
COLUMNS = [
    "shape", "CPU here", "CPU at REF", "ratio (median, range)", "imbalance here", "imbalance at REF", "same plan",
    "verdict",
]  # fmt: skip


def sft_like(n: int, seed: int = 1) -> np.ndarray:
    """Log-normal SFT lengths: median 700 tokens, sigma 0.8, clipped to 32..4,096."""
    return np.clip(np.random.default_rng(seed).lognormal(np.log(700), 0.8, n), 32, 4096).astype(np.int64)


def auto_topology(lengths: np.ndarray, dp: int, cp: int, pp: int, m: int, max_tokens: int | None = None) -> dict:
    """The topology `balancer plan` picks by default: max_tokens the next power of two holding the longest document
    over the CP group, tokens_per_step left to the Topology default (0.85 of the capacity)."""
    if max_tokens is None:
        max_tokens = 1 << int(np.ceil(np.log2(-(-int(lengths.max()) // cp))))
    return {"dp": dp, "cp": cp, "pp": pp, "micro_batches": m, "max_tokens": max_tokens}


def global_batch() -> np.ndarray:
    """WLB-LLM documents (seed 2) up to one step's default budget on GLOBAL_BATCH: 1,927 documents."""
    lengths = load_trace("wlbllm", n=2_000, seed=2)
    budget = 0.85 * GLOBAL_BATCH["dp"] * GLOBAL_BATCH["micro_batches"] * GLOBAL_BATCH["max_tokens"]
    return lengths[: int(np.sum(np.cumsum(lengths) <= budget))]


def make_shapes(data: Path, full: bool, million: bool = False, best_of: int = 1) -> list[dict]:
    """Write each shape's lengths under `data` and return the shapes the workers run (each `balancer.plan` shape
    planned `best_of` times per repetition, its least CPU kept; the command shapes run once)."""
    arrays = {
        "sft_short": sft_like(50_000),
        "sft_trace": load_trace("sft")[:25_000],
        "wlbllm_100k": load_trace("wlbllm", n=100_000, seed=1),
        "prolong": load_trace("prolong", seed=0),
        "wlbllm_batch": global_batch(),
    }
    if million:
        arrays |= {"wlbllm_1m": load_trace("wlbllm", n=1_000_000, seed=1), "sft_1m": sft_like(1_000_000)}
    for name, lengths in arrays.items():
        np.save(data / f"{name}.npy", np.asarray(lengths, dtype=np.int64))
    a = arrays
    shapes = [
        ("sft_short", "plan", "sft_short", auto_topology(a["sft_short"], 4, 2, 1, 4, max_tokens=2048)),
        ("sft_trace", "plan", "sft_trace", auto_topology(a["sft_trace"], 4, 2, 1, 4)),
        ("sft_trace_pp4", "plan", "sft_trace", auto_topology(a["sft_trace"], 4, 2, 4, 4)),
        ("wlbllm_large", "plan", "wlbllm_100k", auto_topology(a["wlbllm_100k"], 64, 4, 1, 8, max_tokens=32768)),
        ("prolong_pp", "plan", "prolong", auto_topology(a["prolong"], 4, 2, 4, 8)),
        ("global_batch", "plan", "wlbllm_batch", GLOBAL_BATCH),
        ("global_batch_pack_step", "pack_step", "wlbllm_batch", GLOBAL_BATCH),
    ]
    if million:
        shapes += [
            ("wlbllm_1m", "plan", "wlbllm_1m", auto_topology(a["wlbllm_1m"], 64, 4, 1, 8, max_tokens=32768)),
            ("sft_1m", "plan", "sft_1m", auto_topology(a["sft_1m"], 4, 2, 1, 4, max_tokens=2048)),
        ]
    out = [{"name": n, "kind": k, "data": d, "topology": t, "cost": COST, "seed": 0} for n, k, d, t in shapes]
    for shape in out:
        if shape["kind"] == "plan":  # the pack_step shapes are means of 20 calls already
            shape["best_of"] = best_of
        if shape["data"] == "wlbllm_batch":
            shape["calls"] = 20  # milliseconds each: the mean of 20 calls
    if full:
        for name, extra in (("cli_sft_dp4cp2", []), ("cli_sft_dp4cp2pp4", ["--pp", "4"])):
            out.append({"name": name, "kind": "cli", "argv": ["plan", "sft", "--dp", "4", "--cp", "2", *extra]})
    return out


def add_worktree(ref: str, parent: Path, folder: str | None = None) -> Path:
    """Check `ref` out (detached) into a new worktree under `parent`; exit 2 naming the ref if git refuses."""
    path = parent / (folder or f"ref_{ref.replace('/', '_')}")
    done = subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"plan_guard: --against {ref}: git worktree add failed: {done.stderr.strip()}", file=sys.stderr)
        sys.exit(2)
    return path


def here_from_head(only: list[str], parent: Path) -> Path:
    """The "here" side for `--only`: HEAD checked out, with the working tree's version of each path in `only`
    copied over it (a shared checkout's other uncommitted edits stay out of the measurement)."""
    path = add_worktree("HEAD", parent, "here")
    for name in only:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, path / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copy2(source, path / name)
        else:
            remove_worktree(path)
            print(f"plan_guard: --only {name}: no such file or folder in the working tree", file=sys.stderr)
            sys.exit(2)
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True, text=True)


def run_side(root: Path, job: Path) -> dict:
    """One repetition of every shape with the `balancer` of checkout `root`, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(job), str(root)], cwd=root, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"plan_guard: the worker on {root} failed:\n{done.stderr.strip()}", file=sys.stderr)
        sys.exit(2)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(sides: dict[str, Path], job: Path, reps: int) -> dict[str, list[dict]]:
    """`reps` repetitions of every side, the order of the sides rotated each repetition."""
    names = list(sides)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name].append(run_side(sides[name], job))
        print(f"repetition {r + 1}/{reps} done ({' -> '.join(order)})", file=sys.stderr, flush=True)
    return runs


def compare(here: list[dict], there: list[dict], shape: str, tol: float, qtol: float) -> dict:
    """One shape: paired CPU ratios (working tree / REF), the excess of each side and the verdict."""
    ratios = np.array([h[shape]["cpu_s"] / t[shape]["cpu_s"] for h, t in zip(here, there)])
    imb_here, imb_there = here[0][shape]["imbalance"], there[0][shape]["imbalance"]
    slower = bool(np.median(ratios) > 1 + tol)
    worse = bool(imb_here - 1 > (imb_there - 1) * (1 + qtol) + 1e-4)
    failures = [word for word, bad in (("slower", slower), ("worse", worse)) if bad]
    verdict = " and ".join(failures) or "ok"
    return {
        "shape": shape,
        "cpu_s_here": [h[shape]["cpu_s"] for h in here],
        "cpu_s_ref": [t[shape]["cpu_s"] for t in there],
        "ratio_median": float(np.median(ratios)),
        "ratio_min": float(ratios.min()),
        "ratio_max": float(ratios.max()),
        "imbalance_here": imb_here,
        "imbalance_ref": imb_there,
        "efficiency_here": here[0][shape]["epoch_efficiency"],
        "efficiency_ref": there[0][shape]["epoch_efficiency"],
        "steps_here": here[0][shape]["steps"],
        "steps_ref": there[0][shape]["steps"],
        "same_plan": _same(here[0][shape].get("digest"), there[0][shape].get("digest")),
        "slower": slower,
        "worse": worse,
        "verdict": verdict,
    }


def _same(digest_here: str | None, digest_ref: str | None) -> bool | None:
    """Whether both sides placed every document alike (None where a side records no digest)."""
    return None if digest_here is None or digest_ref is None else digest_here == digest_ref


def table_rows(rows: list[dict]) -> list[list]:
    def cpu(values: list[float]) -> str:
        s = float(np.median(values))
        return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"

    return [
        [
            r["shape"],
            cpu(r["cpu_s_here"]),
            cpu(r["cpu_s_ref"]),
            f"{r['ratio_median']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
            f"{r['imbalance_here']:.4f}",
            f"{r['imbalance_ref']:.4f}",
            {True: "yes", False: "no", None: "-"}[r.get("same_plan")],
            r["verdict"],
        ]
        for r in rows
    ]


def resolve(ref: str) -> str:
    git = ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"]
    done = subprocess.run(git, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"plan_guard: --against {ref}: not a commit of this repository", file=sys.stderr)
        sys.exit(2)
    return done.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", nargs="+", required=True, metavar="REF", help="commits to compare with")
    ap.add_argument("--reps", type=int, default=3, help="paired repetitions (default 3)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed CPU ratio above 1 (default 0.10)")
    ap.add_argument("--quality-tolerance", type=float, default=0.01, help="allowed relative excess growth (0.01)")
    ap.add_argument("--shapes", nargs="+", help="run only these shapes (names as in the table)")
    ap.add_argument("--full", action="store_true", help="also time the whole `balancer plan sft` commands")
    ap.add_argument("--million", action="store_true", help="also the 1M-document epochs (wlbllm_1m, sft_1m)")
    ap.add_argument(
        "--best-of",
        type=int,
        default=1,
        metavar="K",
        help="plan each balancer.plan shape K times per repetition, keep the least CPU",
    )
    ap.add_argument(
        "--only", nargs="+", metavar="PATH", help="here = HEAD plus the working tree's version of these paths only"
    )
    ap.add_argument("--name", default="plan_guard", help="record name under benchmarks/results/ (plan_guard)")
    args = ap.parse_args()
    if args.reps < 1 or args.best_of < 1 or args.tolerance < 0 or args.quality_tolerance < 0:
        ap.error("--reps and --best-of must be >= 1 and the tolerances >= 0")
    commits = {ref: resolve(ref) for ref in args.against}
    with tempfile.TemporaryDirectory(prefix="plan_guard_", dir="/tmp") as tmp:
        tmp_path = Path(tmp)
        shapes = make_shapes(tmp_path, args.full, args.million, args.best_of)
        if args.shapes:
            unknown = set(args.shapes) - {s["name"] for s in shapes}
            if unknown:
                ap.error(f"--shapes: unknown {sorted(unknown)}; known: {[s['name'] for s in shapes]}")
            shapes = [s for s in shapes if s["name"] in args.shapes]
        job = tmp_path / "job.json"
        job.write_text(json.dumps({"data": str(tmp_path), "shapes": shapes}))
        sides = {"here": REPO}
        try:
            if args.only:
                sides["here"] = here_from_head(args.only, tmp_path)
            for ref in args.against:
                sides[ref] = add_worktree(ref, tmp_path)
            runs = measure(sides, job, args.reps)
        finally:
            for path in sides.values():
                if path != REPO:
                    remove_worktree(path)
    report(args, commits, shapes, runs)


def report(args, commits: dict[str, str], shapes: list[dict], runs: dict[str, list[dict]]) -> None:
    """Print and record the comparison with every REF; exit 1 when any shape is slower or worse."""
    against, tables, failed = [], {}, False
    for ref in args.against:
        rows = [compare(runs["here"], runs[ref], s["name"], args.tolerance, args.quality_tolerance) for s in shapes]
        passed = all(r["verdict"] == "ok" for r in rows)
        failed |= not passed
        against.append({"ref": ref, "commit": commits[ref], "passed": passed, "rows": rows})
        title = f"working tree against {ref} ({commits[ref][:7]})"
        tables[title] = table(COLUMNS, table_rows(rows))
        print(f"\n{title}: {'passed' if passed else 'FAILED'}")
        print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
        for row in tables[title]["rows"]:
            print("| " + " | ".join(str(c) for c in row) + " |")
    payload = {
        "here": COMMIT_AT_START | {"only": args.only},  # at the start: the run's own record must not make it dirty
        "reps": args.reps,
        "best_of": args.best_of,
        "tolerance": args.tolerance,
        "quality_tolerance": args.quality_tolerance,
        "shapes": shapes,
        "against": against,
        "passed": not failed,
        "tables": tables,
    }
    path = write_result(args.name, payload, clock="process_cpu")
    print(f"\nwrote {path}", file=sys.stderr)
    sys.exit(1 if failed else 0)


def table_plan_guard() -> str:
    """The record's comparison with every REF (docs/benchmarks.md): one table per REF, then how it was measured."""
    import _render as tb

    data = tb.load("plan_guard")
    here = data["git"] | {"only": data["here"].get("only")}  # the checkout at the start of the run
    where = f"{here['commit'][:7]}{' + uncommitted changes' if here.get('dirty') else ''}"
    if here.get("only"):
        where += f" (working tree's {', '.join(here['only'])} only)"
    out = []
    for against in data["against"]:
        verdict = "passed" if against["passed"] else "failed"
        out.append(
            f"{where} against {against['ref']} ({against['commit'][:7]}), {data['reps']} paired repetitions"
            + (
                f" (each `balancer.plan` shape the least CPU of {data['best_of']} plans)"
                if data.get("best_of", 1) > 1
                else ""
            )
            + ", "
            f"tolerance {data['tolerance']:.0%} (CPU) / {data['quality_tolerance']:.0%} (excess): {verdict}.\n\n"
            + tb.markdown(COLUMNS, table_rows(against["rows"]))
        )
    return "\n\n".join(out) + tb.record_line(data)


TABLES = {"plan_guard": table_plan_guard}  # docs/ marker name -> the table, from the record


if __name__ == "__main__":
    main()
