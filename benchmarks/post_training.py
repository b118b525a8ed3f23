"""Post-training batches: `balancer.balance_batch` beside verl's own functions on the same batches, one evaluator.

Question: on a fixed batch (GRPO-like rollouts: 64 prompts x 8 responses with heavy-tailed response lengths, dp8;
DPO-like pairs on dp4 x cp2), how close does each planner's slowest rank come to the section-3 step lower bound
(with the heaviest group as an extra term where groups are kept), and what does each option cost?

verl runs from the interpreter `VERL_PYTHON` names (default: this one when verl imports here, as tools/setup.sh
installs verl 0.9.1 into .venv without its dependencies): this script calls itself with `--verl-worker` under that
interpreter, and the worker calls verl 0.9.1's `get_seqlen_balanced_partitions` / `get_group_balanced_partitions`
(the DP split of `RayPPOTrainer._balance_batch`, per mini-batch as with `keep_minibatch=True`) and
`rearrange_micro_batches` (dynamic batch size: micro-batch count from the token budget, made equal over the DP
ranks as `same_micro_num_in_dp` does: the count is the ranks' maximum, retried until every rank fits). verl's plans
come back as document ids per (step, rank, micro-batch); both planners' plans are scored by
`balancer.planning.metrics` (`step_times`, `lower_bound`) under the same cost model.

Run: `python benchmarks/post_training.py` (writes benchmarks/results/post_training.json; tables.py renders it).
"""

from __future__ import annotations

import json
import sys


def verl_worker() -> None:
    """Runs under verl's interpreter: reads cases (JSON) on stdin, writes verl's plans (JSON) on stdout."""
    import time

    import torch
    import verl
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import (
        calculate_workload,
        get_group_balanced_partitions,
        get_seqlen_balanced_partitions,
        rearrange_micro_batches,
    )

    def micro_batches(docs, lengths, budget, at_least, pair):
        """`rearrange_micro_batches` on one rank's documents; micro-batches as lists of global document ids."""
        seq = torch.tensor([lengths[d] for d in docs])
        mask = (torch.arange(int(seq.max()))[None, :] < seq[:, None]).long()
        batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(docs)])
        _, idx = rearrange_micro_batches(batch, budget, min_num_micro_batch=at_least, force_group_size=pair)
        return [[docs[i] for i in mb] for mb in idx]

    def plan(case):
        lengths, dp, k = case["lengths"], case["dp"], case["mini_batches"]
        per_step = len(lengths) // k
        steps = []
        for s in range(k):  # keep_minibatch: every mini-batch (a contiguous slice) balanced on its own
            ids = list(range(s * per_step, (s + 1) * per_step))
            lens = [lengths[i] for i in ids]
            if case["groups"] is not None:
                parts = get_group_balanced_partitions(lens, [case["groups"][i] for i in ids], dp)
            else:
                work = calculate_workload(torch.tensor(lens)).tolist()
                parts = get_seqlen_balanced_partitions(work, dp, equal_size=True)
            ranks = [[ids[i] for i in part] for part in parts]
            m = case["min_micro_batches"]
            while True:  # same_micro_num_in_dp: the ranks' largest count, until every rank fits it
                plans = [micro_batches(r, lengths, case["budget"], m, case["pair"]) for r in ranks]
                most = max(len(p) for p in plans)
                if most == m:
                    break
                m = most
            steps.append(plans)
        return steps

    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        started = time.process_time()
        steps = plan(case)
        out.append({"steps": steps, "plan_cpu_seconds": time.process_time() - started})
    json.dump({"verl_version": verl.__version__, "torch_version": torch.__version__, "plans": out}, sys.stdout)


if __name__ == "__main__" and "--verl-worker" in sys.argv:
    verl_worker()
    sys.exit(0)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _render as tb  # noqa: E402
from _common import write_result  # noqa: E402

import balancer  # noqa: E402
from balancer.planning.batch.pack import pipeline_times, simulate_1f1b  # noqa: E402
from balancer.planning.metrics import lower_bound, step_times  # noqa: E402


def default_verl_python() -> str:
    """VERL_PYTHON when set; else this interpreter when verl imports here (tools/setup.sh installs verl 0.9.1 into
    .venv with --no-deps); else the separate environment verl was first measured from."""
    if "VERL_PYTHON" in os.environ:
        return os.environ["VERL_PYTHON"]
    return sys.executable if importlib.util.find_spec("verl") is not None else "/work/wt/verl-env/bin/python"


VERL_PYTHON = default_verl_python()
QWEN_7B = dict(
    hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064
)
LLAMA_8B = dict(
    hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256
)
SEEDS = (0, 1, 2)


def grpo_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """64 prompts x 8 responses: prompts 200-1500 tokens, responses log-normal (median 1500, sigma 1) up to 14000."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(200, 1500, 64)
    response = np.minimum(rng.lognormal(np.log(1500), 1.0, (64, 8)), 14000).astype(np.int64) + 1
    return (prompt[:, None] + response).ravel(), np.repeat(np.arange(64), 8)


def dpo_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """128 preference pairs (chosen, rejected) on one prompt: prompts 200-3000 tokens, answers log-normal (median
    600, sigma 0.8) up to 5000."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(200, 3000, 128)
    answers = np.minimum(rng.lognormal(np.log(600), 0.8, (128, 2)), 5000).astype(np.int64) + 1
    return (prompt[:, None] + answers).ravel(), np.repeat(np.arange(128), 2)


# name: (batch, model, topology, balance_batch options, verl options, groups kept as)
CASES = {
    "grpo dp8": (grpo_batch, QWEN_7B, dict(dp=8, max_tokens=16384), {}, dict(groups=False, pair=1), None),
    "grpo dp8, groups on a rank": (
        grpo_batch,
        QWEN_7B,
        dict(dp=8, max_tokens=16384),
        dict(keep="rank"),
        dict(groups=True, pair=1),
        "rank",
    ),
    "dpo dp4 x cp2, pairs in a micro-batch": (
        dpo_batch,
        LLAMA_8B,
        dict(dp=4, cp=2, max_tokens=8192),
        dict(keep="micro_batch"),
        dict(groups=True, pair=2),
        "micro_batch",
    ),
    "grpo dp4 x pp4": (
        grpo_batch,
        QWEN_7B,
        dict(dp=4, pp=4, micro_batches=4, max_tokens=16384),
        {},
        dict(groups=False, pair=1),
        None,
    ),
}
VARIANTS = {"balancer": {}, "balancer equal_counts": dict(equal_counts=True)}
GOAL_CASES = ("grpo dp8", "grpo dp8, groups on a rank", "dpo dp4 x cp2, pairs in a micro-batch")  # the goal
MINI_BATCHES = (1, 4)


def score(steps, lengths, groups, keep, topology: balancer.Topology, cost) -> list[dict]:
    """Section-3 figures of a plan given as `steps[s][rank][m] -> document ids` (each step may have its own M):
    the step time, its lower bound (with the heaviest kept group as an extra term: `cost / cp` on one rank,
    `P * cost / cp` in one micro-batch), and the simulated 1F1B time in the plan's micro-batch order."""
    placed = sorted(d for step in steps for rank in step for mb in rank for d in mb)
    assert placed == list(range(len(lengths))), "a plan must place every document exactly once"
    t, out = topology, []
    for step in steps:
        m = len(step[0])
        assert len(step) == t.dp and all(len(rank) == m for rank in step), "equal micro-batch counts per rank"
        assert all(0 < lengths[mb].sum() <= t.micro_batch_tokens for rank in step for mb in rank)
        topo = balancer.Topology(dp=t.dp, cp=t.cp, pp=t.pp, micro_batches=m, max_tokens=t.max_tokens)
        mb_cost = np.array([[cost.cost(lengths[mb]).sum() + cost.fixed for mb in rank] for rank in step])
        docs = np.concatenate([np.asarray(mb) for rank in step for mb in rank])
        doc_cost = cost.cost(lengths[docs])
        bound = float(lower_bound(doc_cost.sum(), doc_cost.max(), topo, cost.fixed))
        if keep is not None:
            heaviest = np.bincount(groups[docs], weights=doc_cost).max() / t.cp
            bound = max(bound, heaviest * (t.pp if keep == "micro_batch" else 1))
        time_ = float(step_times(mb_cost[None], topo)[0])
        pipeline = max(simulate_1f1b(mb_cost[r] / t.cp, t.pp) for r in range(t.dp))
        out.append({"micro_batches": m, "time": time_, "bound": bound, "ratio": time_ / bound, "pipeline": pipeline})
    return out


def ours(lengths, groups, keep, topology, cost, options, k, seed) -> dict:
    started = time.process_time()
    plan = balancer.balance_batch(
        lengths, topology, cost, groups=groups, micro_batches="auto", mini_batches=k, seed=seed, **options
    )
    seconds = time.process_time() - started
    plan.validate()
    views = [plan.rank_view(r) for r in range(topology.dp)]
    steps = [[views[r][s] for r in range(topology.dp)] for s in range(plan.num_steps)]
    record = {"steps": score(steps, lengths, groups, keep, topology, cost), "plan_cpu_seconds": seconds}
    if topology.pp > 1:  # the same plan in packing order: what the pipeline order saves
        unordered = balancer.balance_batch(
            lengths,
            topology,
            cost,
            groups=groups,
            micro_batches="auto",
            mini_batches=k,
            seed=seed,
            pipeline_order=False,
            **options,
        )
        assert np.allclose(unordered.step_times(), plan.step_times())
        record["pipeline_unordered"] = float(pipeline_times(unordered).sum())
        record["pipeline_ordered"] = float(pipeline_times(plan).sum())
    return record


def run_verl(cases: list[dict]) -> dict | None:
    """verl's plans of `cases` from its own interpreter, or None when it is not installed there."""
    if not Path(VERL_PYTHON).exists():
        return None
    with tempfile.TemporaryDirectory() as cwd:  # a clean working directory (no stray `ray` folder to import)
        done = subprocess.run(
            [VERL_PYTHON, str(Path(__file__).resolve()), "--verl-worker"],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": ""},
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the verl worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def summary(records: list[dict]) -> dict:
    ratios = [s["ratio"] for r in records for s in r["steps"]]
    out = {
        "worst_ratio": max(ratios),
        "mean_ratio": float(np.mean(ratios)),
        "micro_batches": max(s["micro_batches"] for r in records for s in r["steps"]),
        "plan_cpu_ms": 1000 * float(np.mean([r["plan_cpu_seconds"] for r in records])),
        "pipeline": float(np.sum([s["pipeline"] for r in records for s in r["steps"]])),
    }
    if "pipeline_unordered" in records[0]:
        ordered = sum(r["pipeline_ordered"] for r in records)
        out["pipeline_order_saving"] = 1 - ordered / sum(r["pipeline_unordered"] for r in records)
    return out


def main() -> None:
    rows, verl_cases, verl_keys = [], [], []
    per_key: dict = {}
    for name, (make, model, topo_kw, options, verl_options, keep) in CASES.items():
        cost = balancer.CostModel.from_model(**model)
        topology = balancer.Topology(**{"micro_batches": 1, **topo_kw})
        for seed in SEEDS:
            lengths, groups = make(seed)
            kept = groups if keep is not None else None
            for k in MINI_BATCHES:
                for variant, extra in VARIANTS.items():
                    record = ours(lengths, kept, keep, topology, cost, {**options, **extra}, k, seed)
                    per_key.setdefault((name, k, variant), []).append(record)
                verl_cases.append(
                    {
                        "lengths": lengths.tolist(),
                        "dp": topology.dp,
                        "mini_batches": k,
                        "groups": groups.tolist() if verl_options["groups"] else None,
                        "budget": topology.micro_batch_tokens,
                        "min_micro_batches": topology.micro_batches,
                        "pair": verl_options["pair"],
                    }
                )
                verl_keys.append((name, k, lengths, kept, keep, topology, cost))
    verl = run_verl(verl_cases)
    if verl is not None:
        for (name, k, lengths, kept, keep, topology, cost), got in zip(verl_keys, verl["plans"]):
            steps = [[[list(map(int, mb)) for mb in rank] for rank in step] for step in got["steps"]]
            per_key.setdefault((name, k, f"verl {verl['verl_version']}"), []).append(
                {
                    "steps": score(steps, lengths, kept, keep, topology, cost),
                    "plan_cpu_seconds": got["plan_cpu_seconds"],
                }
            )
    for (name, k, planner), records in per_key.items():
        rows.append({"case": name, "mini_batches": k, "planner": planner, **summary(records)})
    ours_rows = [r for r in rows if r["planner"] == "balancer" and r["case"] in GOAL_CASES]
    payload = {
        "question": "fixed post-training batches: slowest rank vs the section-3 step bound, balancer vs verl",
        "seeds": list(SEEDS),
        "verl": verl["verl_version"] if verl else "not installed (VERL_PYTHON missing)",
        "verl_environment": {"python": VERL_PYTHON, "torch": verl["torch_version"]} if verl else None,
        "goal": {
            "worst_ratio_at_most": 1.03,
            "cases": list(GOAL_CASES),
            "met": all(r["worst_ratio"] <= 1.03 for r in ours_rows),
        },
        "rows": rows,
    }
    path = write_result("post_training", payload, clock="process_cpu")
    for row in rows:
        print(
            f"{row['case']:40s} k={row['mini_batches']} {row['planner']:24s} M={row['micro_batches']:3d} "
            f"worst {row['worst_ratio']:.4f} mean {row['mean_ratio']:.4f} plan {row['plan_cpu_ms']:.1f} ms"
            + (f" pipeline saving {row['pipeline_order_saving']:.4f}" if "pipeline_order_saving" in row else "")
        )
    print(path)


# ---- the tables this benchmark states (rendered into docs/ by benchmarks/tables.py) ----


def table_post_training() -> str:
    data = tb.load("post_training")
    rows = [
        [
            row["case"],
            str(row["mini_batches"]),
            row["planner"],
            str(row["micro_batches"]),
            tb.fmt(row["worst_ratio"], ".4f"),
            tb.fmt(row["mean_ratio"], ".4f"),
            tb.fmt(row.get("pipeline_order_saving"), ".1%"),
            tb.fmt(row["plan_cpu_ms"], ".0f"),
        ]
        for row in sorted(data["rows"], key=lambda r: (r["case"], r["mini_batches"], r["planner"]))
    ]
    header = ["batch, topology", "mini-batches", "planner", "micro-batches (max)", "worst step / bound"]
    header += ["mean step / bound", "1F1B saving of the pipeline order", "plan CPU ms"]
    goal = data["goal"]
    return (
        f"{tb.markdown(header, rows)}\n\nSeeds {', '.join(map(str, data['seeds']))} (one batch each); verl: "
        f"{data['verl']}. Goal (balancer's worst step within 3% of the bound on "
        f"{'; '.join(goal.get('cases', ['every case']))}): "
        f"{'met' if goal['met'] else 'missed'}. Plan times: {tb.machine_line(data)}; {tb.commit_note(data)}."
    )


TABLES = {  # docs/ marker name -> the table, from the record
    "post_training": table_post_training,
}


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    main()
