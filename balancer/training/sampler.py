"""BalancedBatchSampler: this DP rank's micro-batches of a balanced epoch plan, as a torch batch sampler.

Every rank plans the same epoch (`balancer.plan(lengths, topology, cost, seed=seed + epoch)`: deterministic, no
communication) and yields its own view: exactly `micro_batches` micro-batches per step, the same number on every rank,
every document once per epoch over all ranks (a last partial step is planned, not cut).

    sampler = BalancedBatchSampler(lengths, topo, cost, dp_rank=r, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PackedCollator(cp_rank=c, cp_size=topo.cp))
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for batch in loader: ...

Yielded indices are Python ints. With `overflow="split"` or `"truncate"`, a part of a document is yielded as a
:class:`Span` (doc, start, end); wrap the dataset in :class:`SpanDataset` so it returns that token range (a plain
dataset refuses a Span with an error instead of silently returning the whole document).

Resume contract (`state_dict` / `load_state_dict`, also the torchdata StatefulDataLoader protocol: the iterator
returned by `iter(sampler)` has `state_dict`/`load_state_dict` too):
  - the state holds the epoch, `position` (micro-batches of the current plan this rank has yielded), the seed, the
    overflow policy, a fingerprint of the lengths, and the chain of plan *segments* of this epoch (topology, cost
    model, steps consumed) - a few hundred bytes, no document lists: the consumed documents are re-derived by
    re-planning deterministically;
  - same topology and cost model: resume at any micro-batch; the remainder is identical to an uninterrupted run;
  - a different topology (DP size, CP size, micro_batches, max_tokens, ...) or cost model: the state must sit at a
    step boundary (`position % micro_batches == 0`, what every rank has after a finished optimizer step); the
    documents (or, for split documents, the token windows) not yet consumed are re-planned for the new topology with
    `seed + epoch`: nothing lost, nothing repeated. A mid-step state onto a new topology is refused;
  - a state from another seed, data set (lengths) or overflow policy is refused with a ValueError.

`len(sampler)` is the number of micro-batches this rank yields for the current plan of the epoch (the whole epoch,
or, after an elastic resume, the re-planned remainder); it is the same on every DP rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from balancer.planning.cost import CostModel
from balancer.planning.metrics import lower_bound, one_f_one_b
from balancer.planning.planner import plan as make_plan
from balancer.planning.topology import Topology
from balancer.planning.units import OVERFLOW_POLICIES
from balancer.training.indices import CPGroup, Member, Span, SpanDataset
from balancer.training.lengths import fingerprint_lengths, resolve_lengths
from balancer.training.sampler_state import STATE_FORMAT, check_state

__all__ = ["BalancedBatchSampler", "Span", "SpanDataset", "Member", "CPGroup", "resolve_lengths", "STATE_FORMAT"]


# ---------------------------------------------------------------------------------------------------- plan segments
@dataclass
class _Segment:
    """One plan of (part of) an epoch: placements (doc, start, end) cut into micro-batches by mb_ptr; with dynamic
    CP also each micro-batch's group (group_start, group_size) and the slot pointer."""

    topology: Topology
    cost: CostModel
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    mb_ptr: np.ndarray
    plan: Any
    group_start: Optional[np.ndarray] = None
    group_size: Optional[np.ndarray] = None
    slot_ptr: Optional[np.ndarray] = None

    @property
    def num_steps(self) -> int:
        if self.topology.dynamic:
            return (len(self.slot_ptr) - 1) // self.topology.micro_batches
        return (len(self.mb_ptr) - 1) // self.topology.bins_per_step

    def first_mb(self, step: int) -> int:
        """Index of the first micro-batch of `step` (`num_steps` gives the end)."""
        if self.topology.dynamic:
            return int(self.slot_ptr[step * self.topology.micro_batches])
        return step * self.topology.bins_per_step

    def mb_index(self, step: int, rank: int, m: int) -> int:
        """The micro-batch of slot `m` of `step` for `rank` (static: the DP rank; dynamic: the pool rank)."""
        t = self.topology
        if not t.dynamic:
            return step * t.bins_per_step + rank * t.micro_batches + m
        slot = step * t.micro_batches + m
        first, last = int(self.slot_ptr[slot]), int(self.slot_ptr[slot + 1])
        return first + int(np.searchsorted(self.group_start[first:last], rank, side="right")) - 1

    def group(self, k: int, rank: int) -> CPGroup:
        """The CP group of micro-batch `k` seen from `rank` (dynamic plans)."""
        start = int(self.group_start[k])
        return CPGroup(start, int(self.group_size[k]), rank - start)

    def placements(self, k: int):
        a, b = self.mb_ptr[k], self.mb_ptr[k + 1]
        return self.doc[a:b], self.start[a:b], self.end[a:b]

    def consumed_mask(self, steps: int) -> np.ndarray:
        """Placements of the first `steps` steps."""
        n = int(self.mb_ptr[self.first_mb(min(steps, self.num_steps))])
        mask = np.zeros(len(self.doc), dtype=bool)
        mask[:n] = True
        return mask


def _plan_units(
    lengths: np.ndarray, u_doc, u_start, u_end, topology: Topology, cost: CostModel, seed: int, overflow: str
) -> _Segment:
    """Plan units (doc, start, end) - each planned as a document of end-start tokens - and map back."""
    if len(u_doc) == 0:
        e = np.zeros(0, dtype=np.int64)
        groups = (e, e, np.zeros(1, dtype=np.int64)) if topology.dynamic else (None, None, None)
        return _Segment(topology, cost, e, e, e, np.zeros(1, dtype=np.int64), None, *groups)
    whole = (
        (len(u_doc) == len(lengths))
        and np.array_equal(u_doc, np.arange(len(lengths)))
        and not np.any(u_start)
        and np.array_equal(u_end, lengths)
    )
    p = make_plan(lengths if whole else (u_end - u_start), topology, cost, seed=seed, overflow=overflow)
    groups = (p.group_start, p.group_size, p.slot_ptr)
    if whole:
        return _Segment(topology, cost, p.doc, p.start, p.end, p.mb_ptr, p, *groups)
    doc, start, end = u_doc[p.doc], u_start[p.doc] + p.start, u_start[p.doc] + p.end
    return _Segment(topology, cost, doc, start, end, p.mb_ptr, p, *groups)


# ---------------------------------------------------------------------------------------------------- the sampler
class BalancedBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices) of the balanced plan of each epoch.

    Args:
        lengths: token count per dataset item: an array/list, a pretokenized folder (or `.npy`/`.json` lengths file)
            path, a `ShardDataset`, a `datasets.Dataset` (lengths of its `input_ids` rows), or the name of a column
            of `dataset` (an int column of lengths, or a list column such as `input_ids`).
        topology, cost: the `Topology` and `CostModel` of the run.
        dp_rank: this rank's data-parallel index. When None: from `device_mesh` (its `dp_dim` dimension) or, when
            torch.distributed is initialised, `rank // (cp * pp)` of the default group (DP outermost; the world size
            must equal `topology.world_size`); otherwise 0 when `topology.dp == 1`.
        seed: the epoch plan is `balancer.plan(..., seed=seed + epoch)`.
        overflow: the planner's policy for documents over `max_tokens * cp` ("error", "split", "truncate").
        dataset: the dataset the indices go to (checked to have `len(lengths)` items).
        rank: this rank's pool rank `dp_rank * cp + cp_rank` (instead of `dp_rank`). Required for dynamic CP
            (`topology.cp_sizes`) unless torch.distributed is initialised (then `global rank // pp`). With dynamic
            CP every whole document comes as a :class:`Member` (an int) and every part as a :class:`Span`, both
            carrying the micro-batch's :class:`CPGroup`; wrap the dataset in `SpanDataset` so the items carry it
            to `PackedCollator`.
    """

    def __init__(
        self,
        lengths,
        topology: Topology,
        cost: CostModel,
        dp_rank: Optional[int] = None,
        seed: int = 0,
        overflow: str = "error",
        dataset=None,
        device_mesh=None,
        dp_dim: str = "dp",
        rank: Optional[int] = None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a balancer.Topology, got {type(topology).__name__}")
        if not isinstance(cost, CostModel):
            raise TypeError(f"cost must be a balancer.CostModel, got {type(cost).__name__}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.lengths, _ = resolve_lengths(lengths, dataset)
        longest = int(self.lengths.max())
        if topology.dynamic:
            from balancer.planning.dynamic import check_fits

            check_fits(self.lengths, topology, overflow)
        elif overflow == "error" and longest > topology.micro_batch_tokens:
            i = int(np.argmax(self.lengths))
            raise ValueError(
                f"document {i} has {longest} tokens, more than a micro-batch holds: max_tokens*cp = "
                f"{topology.max_tokens}*{topology.cp} = {topology.micro_batch_tokens}; raise max_tokens "
                "or cp, or pass overflow='split' or 'truncate'"
            )
        self.topology = topology
        self.cost = cost
        self.seed = int(seed)
        self.overflow = overflow
        self.pool_rank = _resolve_pool_rank(rank, dp_rank, topology, device_mesh, dp_dim)
        self.dp_rank = self.pool_rank // topology.cp
        self.fingerprint = fingerprint_lengths(self.lengths)
        self.epoch = 0
        self.position = 0  # micro-batches of the current segment this rank has yielded
        self._history: list[dict] = []  # earlier segments of this epoch: {"topology", "cost", "steps"}
        self._segment: Optional[_Segment] = None
        self._resume_pending = False

    # ---- plan -------------------------------------------------------------------------------------------------
    @property
    def segment(self) -> _Segment:
        """The current plan segment (the epoch's plan, or its re-planned remainder after an elastic resume)."""
        if self._segment is None:
            self._segment = self._build_segment(self._history)
        return self._segment

    @property
    def plan(self):
        """The `balancer.Plan` of the current segment (None if nothing is left)."""
        return self.segment.plan

    def _build_segment(self, history: list[dict]) -> _Segment:
        seed = self.seed + self.epoch
        n = len(self.lengths)
        u_doc, u_start, u_end = np.arange(n), np.zeros(n, dtype=np.int64), self.lengths.copy()
        for h in history:
            seg = _plan_units(self.lengths, u_doc, u_start, u_end, h["topology"], h["cost"], seed, self.overflow)
            if h["steps"] > seg.num_steps:
                raise ValueError(
                    f"the state says {h['steps']} steps were consumed but that plan has only {seg.num_steps}"
                )
            left = ~seg.consumed_mask(h["steps"])
            u_doc, u_start, u_end = seg.doc[left], seg.start[left], seg.end[left]
            order = np.lexsort((u_start, u_doc))
            u_doc, u_start, u_end = u_doc[order], u_start[order], u_end[order]
        return _plan_units(self.lengths, u_doc, u_start, u_end, self.topology, self.cost, seed, self.overflow)

    @property
    def num_steps(self) -> int:
        return self.segment.num_steps

    def __len__(self) -> int:
        return self.segment.num_steps * self.topology.micro_batches

    def micro_batch(self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None) -> list:
        """Indices of micro-batch (slot) `m` of `step` for `dp_rank` or pool `rank` (default: this rank)."""
        seg = self.segment
        if not self.topology.dynamic:
            dp = self.dp_rank if dp_rank is None else dp_rank
            if rank is not None:
                dp = rank // self.topology.cp
            doc, start, end = seg.placements(seg.mb_index(step, dp, m))
            full = self.lengths[doc]
            return [int(d) if (s == 0 and e == f) else Span(d, s, e) for d, s, e, f in zip(doc, start, end, full)]
        rank = self.pool_rank if rank is None else rank
        k = seg.mb_index(step, rank, m)
        group = seg.group(k, rank)
        doc, start, end = seg.placements(k)
        full = self.lengths[doc]
        return [
            Member(d, group) if (s == 0 and e == f) else Span(d, s, e, group)
            for d, s, e, f in zip(doc, start, end, full)
        ]

    def cp_group(self, step: int, m: int) -> CPGroup:
        """The CP group this rank runs micro-batch (slot) `m` of `step` on (static plans: its replica's)."""
        t = self.topology
        if not t.dynamic:
            return CPGroup(self.dp_rank * t.cp, t.cp, self.pool_rank - self.dp_rank * t.cp)
        return self.segment.group(self.segment.mb_index(step, self.pool_rank, m), self.pool_rank)

    def step_of(self, index: int) -> tuple[int, int]:
        """(step, m) of the `index`-th micro-batch this rank yields in the current segment."""
        return divmod(int(index), self.topology.micro_batches)

    # ---- per-step information -----------------------------------------------------------------------------------
    def _step_slice(self, step: int) -> slice:
        seg = self.segment
        if not 0 <= step < seg.num_steps:
            raise IndexError(f"step {step} out of range: this plan has {seg.num_steps} steps")
        return slice(int(seg.mb_ptr[seg.first_mb(step)]), int(seg.mb_ptr[seg.first_mb(step + 1)]))

    def step_loss_tokens(self, step: int) -> int:
        """Global number of loss tokens of `step` (all DP ranks, all micro-batches): sum over its documents (or
        document windows) of `tokens - 1`, each document's last token having no target. Pass it to
        `balancer.loss.token_loss` as the normaliser (valid when every token is a training target; with masked
        labels, sum the collator's `num_loss_tokens` over the step instead)."""
        sl = self._step_slice(step)
        seg = self.segment
        return int((seg.end[sl] - seg.start[sl] - 1).sum())

    def step_tokens(self, step: int) -> int:
        sl = self._step_slice(step)
        return int((self.segment.end[sl] - self.segment.start[sl]).sum())

    def step_num_sequences(self, step: int) -> int:
        """Documents (or windows) of `step` holding at least one loss token: the normaliser of the per-sequence
        loss (`balancer.loss.token_loss(..., reduction="sequence")`)."""
        sl = self._step_slice(step)
        return int(((self.segment.end[sl] - self.segment.start[sl]) > 1).sum())

    def predicted_times(self, step: int) -> np.ndarray:
        """[dp, M] predicted time (cost-model units) of every micro-batch of `step` on one CP rank: cost / cp.
        Dynamic CP: [M] the time of this rank's group in every slot, cost / size."""
        seg = self.segment
        if seg.plan is None:
            raise IndexError("nothing left to plan in this epoch")
        self._step_slice(step)
        if self.topology.dynamic:
            ks = [seg.mb_index(step, self.pool_rank, m) for m in range(self.topology.micro_batches)]
            return seg.plan.micro_batch_costs()[ks] / seg.group_size[ks]
        return seg.plan.micro_batch_costs()[step] / self.topology.cp

    def predicted_step(self, step: int) -> dict:
        """Telemetry of `step`: predicted per-replica 1F1B times (`replica_times`, [dp]), the step time (max), the
        step's lower bound (docs/design.md) and their ratio (`imbalance`), loss tokens and tokens."""
        t = self.topology
        mb = self.predicted_times(step)
        if t.dynamic:  # the step time needs every rank's waits: the plan's model; no per-replica times
            rep = np.array([self.segment.plan.step_times()[step]])
        else:
            rep = one_f_one_b(mb.max(axis=1), mb.sum(axis=1), t.pp)
        sl = self._step_slice(step)
        seg = self.segment
        c = self.cost.cost(seg.end[sl] - seg.start[sl])
        lb = float(lower_bound(c.sum(), c.max(), t, self.cost.fixed))
        return {
            "replica_times": rep,
            "step_time": float(rep.max()),
            "lower_bound": float(lb),
            "imbalance": float(rep.max() / lb) if lb > 0 else 1.0,
            "loss_tokens": self.step_loss_tokens(step),
            "tokens": self.step_tokens(step),
        }

    # ---- iteration ------------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its plan uses seed + epoch). Setting the epoch a loaded state is in keeps the resume
        position; any other epoch starts from its beginning."""
        epoch = int(epoch)
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self.position = 0
        self._history = []
        self._segment = None
        self._resume_pending = False

    def __iter__(self) -> _SamplerIter:
        if self._resume_pending:
            self._resume_pending = False
        else:
            if self._history:  # a fresh pass over an epoch that was resumed elastically: whole epoch
                self._history = []
                self._segment = None
            self.position = 0
        return _SamplerIter(self)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self, position: Optional[int] = None) -> dict:
        """The resume state. `position` overrides the micro-batches counted as consumed (default: those handed
        out; with DataLoader workers prefetching, pass the number your loop consumed in the current plan)."""
        if position is None:
            position = self.position
        elif not 0 <= int(position) <= len(self):
            raise ValueError(f"position {position} out of range 0..{len(self)}")
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "position": int(position),
            "seed": self.seed,
            "overflow": self.overflow,
            "fingerprint": self.fingerprint,
            "num_docs": int(len(self.lengths)),
            "dp_rank": self.dp_rank,
            "rank": self.pool_rank,
            "segments": [
                {"topology": h["topology"].to_dict(), "cost": h["cost"].to_dict(), "steps": h["steps"]}
                for h in self._history
            ]
            + [{"topology": self.topology.to_dict(), "cost": self.cost.to_dict(), "steps": None}],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` output (see the module docstring for the contract); the next `iter()` yields
        the remainder of the saved epoch."""
        state = check_state(state)
        if state["fingerprint"] != self.fingerprint or state["num_docs"] != len(self.lengths):
            raise ValueError(
                f"the state is from another data set: {state['num_docs']} documents with lengths "
                f"fingerprint {state['fingerprint']}, this sampler has {len(self.lengths)} documents "
                f"with fingerprint {self.fingerprint}"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"the state is from seed {state['seed']}, this sampler has seed {self.seed}")
        if state["overflow"] != self.overflow:
            raise ValueError(
                f"the state is from overflow={state['overflow']!r}, this sampler has overflow={self.overflow!r}"
            )
        segs = state["segments"]
        history = [{"topology": s["topology"], "cost": s["cost"], "steps": s["steps"]} for s in segs[:-1]]
        last_topo, last_cost = segs[-1]["topology"], segs[-1]["cost"]
        position = state["position"]
        self.epoch = state["epoch"]
        if last_topo == self.topology and last_cost == self.cost:
            self._history, self.position = history, position
        else:
            if position % last_topo.micro_batches:
                raise ValueError(
                    f"the state is mid-step (micro-batch {position % last_topo.micro_batches} of step "
                    f"{position // last_topo.micro_batches}) of a plan for {last_topo}; it can resume only onto the "
                    f"same topology and cost model. Save at a step boundary to change the topology "
                    f"(now {self.topology})"
                )
            self._history = history + [
                {"topology": last_topo, "cost": last_cost, "steps": position // last_topo.micro_batches}
            ]
            self.position = 0
        self._segment = None
        if self.position > len(self):
            raise ValueError(f"the state's position {self.position} is past the plan's {len(self)} micro-batches")
        self._resume_pending = True


class _SamplerIter:
    """Iterator over the sampler's remaining micro-batches; Stateful (torchdata) through the sampler."""

    def __init__(self, sampler: BalancedBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> _SamplerIter:
        return self

    def __next__(self) -> list:
        s = self.sampler
        if s.position >= len(s):
            raise StopIteration
        step, m = divmod(s.position, s.topology.micro_batches)
        out = s.micro_batch(step, m)
        s.position += 1
        return out

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.sampler._resume_pending = False


def _resolve_pool_rank(rank, dp_rank, topology: Topology, device_mesh, dp_dim: str) -> int:
    """This rank's pool rank (`dp_rank * cp + cp_rank`) from `rank`, or `dp_rank` / the device mesh /
    torch.distributed as `_resolve_dp_rank` finds it (CP rank from torch.distributed when initialised, else 0)."""
    if rank is not None:
        if isinstance(rank, bool) or int(rank) != rank or not 0 <= int(rank) < topology.pool_size:
            raise ValueError(f"rank {rank!r} out of range for a pool of dp*cp = {topology.pool_size} ranks")
        if dp_rank is not None and int(dp_rank) != int(rank) // topology.cp:
            raise ValueError(f"dp_rank {dp_rank} and pool rank {rank} disagree (pool rank = dp_rank*cp + cp_rank)")
        return int(rank)
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if topology.dynamic and dp_rank is None and device_mesh is None and not initialised:
        if topology.pool_size == 1:
            return 0
        raise ValueError(
            "with dynamic CP (cp_sizes) pass rank= (the pool rank dp_rank*cp + cp_rank) or initialise torch.distributed"
        )
    dp = _resolve_dp_rank(dp_rank, topology, device_mesh, dp_dim)
    if dp_rank is None and device_mesh is None and initialised:
        return dist.get_rank() // topology.pp
    if topology.dynamic and topology.cp > 1:
        raise ValueError("with dynamic CP and cp > 1 the CP rank is needed too: pass rank= (dp_rank*cp + cp_rank)")
    return dp * topology.cp


def _resolve_dp_rank(dp_rank, topology: Topology, device_mesh, dp_dim: str) -> int:
    if dp_rank is not None:
        if isinstance(dp_rank, bool) or int(dp_rank) != dp_rank or not 0 <= int(dp_rank) < topology.dp:
            raise ValueError(f"dp_rank {dp_rank!r} out of range for dp={topology.dp}")
        return int(dp_rank)
    if device_mesh is not None:
        size = device_mesh.size(device_mesh.mesh_dim_names.index(dp_dim)) if device_mesh.mesh_dim_names else None
        if size != topology.dp:
            raise ValueError(f"the device mesh's {dp_dim!r} dimension has {size} ranks, topology has dp={topology.dp}")
        return int(device_mesh.get_local_rank(dp_dim))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"torch.distributed has {world} ranks but the topology needs dp*cp*pp = "
                f"{topology.world_size}; pass dp_rank= or device_mesh="
            )
        return dist.get_rank() // (topology.cp * topology.pp)
    if topology.dp == 1:
        return 0
    raise ValueError(f"dp_rank is not given and torch.distributed is not initialised (topology has dp={topology.dp})")
