"""The invariants of a plan (`Plan.validate`, `Plan.load(validate=True)`): micro-batches non-empty and within their
caps, dynamic CP groups a partition of the pool in every slot, and every document's spans covering it exactly once
(up to a truncation cut). Vectorised: a plan of a million documents checks in a fraction of a second
(docs/plan-format.md). Errors name the
step, replica (or slot and group) and micro-batch, and the document."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from balancer.planning.topology import Topology

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan


def micro_batch_name(plan: Plan, k: int) -> str:
    """'step s, replica r, micro-batch m' (dynamic: 'step s, slot j, group g (ranks start+size)') of micro-batch k."""
    t = plan.topology
    if not plan.dynamic:
        step = min(k // t.bins_per_step, max(plan.num_steps - 1, 0))
        ms, local = plan.step_micro_batches(step), k - step * t.bins_per_step
        return f"step {step}, replica {local // ms}, micro-batch {local % ms}"
    group_start, group_size, slot_ptr = plan.group_arrays
    slot = int(np.searchsorted(slot_ptr, k, side="right") - 1)
    group = k - int(slot_ptr[slot])
    ranks = f"{int(group_start[k])}+{int(group_size[k])}"
    return f"step {slot // t.micro_batches}, slot {slot % t.micro_batches}, group {group} (ranks {ranks})"


def _entry_name(plan, i: int) -> str:
    return micro_batch_name(plan, int(np.searchsorted(plan.mb_ptr, i, side="right") - 1))


def check_placements(plan: Plan) -> None:
    """Every micro-batch non-empty and within its token cap, dynamic groups a valid partition of the pool in every
    slot, and every document's spans cover it (`check_coverage`). Raises ValueError naming the violation."""
    t = plan.topology
    counts = np.diff(plan.mb_ptr)
    if np.any(counts == 0):
        raise ValueError(f"empty micro-batch: {micro_batch_name(plan, int(np.flatnonzero(counts == 0)[0]))}")
    tokens = plan.flat_micro_batch_tokens()
    caps = t.max_tokens * plan.group_arrays[1] if plan.dynamic else t.micro_batch_tokens
    if np.any(tokens > caps):
        k = int(np.argmax(tokens - caps))
        cap = np.broadcast_to(caps, tokens.shape)[k]
        what = f"max_tokens*size = {cap}" if plan.dynamic else f"max_tokens*cp = {cap}"
        raise ValueError(f"micro-batch {k} ({micro_batch_name(plan, k)}) holds {tokens[k]} tokens > {what}")
    if plan.dynamic:
        check_partition(*plan.group_arrays, t)
    check_coverage(plan)


def check_coverage(plan: Plan) -> None:
    """Every document placed (a window plan: exactly its window's documents), its spans starting at token 0,
    consecutive (no gap, no overlap) and ending at its length, or, for a plan with dropped tokens
    (overflow='truncate'), at one truncation cut shared by every document longer than it; the tokens short of the
    lengths add up to `dropped_tokens`. Vectorised: one sort."""
    lengths = plan.lengths
    outside = (plan.doc < 0) | (plan.doc >= plan.num_docs)
    if np.any(outside):
        i = int(np.argmax(outside))
        raise ValueError(f"{_entry_name(plan, i)}: a placement names document {int(plan.doc[i])}, outside the plan")
    doc, start, end, entries = _real_entries(plan)
    bad = (start < 0) | (end <= start) | (end > lengths[doc])
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"{_entry_name(plan, entries[i])}: document {int(doc[i])} ({int(lengths[doc[i]])} tokens) has an invalid "
            f"token range [{int(start[i])}, {int(end[i])})"
        )
    order = np.lexsort((start, doc))
    d, s, e = doc[order], start[order], end[order]
    first = np.ones(len(d), dtype=bool)
    first[1:] = d[1:] != d[:-1]
    present = np.zeros(plan.num_docs, dtype=bool)
    present[d[first]] = True
    if plan.window_ids is None:
        expected = np.ones(plan.num_docs, dtype=bool)
    else:
        expected = np.zeros(plan.num_docs, dtype=bool)
        expected[plan.window_ids] = True
    if np.any(expected & ~present):
        missing = np.flatnonzero(expected & ~present)
        raise ValueError(f"{len(missing)} documents are not in the plan (first: document {int(missing[0])})")
    if np.any(present & ~expected):
        extra = int(np.argmax(present & ~expected))
        raise ValueError(f"document {extra} is placed but is not in the plan's window ({plan.window})")
    broken = (first & (s != 0)) | (~first & (s != np.roll(e, 1)))
    if np.any(broken):
        j = int(np.argmax(broken))
        what = "does not start at token 0" if first[j] else f"has a gap or overlap at token {int(np.roll(e, 1)[j])}"
        raise ValueError(
            f"{_entry_name(plan, int(entries[order[j]]))}: document {int(d[j])}: its span [{int(s[j])}, "
            f"{int(e[j])}) {what}"
        )
    last = np.append(first[1:], True)
    # per placed document (every document, or a window's), the end of its last span
    _check_shortfall(plan, d[last], e[last], entries[order[last]])


def _real_entries(plan):
    """(doc, start, end, entry index) of the placements that are documents: filler rows (whole copies of real rows,
    checked to be so) left out of the coverage."""
    doc, start, end = plan.doc, plan.start, plan.end
    entries = np.arange(len(doc))
    if plan.filler is None:
        return doc, start, end, entries
    f = np.flatnonzero(plan.filler)
    bad = (start[f] != 0) | (end[f] != plan.lengths[doc[f]])
    if np.any(bad):
        i = int(f[np.argmax(bad)])
        raise ValueError(f"{_entry_name(plan, i)}: a filler row must copy a whole row (document {int(doc[i])})")
    keep = ~plan.filler
    return doc[keep], start[keep], end[keep], entries[keep]


def _check_shortfall(plan, docs: np.ndarray, covered: np.ndarray, last_entry: np.ndarray) -> None:
    lengths = plan.lengths[docs]
    short = covered < lengths
    dropped = int((lengths - covered).sum())
    if not short.any() and dropped == plan.dropped_tokens:
        return
    t = plan.topology
    cuts = {t.max_tokens * size for size in (t.cp_sizes or (t.cp,))}  # what overflow="truncate" cuts at
    cut = int(covered[short].max()) if short.any() else 0
    off = short & ~np.isin(covered, list(cuts))
    # a truncation cut: every document longer than it ends at it; the plan records the tokens dropped
    wrong = off | (short & (covered != cut)) | (~short & (lengths > cut)) if plan.dropped_tokens else short
    if np.any(wrong):
        i = int(np.argmax(off)) if off.any() else int(np.argmax(wrong))
        why = (
            f"other documents are cut at {cut}"
            if plan.dropped_tokens and not off.any()
            else "a span is missing or shortened"
        )
        raise ValueError(
            f"document {int(docs[i])} has {int(lengths[i])} tokens but its spans end at token {int(covered[i])} "
            f"(last span in {_entry_name(plan, int(last_entry[i]))}): {why}"
        )
    if dropped != plan.dropped_tokens:
        raise ValueError(
            f"the plan records dropped_tokens = {plan.dropped_tokens}, but its spans leave {dropped} tokens out"
        )


def check_partition(group_start: np.ndarray, group_size: np.ndarray, slot_ptr: np.ndarray, topology: Topology) -> None:
    """Every slot's groups: sizes in `cp_sizes`, `start % size == 0`, sorted by start, covering the pool once."""
    assert topology.cp_sizes is not None, "CP groups belong to dynamic plans: cp_sizes is set"
    sizes = np.asarray(topology.cp_sizes)
    bad = ~np.isin(group_size, sizes)
    if np.any(bad):
        k = int(np.argmax(bad))
        raise ValueError(f"group {k} has size {group_size[k]}, not one of cp_sizes {list(topology.cp_sizes)}")
    misaligned = group_start % group_size != 0
    if np.any(misaligned):
        k = int(np.argmax(misaligned))
        raise ValueError(f"group {k} starts at rank {group_start[k]}, not a multiple of its size {group_size[k]}")
    expected = np.zeros(len(group_start), dtype=np.int64)  # each group starts where the previous one ended
    ends = group_start + group_size
    expected[1:] = ends[:-1]
    expected[slot_ptr[:-1][np.diff(slot_ptr) > 0]] = 0
    wrong = group_start != expected
    last = slot_ptr[1:][np.diff(slot_ptr) > 0] - 1
    short = np.zeros(len(group_start), dtype=bool)
    short[last] = ends[last] != topology.pool_size
    if np.any(wrong | short) or np.any(np.diff(slot_ptr) == 0):
        slot = int(np.searchsorted(slot_ptr, int(np.argmax(wrong | short)), side="right") - 1)
        raise ValueError(f"slot {slot}: the groups do not cover the pool of {topology.pool_size} ranks exactly once")


def check_last(topology: Topology, last: int | None) -> int:
    """`last_micro_batches` as an int in 1..micro_batches (None: micro_batches), else a ValueError naming it."""
    m = topology.micro_batches
    if last is None:
        return m
    if isinstance(last, bool) or not isinstance(last, (int, np.integer)) or not 1 <= last <= m:
        raise ValueError(f"last_micro_batches must be an integer in 1..micro_batches = {m}, got {last!r}")
    return int(last)


def check_shape(count: int, per: int, last: int, what: str, name: str) -> None:
    """`count` micro-batches (or slots) must be whole steps of `per`, the last one of `last`."""
    if count % per == 0 and last == per:
        return
    if last < per and count >= last and (count - last) % per == 0:
        return
    raise ValueError(
        f"plan has {count} {what}, not steps of {name} = {per}" + (f" and a last step of {last}" if last < per else "")
    )
