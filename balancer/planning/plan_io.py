"""Reading, writing and checking plan files (JSON and `.npz`; the format is in docs/plan-format.md).

A plan file is untrusted input: `load_plan` checks every field it reads (types, ranges, pointer arrays, the
lengths it was made for) and raises one ValueError naming the file and the field, never an IndexError or a
silently wrong plan. `check_placements` is the invariant check behind `Plan.validate`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from balancer.planning.cost import CostModel
from balancer.planning.topology import Topology


class PlanFileError(ValueError):
    """A plan file that cannot be read as a valid plan."""


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


# ---------------------------------------------------------------------------------------------------- writing
def _micro_batch_record(mb) -> dict:
    return {"docs": mb.docs, "spans": [list(x) for x in mb.spans]} if mb.spans else {"docs": mb.docs}


def _step_record(step) -> dict:
    if step.slots is not None:
        return {
            "slots": [
                {"groups": [{"ranks": list(g.ranks), **_micro_batch_record(g)} for g in slot.groups]}
                for slot in step.slots
            ]
        }
    return {"replicas": [{"micro_batches": [_micro_batch_record(mb) for mb in r.micro_batches]} for r in step.replicas]}


def header(plan) -> dict:
    from balancer.planning.plans import FORMAT

    return {
        "format": FORMAT,
        "topology": plan.topology.to_dict(),
        "cost_model": plan.cost_model.to_dict(),
        "num_docs": plan.num_docs,
        "seed": plan.seed,
        "plan_seconds": plan.plan_seconds,
        "dropped_tokens": plan.dropped_tokens,
    }


def plan_to_dict(plan) -> dict:
    head = header(plan)
    data = {k: head[k] for k in ("format", "topology", "cost_model", "num_docs", "seed")}
    data["lengths"] = plan.lengths.tolist()
    data["steps"] = [_step_record(st) for st in plan.steps]
    return data


def save_plan(plan, path) -> None:
    path = Path(path)
    if path.suffix == ".npz":
        arrays = dict(
            lengths=plan.lengths,
            doc=plan.doc,
            start=plan.start,
            end=plan.end,
            mb_ptr=plan.mb_ptr,
            header=np.frombuffer(json.dumps(header(plan)).encode(), dtype=np.uint8),
        )
        if plan.dynamic:
            arrays.update(group_start=plan.group_start, group_size=plan.group_size, slot_ptr=plan.slot_ptr)
        if plan.natural_step is not None:
            arrays["natural_step"] = plan.natural_step
        _atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    else:
        data = plan_to_dict(plan)
        data.update({k: v for k, v in header(plan).items() if k not in data})
        if plan.natural_step is not None:
            data["natural_step"] = plan.natural_step.tolist()
        _atomic_write(path, lambda f: f.write(json.dumps(data, separators=(",", ":")).encode()))


# ---------------------------------------------------------------------------------------------------- reading
def _int_array(path, name: str, value, allow_negative: bool = False) -> np.ndarray:
    """A 1-D integer array from the file, or a PlanFileError naming the field."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise PlanFileError(f"{path}: field '{name}' must be a 1-D integer array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise PlanFileError(f"{path}: field '{name}' must hold integers, got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise PlanFileError(f"{path}: field '{name}' has values above the int64 range")
    arr = arr.astype(np.int64)
    if not allow_negative and arr.size and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise PlanFileError(f"{path}: field '{name}'[{i}] = {arr[i]} is negative")
    return arr


def _int(path, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PlanFileError(f"{path}: field '{name}' must be an integer, got {value!r}")
    return int(value)


def _check_ptr(path, name: str, ptr: np.ndarray, total: int) -> None:
    if len(ptr) == 0 or ptr[0] != 0 or ptr[-1] != total:
        raise PlanFileError(f"{path}: field '{name}' must run from 0 to {total}")
    if np.any(np.diff(ptr) < 0):
        i = int(np.argmax(np.diff(ptr) < 0))
        raise PlanFileError(f"{path}: field '{name}' decreases at index {i} ({ptr[i]} -> {ptr[i + 1]})")


def _parse_header(path, head) -> tuple[Topology, CostModel]:
    if not isinstance(head, dict):
        raise PlanFileError(f"{path}: the plan header must be an object")
    for key in ("topology", "cost_model"):
        if key not in head:
            raise PlanFileError(f"{path}: plan has no '{key}'")
    try:
        topology = Topology.from_dict(head["topology"])
    except (ValueError, TypeError) as e:
        raise PlanFileError(f"{path}: field 'topology': {e}") from None
    try:
        cost = CostModel.from_dict(head["cost_model"])
    except (ValueError, TypeError, KeyError) as e:
        raise PlanFileError(f"{path}: field 'cost_model': {e}") from None
    return topology, cost


def _check_lengths(path, stored, given) -> np.ndarray:
    if stored is None and given is None:
        raise PlanFileError(f"{path}: plan has no 'lengths'; pass lengths=")
    if stored is not None:
        stored = _int_array(path, "lengths", stored)
    if given is not None:
        given = np.asarray(given)
        if stored is not None and (given.shape != stored.shape or not np.array_equal(given, stored)):
            raise PlanFileError(
                f"{path}: the plan was made for other lengths ({len(stored)} documents, {int(stored.sum())} "
                f"tokens) than the ones given ({given.size} documents): re-plan for this data set"
            )
        return _int_array(path, "lengths (given)", given)
    return stored


def load_plan(cls, path, lengths, validate: bool):
    path = Path(path)
    try:
        if path.suffix == ".npz":
            plan = _load_npz(cls, path, lengths)
        else:
            plan = _load_json(cls, path, lengths)
        if validate:
            check_placements(plan)
    except PlanFileError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise PlanFileError(f"{path}: not a valid plan: {e}") from None
    return plan


def _load_npz(cls, path: Path, lengths):
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise PlanFileError(f"{path}: not a plan .npz file ({e})") from None
    with archive as z:
        for key in ("header", "doc", "start", "end", "mb_ptr"):
            if key not in z:
                raise PlanFileError(f"{path}: plan .npz has no '{key}' array")
        try:
            head = json.loads(z["header"].tobytes().decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanFileError(f"{path}: field 'header' is not JSON ({e})") from None
        topology, cost = _parse_header(path, head)
        arrays = {k: z[k] for k in z.files if k != "header"}
    lengths = _check_lengths(path, arrays.get("lengths"), lengths)
    doc, start, end = (_int_array(path, k, arrays[k]) for k in ("doc", "start", "end"))
    mb_ptr = _int_array(path, "mb_ptr", arrays["mb_ptr"])
    groups = None
    if topology.dynamic:
        missing = [k for k in ("group_start", "group_size", "slot_ptr") if k not in arrays]
        if missing:
            raise PlanFileError(f"{path}: dynamic-CP plan .npz has no '{missing[0]}' array")
        groups = tuple(_int_array(path, k, arrays[k]) for k in ("group_start", "group_size", "slot_ptr"))
    natural = _int_array(path, "natural_step", arrays["natural_step"]) if "natural_step" in arrays else None
    return _build(cls, path, head, lengths, topology, cost, (doc, start, end, mb_ptr), groups, natural)


def _load_json(cls, path: Path, lengths):
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{path}: not a plan JSON file ({e})") from None
    if not isinstance(data, dict):
        raise PlanFileError(f"{path}: not a plan JSON file (the top level is not an object)")
    for key in ("topology", "cost_model", "steps"):
        if key not in data:
            raise PlanFileError(f"{path}: plan JSON has no '{key}'")
    topology, cost = _parse_header(path, data)
    lengths = _check_lengths(path, data.get("lengths"), lengths)
    flat, groups = _json_steps(path, data["steps"], lengths, topology)
    natural = data.get("natural_step")
    natural = None if natural is None else _int_array(path, "natural_step", natural)
    return _build(cls, path, data, lengths, topology, cost, flat, groups, natural)


def _json_micro_batch(path, where: str, mb, lengths, out) -> None:
    doc, start, end = out
    if not isinstance(mb, dict) or not isinstance(mb.get("docs"), list):
        raise PlanFileError(f"{path}: {where} must be an object with a 'docs' list")
    for d in mb["docs"]:
        d = _int(path, f"{where}.docs", d)
        if not 0 <= d < len(lengths):
            raise PlanFileError(f"{path}: {where}.docs holds document {d}, outside 0..{len(lengths) - 1}")
        doc.append(d), start.append(0), end.append(int(lengths[d]))
    spans = mb.get("spans", [])
    if not isinstance(spans, list):
        raise PlanFileError(f"{path}: {where}.spans must be a list of [doc, start, end]")
    for span in spans:
        if not isinstance(span, list) or len(span) != 3:
            raise PlanFileError(f"{path}: {where}.spans holds {span!r}, not [doc, start, end]")
        d, a, b = (_int(path, f"{where}.spans", x) for x in span)
        if not 0 <= d < len(lengths):
            raise PlanFileError(f"{path}: {where}.spans holds document {d}, outside 0..{len(lengths) - 1}")
        doc.append(d), start.append(a), end.append(b)


def _json_list(path, where: str, value, key: str) -> list:
    if not isinstance(value, dict) or not isinstance(value.get(key), list):
        raise PlanFileError(f"{path}: {where} must be an object with a '{key}' list")
    return value[key]


def _json_steps(path, steps, lengths, topology: Topology):
    if not isinstance(steps, list):
        raise PlanFileError(f"{path}: field 'steps' must be a list")
    flat = ([], [], [])
    ptr = [0]
    group_start, group_size, slot_ptr = [], [], [0]
    for s, st in enumerate(steps):
        if topology.dynamic:
            for k, slot in enumerate(_json_list(path, f"steps[{s}]", st, "slots")):
                for g, grp in enumerate(_json_list(path, f"steps[{s}].slots[{k}]", slot, "groups")):
                    where = f"steps[{s}].slots[{k}].groups[{g}]"
                    ranks = grp.get("ranks") if isinstance(grp, dict) else None
                    if not isinstance(ranks, list) or len(ranks) != 2:
                        raise PlanFileError(f"{path}: {where}.ranks must be [start, size]")
                    group_start.append(_int(path, f"{where}.ranks", ranks[0]))
                    group_size.append(_int(path, f"{where}.ranks", ranks[1]))
                    _json_micro_batch(path, where, grp, lengths, flat)
                    ptr.append(len(flat[0]))
                slot_ptr.append(len(group_start))
        else:
            for r, rep in enumerate(_json_list(path, f"steps[{s}]", st, "replicas")):
                for m, mb in enumerate(_json_list(path, f"steps[{s}].replicas[{r}]", rep, "micro_batches")):
                    _json_micro_batch(path, f"steps[{s}].replicas[{r}].micro_batches[{m}]", mb, lengths, flat)
                    ptr.append(len(flat[0]))
    arrays = tuple(np.asarray(a, dtype=np.int64) for a in flat) + (np.asarray(ptr, dtype=np.int64),)
    groups = None
    if topology.dynamic:
        groups = tuple(np.asarray(a, dtype=np.int64) for a in (group_start, group_size, slot_ptr))
    return arrays, groups


def _build(cls, path, head, lengths, topology, cost, flat, groups, natural):
    doc, start, end, mb_ptr = flat
    if "num_docs" in head and _int(path, "num_docs", head["num_docs"]) != len(lengths):
        raise PlanFileError(f"{path}: field 'num_docs' = {head['num_docs']} but the plan has {len(lengths)} lengths")
    if not (len(doc) == len(start) == len(end)):
        raise PlanFileError(f"{path}: fields 'doc', 'start', 'end' differ in length")
    if len(doc) and doc.max() >= len(lengths):
        raise PlanFileError(f"{path}: field 'doc' holds document {int(doc.max())}, outside 0..{len(lengths) - 1}")
    _check_ptr(path, "mb_ptr", mb_ptr, len(doc))
    if groups is not None:
        _check_ptr(path, "slot_ptr", groups[2], len(groups[0]))
    if natural is not None and len(natural) != len(lengths):
        raise PlanFileError(f"{path}: field 'natural_step' has {len(natural)} entries for {len(lengths)} documents")
    seed = head.get("seed")
    if seed is not None:
        seed = _int(path, "seed", seed)
    dropped = head.get("dropped_tokens")
    if dropped is not None:
        dropped = _int(path, "dropped_tokens", dropped)
    plan_seconds = head.get("plan_seconds", float("nan"))
    if plan_seconds is None or isinstance(plan_seconds, bool) or not isinstance(plan_seconds, (int, float)):
        raise PlanFileError(f"{path}: field 'plan_seconds' must be a number, got {plan_seconds!r}")
    try:
        return cls(
            lengths, topology, cost, doc, start, end, mb_ptr, seed=seed, natural_step=natural,
            plan_seconds=float(plan_seconds), dropped_tokens=dropped, groups=groups,
        )  # fmt: skip
    except ValueError as e:
        raise PlanFileError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------------- invariants
def check_placements(plan) -> None:
    """Every token placed exactly once (up to a truncation cut), micro-batches non-empty and within their token
    caps, dynamic groups a valid partition of the pool in every slot. Raises ValueError naming the violation."""
    t = plan.topology
    counts = np.diff(plan.mb_ptr)
    if np.any(counts == 0):
        k = int(np.flatnonzero(counts == 0)[0])
        if plan.dynamic:
            raise ValueError(f"empty micro-batch: group {k} (ranks {plan.group_start[k]}+{plan.group_size[k]})")
        raise ValueError(
            f"empty micro-batch: step {k // t.bins_per_step}, replica "
            f"{(k // t.micro_batches) % t.dp}, micro-batch {k % t.micro_batches}"
        )
    tokens = np.ravel(plan.micro_batch_tokens())
    caps = t.max_tokens * plan.group_size if plan.dynamic else t.micro_batch_tokens
    if np.any(tokens > caps):
        k = int(np.argmax(tokens - caps))
        cap = np.broadcast_to(caps, tokens.shape)[k]
        what = f"max_tokens*size = {cap}" if plan.dynamic else f"max_tokens*cp = {cap}"
        raise ValueError(f"micro-batch {k} holds {tokens[k]} tokens > {what}")
    if plan.dynamic:
        check_partition(plan.group_start, plan.group_size, plan.slot_ptr, t)
    doc, start, end = plan.doc, plan.start, plan.end
    if np.any((doc < 0) | (doc >= plan.num_docs)):
        raise ValueError(
            f"a placement names document {int(doc[(doc < 0) | (doc >= plan.num_docs)][0])}, outside the plan"
        )
    bad = (start < 0) | (end <= start) | (end > plan.lengths[doc])
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"document {int(doc[i])} has an invalid token range [{int(start[i])}, {int(end[i])})")
    order = np.lexsort((start, doc))
    d, s, e = doc[order], start[order], end[order]
    first = np.ones(len(d), dtype=bool)
    first[1:] = d[1:] != d[:-1]
    if np.any(s[first] != 0):
        raise ValueError(f"document {int(d[first][np.argmax(s[first] != 0)])} does not start at token 0")
    gap = ~first & (s != np.roll(e, 1))
    if np.any(gap):
        raise ValueError(f"document {int(d[np.argmax(gap)])} has overlapping or missing spans")
    missing = np.setdiff1d(np.arange(plan.num_docs), d)
    if len(missing):
        raise ValueError(f"{len(missing)} documents are not in the plan (first: {int(missing[0])})")


def check_partition(group_start: np.ndarray, group_size: np.ndarray, slot_ptr: np.ndarray, topology: Topology) -> None:
    """Every slot's groups: sizes in `cp_sizes`, `start % size == 0`, sorted by start, covering the pool once."""
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
