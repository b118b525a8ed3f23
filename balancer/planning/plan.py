"""Plan: which documents (or document spans) every micro-batch of every replica of every step holds.

Stored flat: placement arrays `doc`, `start`, `end` (token range of the document; whole documents span
`[0, length)`) in plan order, cut into micro-batches by `mb_ptr`; micro-batch `k` is step `k // (dp*M)`, replica
`(k // M) % dp`, index `k % M`. `plan.steps[s].replicas[r].micro_batches[m].docs` is the nested view.
Inside a micro-batch whole documents come first, then spans, in the order the model sees them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from . import metrics as _metrics
from .cost import CostModel
from .topology import Topology

FORMAT = "balancer.plan/1"


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: whole documents `docs` and partial documents `spans` ([doc, start, end])."""

    docs: list[int]
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """Document ids in packing order (whole documents, then the documents of the spans)."""
        return self.docs + [s[0] for s in self.spans]


@dataclass(frozen=True)
class Replica:
    micro_batches: list[MicroBatch]


@dataclass(frozen=True)
class Step:
    replicas: list[Replica]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a plan is an ordinary file, shared as the user allows
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class Plan:
    """A whole epoch's assignment for one topology; see the module docstring for the layout."""

    def __init__(
        self,
        lengths: np.ndarray,
        topology: Topology,
        cost_model: CostModel,
        doc: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        mb_ptr: np.ndarray,
        *,
        seed: int | None = None,
        natural_step: np.ndarray | None = None,
        plan_seconds: float = float("nan"),
        dropped_tokens: int | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.topology = topology
        self.cost_model = cost_model
        self.doc = np.asarray(doc, dtype=np.int64)
        self.start = np.asarray(start, dtype=np.int64)
        self.end = np.asarray(end, dtype=np.int64)
        self.mb_ptr = np.asarray(mb_ptr, dtype=np.int64)
        self.seed = seed
        self.natural_step = None if natural_step is None else np.asarray(natural_step, dtype=np.int64)
        self.plan_seconds = plan_seconds
        per = topology.bins_per_step
        if (len(self.mb_ptr) - 1) % per:
            raise ValueError(f"plan has {len(self.mb_ptr) - 1} micro-batches, not a multiple of dp*M = {per}")
        if dropped_tokens is None:
            dropped_tokens = int(self.lengths.sum() - (self.end - self.start).sum())
        self.dropped_tokens = dropped_tokens

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_micro_batches(
        cls,
        steps: Sequence[Sequence[Sequence[Iterable[int]]]],
        lengths,
        topology: Topology,
        cost_model: CostModel,
        **kwargs,
    ) -> Plan:
        """Build from nested lists `steps[s][replica][m] -> doc ids` (whole documents only)."""
        flat, ptr = [], [0]
        for s, step in enumerate(steps):
            if len(step) != topology.dp:
                raise ValueError(f"step {s} has {len(step)} replicas, topology has dp={topology.dp}")
            for r, rep in enumerate(step):
                if len(rep) != topology.micro_batches:
                    raise ValueError(
                        f"step {s} replica {r} has {len(rep)} micro-batches, "
                        f"topology has micro_batches={topology.micro_batches}"
                    )
                for mb in rep:
                    flat.extend(int(d) for d in mb)
                    ptr.append(len(flat))
        lengths = np.asarray(lengths, dtype=np.int64)
        doc = np.asarray(flat, dtype=np.int64)
        return cls(lengths, topology, cost_model, doc, np.zeros_like(doc), lengths[doc], np.asarray(ptr), **kwargs)

    # ---- shape ----------------------------------------------------------------------------------------------
    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def num_steps(self) -> int:
        return (len(self.mb_ptr) - 1) // self.topology.bins_per_step

    def __len__(self) -> int:
        return self.num_steps

    def _micro_batch(self, k: int) -> MicroBatch:
        a, b = self.mb_ptr[k], self.mb_ptr[k + 1]
        doc, start, end = self.doc[a:b], self.start[a:b], self.end[a:b]
        whole = (start == 0) & (end == self.lengths[doc])
        spans = [(int(d), int(s), int(e)) for d, s, e in zip(doc[~whole], start[~whole], end[~whole])]
        return MicroBatch(docs=doc[whole].tolist(), spans=spans)

    def step(self, s: int) -> Step:
        t = self.topology
        base = s * t.bins_per_step
        return Step(
            [
                Replica([self._micro_batch(base + r * t.micro_batches + m) for m in range(t.micro_batches)])
                for r in range(t.dp)
            ]
        )

    @property
    def steps(self) -> list[Step]:
        """Nested view: `steps[s].replicas[r].micro_batches[m].docs`."""
        return [self.step(s) for s in range(self.num_steps)]

    def rank_view(self, dp_rank: int) -> list[list[list[int]]]:
        """This DP rank's micro-batches: `[step][m] -> document ids` in packing order."""
        t = self.topology
        if not 0 <= dp_rank < t.dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp={t.dp}")
        out = []
        for s in range(self.num_steps):
            base = s * t.bins_per_step + dp_rank * t.micro_batches
            out.append(
                [self.doc[self.mb_ptr[k] : self.mb_ptr[k + 1]].tolist() for k in range(base, base + t.micro_batches)]
            )
        return out

    # ---- costs and metrics ----------------------------------------------------------------------------------
    @cached_property
    def _entry_cost(self) -> np.ndarray:
        return self.cost_model.cost(self.end - self.start)

    def micro_batch_costs(self) -> np.ndarray:
        """[steps, dp, M] cost of each micro-batch (fixed included), before dividing by cp."""
        t = self.topology
        sums = (
            np.add.reduceat(np.append(self._entry_cost, 0.0), self.mb_ptr[:-1]) if len(self.mb_ptr) > 1 else np.zeros(0)
        )
        sums = np.where(np.diff(self.mb_ptr) > 0, sums, 0.0) + self.cost_model.fixed
        return sums.reshape(self.num_steps, t.dp, t.micro_batches)

    def micro_batch_tokens(self) -> np.ndarray:
        """[steps, dp, M] tokens of each micro-batch."""
        t = self.topology
        tok = np.concatenate([[0], np.cumsum(self.end - self.start)])[self.mb_ptr]
        return np.diff(tok).reshape(self.num_steps, t.dp, t.micro_batches)

    def step_of_entry(self) -> np.ndarray:
        counts = np.diff(self.mb_ptr)
        mb_index = np.repeat(np.arange(len(counts)), counts)
        return mb_index // self.topology.bins_per_step

    def metrics(self) -> dict:
        """The balance metrics of docs/design.md (see balancer.planning.metrics for the definitions)."""
        s_of = self.step_of_entry()
        c = self._entry_cost
        work = np.bincount(s_of, weights=c, minlength=self.num_steps)
        mx = np.zeros(self.num_steps)
        np.maximum.at(mx, s_of, c)
        delay = None
        if self.natural_step is not None:
            delay = np.abs(s_of - self.natural_step[self.doc])
        return _metrics.summarize(
            self.micro_batch_costs(),
            work,
            mx,
            self.topology,
            self.cost_model,
            total_tokens=int((self.end - self.start).sum()),
            dropped_tokens=self.dropped_tokens,
            delay_steps=delay,
            plan_seconds=self.plan_seconds,
        )

    def predict(self, cost: CostModel | None = None, layout="zigzag", method: str = "ring", **layout_options) -> dict:
        """Layout- and communication-aware time report (balancer.planning.predict.predict_plan; docs/cost-model.md);
        `metrics()` keeps the compute-only definitions."""
        from .predict import predict_plan

        return predict_plan(self, cost, layout, method, **layout_options)

    def validate(self) -> None:
        """Check the plan's invariants; raise ValueError naming the first violation.

        Every token of every document is placed exactly once (or, for truncated documents, once up to the cut),
        every micro-batch is non-empty and within `max_tokens * cp` tokens.
        """
        t = self.topology
        counts = np.diff(self.mb_ptr)
        if np.any(counts == 0):
            k = int(np.flatnonzero(counts == 0)[0])
            raise ValueError(
                f"empty micro-batch: step {k // t.bins_per_step}, replica "
                f"{(k // t.micro_batches) % t.dp}, micro-batch {k % t.micro_batches}"
            )
        tok = self.micro_batch_tokens().ravel()
        if np.any(tok > t.micro_batch_tokens):
            k = int(np.argmax(tok))
            raise ValueError(f"micro-batch {k} holds {tok[k]} tokens > max_tokens*cp = {t.micro_batch_tokens}")
        if np.any((self.start < 0) | (self.end <= self.start) | (self.end > self.lengths[self.doc])):
            raise ValueError("a placement has an invalid token range")
        order = np.lexsort((self.start, self.doc))
        d, s, e = self.doc[order], self.start[order], self.end[order]
        first = np.ones(len(d), dtype=bool)
        first[1:] = d[1:] != d[:-1]
        if np.any(s[first] != 0):
            raise ValueError(f"document {int(d[first][np.argmax(s[first] != 0)])} does not start at token 0")
        gap = ~first & (s != np.roll(e, 1))
        if np.any(gap):
            raise ValueError(f"document {int(d[np.argmax(gap)])} has overlapping or missing spans")
        missing = np.setdiff1d(np.arange(self.num_docs), d)
        if len(missing):
            raise ValueError(f"{len(missing)} documents are not in the plan (first: {int(missing[0])})")

    # ---- I/O ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "topology": self.topology.to_dict(),
            "cost_model": self.cost_model.to_dict(),
            "num_docs": self.num_docs,
            "seed": self.seed,
            "lengths": self.lengths.tolist(),
            "steps": [
                {
                    "replicas": [
                        {
                            "micro_batches": [
                                (
                                    {"docs": mb.docs, "spans": [list(x) for x in mb.spans]}
                                    if mb.spans
                                    else {"docs": mb.docs}
                                )
                                for mb in rep.micro_batches
                            ]
                        }
                        for rep in st.replicas
                    ]
                }
                for st in self.steps
            ],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: `.npz` (compact flat arrays) or anything else as JSON (docs/plan-format.md)."""
        path = Path(path)
        if path.suffix == ".npz":
            arrays = dict(
                lengths=self.lengths,
                doc=self.doc,
                start=self.start,
                end=self.end,
                mb_ptr=self.mb_ptr,
                header=np.frombuffer(json.dumps(self._header()).encode(), dtype=np.uint8),
            )
            if self.natural_step is not None:
                arrays["natural_step"] = self.natural_step
            _atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
        else:
            data = self.to_dict()
            data.update({k: v for k, v in self._header().items() if k not in data})
            if self.natural_step is not None:
                data["natural_step"] = self.natural_step.tolist()
            _atomic_write(path, lambda f: f.write(json.dumps(data, separators=(",", ":")).encode()))

    def _header(self) -> dict:
        return {
            "format": FORMAT,
            "topology": self.topology.to_dict(),
            "cost_model": self.cost_model.to_dict(),
            "num_docs": self.num_docs,
            "seed": self.seed,
            "plan_seconds": self.plan_seconds,
            "dropped_tokens": self.dropped_tokens,
        }

    @classmethod
    def load(cls, path: str | os.PathLike, lengths: np.ndarray | None = None) -> Plan:
        """Read a plan written by `save` (JSON or .npz). `lengths` is needed only if the file has none."""
        path = Path(path)
        if path.suffix == ".npz":
            with np.load(path) as z:
                header = json.loads(z["header"].tobytes().decode())
                return cls(
                    z["lengths"],
                    Topology.from_dict(header["topology"]),
                    CostModel.from_dict(header["cost_model"]),
                    z["doc"],
                    z["start"],
                    z["end"],
                    z["mb_ptr"],
                    seed=header.get("seed"),
                    plan_seconds=header.get("plan_seconds", float("nan")),
                    natural_step=z["natural_step"] if "natural_step" in z else None,
                    dropped_tokens=header.get("dropped_tokens"),
                )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a plan JSON file ({e})") from None
        for key in ("topology", "cost_model", "steps"):
            if key not in data:
                raise ValueError(f"{path}: plan JSON has no '{key}'")
        topo = Topology.from_dict(data["topology"])
        if lengths is None:
            if "lengths" not in data:
                raise ValueError(f"{path}: plan has no 'lengths'; pass lengths=")
            lengths = data["lengths"]
        lengths = np.asarray(lengths, dtype=np.int64)
        doc, start, end, ptr = [], [], [], [0]
        for st in data["steps"]:
            for rep in st["replicas"]:
                for mb in rep["micro_batches"]:
                    for d in mb["docs"]:
                        doc.append(d), start.append(0), end.append(int(lengths[d]))
                    for d, a, b in mb.get("spans", []):
                        doc.append(d), start.append(a), end.append(b)
                    ptr.append(len(doc))
        return cls(
            lengths,
            topo,
            CostModel.from_dict(data["cost_model"]),
            np.asarray(doc, dtype=np.int64),
            np.asarray(start, dtype=np.int64),
            np.asarray(end, dtype=np.int64),
            np.asarray(ptr),
            seed=data.get("seed"),
            plan_seconds=data.get("plan_seconds", float("nan")),
            natural_step=data.get("natural_step"),
            dropped_tokens=data.get("dropped_tokens"),
        )
