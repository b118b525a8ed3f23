"""How balanced are torchtitan's packed batches, beside the project's plan, on the same documents?

Question: on the same documents (a trace's lengths; documents longer than seq_len cut into seq_len pieces, for every
method alike), how far is each method's epoch from the lower bound, how many tokens does it pad or leave out, and
how many tokens does a step hold?

- torchtitan: its own per-rank packing, run from torchtitan 0.3.0's code (`HuggingFaceTextDataset`: each DP rank
  reads its contiguous part of the data, concatenates its documents and cuts rows of seq_len tokens, positions reset
  per document and at every row start; the trainer stops when the first rank runs out);
- lpt: torchtitan's former load balancer, which is no longer in its published code (removed from main; not found
  in the stored sources either): OUR REIMPLEMENTATION of what it did, stated so: per step, the dp x M micro-batches
  torchtitan's packing made are dealt to the replicas by LPT (costliest first, to the least loaded replica with
  fewer than M), whole micro-batches only (documents never move between micro-batches);
- balanced: `BalancedDataLoader`'s plan (`BalancedBatchSampler` with the topology the loader derives from the same
  trainer settings: max_tokens = local_batch_size x seq_len, micro_batches = global batch / (dp x local batch)).

Metrics (docs/design.md): a micro-batch costs the sum of its pieces' costs (the analytic model of Llama 3 8B, the
loader's default), a replica's step time the sum of its micro-batches, a step the slowest replica. excess = sum over
steps of the step time / the lower bound of the documents the method trained (max(W / dp, costliest piece)) - 1;
0 is perfect. goal: balanced's excess <= 25% of the better of torchtitan and lpt.

    python benchmarks/torchtitan_packing.py            # writes results/torchtitan_packing.json, renders its table
                                                       # into docs/torchtitan.md (as benchmarks/tables.py does)
    python benchmarks/torchtitan_packing.py --render   # only renders the table from the record
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _common import table, write_result

from balancer.data.traces import load_trace
from balancer.integrations.torchtitan.cost import DEFAULT_SHAPE
from balancer.integrations.torchtitan.shape import plan_topology
from balancer.planning.cost.model import CostModel
from balancer.training.sampler import BalancedBatchSampler

DOC = Path(__file__).resolve().parents[1] / "docs" / "torchtitan.md"
ROWS = [("wlbllm", 32768, 8, 4), ("wlbllm", 65536, 4, 8), ("prolong", 65536, 8, 4), ("prolong", 131072, 4, 4)]


def pieces_of(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Documents cut into pieces of at most seq_len tokens (the same input for every method)."""
    out = []
    for n in lengths.tolist():
        out += [seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else [])
    return np.asarray(out, dtype=np.int64)


class LengthTokenizer:
    """torchtitan's tokenizer interface for a row that is a length: `n` tokens (+1, as torchtitan's shift drops
    one: a document of n tokens gives n inputs)."""

    def encode(self, n: int, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [0] * (int(n) + 1)


def torchtitan_rows(pieces: np.ndarray, seq_len: int, dp: int) -> list[list[np.ndarray]]:
    """Per DP rank, the rows torchtitan's HuggingFaceTextDataset yields, each as its pieces' lengths."""
    import datasets
    import torch
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as td

    rows = datasets.Dataset.from_dict({"n": pieces.tolist()})
    td.DATASETS["balancer_bench"] = DatasetConfig(path="in-memory", loader=lambda path: rows,
                                                  sample_processor=lambda sample: sample["n"])  # fmt: skip
    out = []
    for rank in range(dp):
        ds = td.HuggingFaceTextDataset("balancer_bench", None, LengthTokenizer(), seq_len=seq_len, dp_rank=rank,
                                       dp_world_size=dp, infinite=False)  # fmt: skip
        mine = []
        for inputs, _ in ds:
            starts = torch.nonzero(inputs["positions"] == 0).flatten().numpy()
            mine.append(np.diff(np.append(starts, seq_len)))
        out.append(mine)
    return out


def torchtitan_steps(rows: list, m: int, cost: CostModel) -> tuple[np.ndarray, list[np.ndarray]]:
    """([steps, dp, M] micro-batch costs, the pieces trained) of torchtitan's packing: step s holds rows s*M ..
    of every rank, as many steps as the shortest rank has."""
    steps = min(len(r) for r in rows) // m
    costs = np.array([[[cost.micro_batch_cost(r[s * m + j]) for j in range(m)] for r in rows] for s in range(steps)])
    trained = [r[i] for r in rows for i in range(steps * m)]
    return costs.reshape(steps, len(rows), m), trained


def lpt(costs: np.ndarray) -> np.ndarray:
    """Our reimplementation of torchtitan's former balancer: each step's micro-batches dealt by LPT, M per replica."""
    steps, dp, m = costs.shape
    out = np.zeros((steps, dp))
    for s in range(steps):
        load, count = np.zeros(dp), np.zeros(dp, dtype=int)
        for c in sorted(costs[s].ravel(), reverse=True):
            free = np.flatnonzero(count < m)
            r = free[np.argmin(load[free])]
            load[r] += c
            count[r] += 1
        out[s] = load
    return out


def balanced(pieces: np.ndarray, seq_len: int, dp: int, m: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """([steps, dp] replica times, [steps] tokens) of the loader's plan."""
    topo = plan_topology(dp_world_size=dp, seq_len=seq_len, local_batch_size=1, global_batch_size=dp * m,
                         cp_degree=1, pp_degree=1, tokens_per_step=None)  # fmt: skip
    s = BalancedBatchSampler(pieces, topo, cost, dp_rank=0, seed=0)
    times = [s.predicted_times(k).sum(axis=1) for k in range(s.num_steps)]
    return np.array(times), np.array([s.step_tokens(k) for k in range(s.num_steps)])


def figures(replica_times: np.ndarray, trained: np.ndarray, tokens: np.ndarray, dp: int, cost: CostModel) -> dict:
    c = cost.cost(trained)
    bound = max(float(c.sum()) / dp, float(c.max()))
    return {
        "excess": float(replica_times.max(axis=1).sum()) / bound - 1,
        "steps": int(len(replica_times)),
        "tokens_trained": int(trained.sum()),
        "tokens_per_step_mean": float(tokens.mean()),
        "tokens_per_step_min": int(tokens.min()),
        "tokens_per_step_max": int(tokens.max()),
    }


def run_row(trace: str, seq_len: int, dp: int, m: int, docs: int, cost: CostModel) -> dict:
    pieces = pieces_of(load_trace(trace, n=docs, seed=0), seq_len)
    t0 = time.process_time()
    rows = torchtitan_rows(pieces, seq_len, dp)
    costs, trained = torchtitan_steps(rows, m, cost)
    trained = np.concatenate(trained)
    tt_tokens = np.full(len(costs), dp * m * seq_len)
    out = {"trace": trace, "seq_len": seq_len, "dp": dp, "micro_batches": m, "documents": docs,
           "pieces": int(len(pieces)), "tokens": int(pieces.sum())}  # fmt: skip
    out["torchtitan"] = figures(costs.sum(axis=2), trained, tt_tokens, dp, cost)
    out["lpt"] = figures(lpt(costs), trained, tt_tokens, dp, cost)
    times, tokens = balanced(pieces, seq_len, dp, m, cost)
    out["balanced"] = figures(times, pieces, tokens, dp, cost)
    for name in ("torchtitan", "lpt", "balanced"):
        out[name]["tokens_left_out"] = out["tokens"] - out[name]["tokens_trained"]
        out[name]["padding_tokens"] = 0  # rows are full (torchtitan) or packed to their length (balanced)
    better = min(out["torchtitan"]["excess"], out["lpt"]["excess"])
    out["goal_met"] = out["balanced"]["excess"] <= 0.25 * better
    out["cpu_seconds"] = time.process_time() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20000, help="documents resampled from each trace (seed 0)")
    parser.add_argument("--render", action="store_true", help="only render the recorded table into the page")
    args = parser.parse_args()
    if args.render:
        return render_page()
    cost = CostModel.from_model(**DEFAULT_SHAPE)
    results = []
    for row in ROWS:
        results.append(run_row(*row, args.docs, cost))
        print(results[-1], flush=True)
    cols = ["trace", "seq_len", "dp x M", "method", "excess", "steps", "tokens/step (mean, min-max)",
            "tokens left out", "padding", "goal met"]  # fmt: skip
    body = []
    for r in results:
        for name in ("torchtitan", "lpt", "balanced"):
            f = r[name]
            body.append([r["trace"], str(r["seq_len"]), f"{r['dp']} x {r['micro_batches']}", name,
                         f"{f['excess']:.3f}", str(f["steps"]),
                         f"{f['tokens_per_step_mean']:.0f} ({f['tokens_per_step_min']}-{f['tokens_per_step_max']})",
                         str(f["tokens_left_out"]), str(f["padding_tokens"]),
                         ("yes" if r["goal_met"] else "no") if name == "balanced" else ""])  # fmt: skip
    write_result("torchtitan_packing", {"cost_model": cost.to_dict(), "cost_shape": DEFAULT_SHAPE, "rows": results,
                                        "tables": {"packing": table(cols, body)}},
                 clock="process_cpu")  # fmt: skip
    render_page()


def render_page() -> None:
    """docs/torchtitan.md with the recorded table regenerated (benchmarks/tables.py's renderer, this page only)."""
    import tables

    page = DOC.read_text()
    DOC.write_text(tables.render(page, DOC, {}))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
