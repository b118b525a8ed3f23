"""Reading, writing and checking plan files (JSON and `.npz`; the format is in docs/plan-format.md).

A plan file is untrusted input: `load_plan` checks every field it reads (types, ranges, pointer arrays, the
lengths it was made for) and raises one ValueError naming the file and the field, never an IndexError or a
silently wrong plan; with `validate=True` the invariants too (balancer.planning.plans.checks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from balancer.files import atomic_write
from balancer.planning.cost.model import COST_FIELDS, CostModel
from balancer.planning.plans.checks import check_placements
from balancer.planning.shuffle import WindowInfo, num_windows, window_range
from balancer.planning.topology import Topology
from balancer.strict_json import (
    FORMAT_KEYS,
    FormatSpec,
    array,
    check,
    check_format,
    integer,
    load_json,
    number,
    obj,
    parse_json,
)

if TYPE_CHECKING:
    from balancer.planning.plans.plan import Plan

# Version history (docs/plan-format.md): 1 = "format": "balancer.plan/1"; 2 = "format": "balancer.plan" with
# "format_version", plan_seconds null instead of NaN, keys checked strictly (nothing else changed); 3 = "window" (a
# window plan of balancer.plan_window records which window of which shuffle it places); 4 = "rank_speeds" in the
# topology (uneven ranks); 5 = "last_micro_batches" (M' < micro_batches: the last step's micro-batches per replica,
# or slots). A plan is written at the oldest version whose keys it uses: older readers load it, byte for byte.
PLAN_FORMAT = FormatSpec("balancer.plan", 5, {"balancer.plan/1": 1})
SPEEDS_VERSION = 4
SHORT_STEP_VERSION = 5
WINDOW_RECORD = obj(
    {
        "seed": integer(min=0),
        "epoch": integer(min=0),
        "index": integer(min=0),
        "num_windows": integer(min=1),
        "window_docs": integer(min=1),
        "first": integer(min=0),
        "stop": integer(min=0),
    },
    nullable=True,
    required=False,
    since=3,
)
TOPOLOGY_RECORD = obj(
    {
        **{k: integer(min=1) for k in ("dp", "cp", "pp", "micro_batches", "max_tokens")},
        "tokens_per_step": integer(min=1, nullable=True, required=False),
        "cp_sizes": array(integer(min=1), nullable=True, required=False),
        "rank_speeds": array(number(min=0), nullable=True, required=False, since=SPEEDS_VERSION),
    }
)
HEADER_KEYS = {
    **FORMAT_KEYS,
    "topology": TOPOLOGY_RECORD,
    "cost_model": obj(COST_FIELDS),
    "num_docs": integer(min=0, required=False),
    "seed": integer(nullable=True, required=False),
    "plan_seconds": number(min=0, nullable=True, required=False),
    "dropped_tokens": integer(min=0, nullable=True, required=False),
    "layout": obj(required=False),  # {"kind": ..., options}: the CP layout the plan is sharded with
    "window": WINDOW_RECORD,
    "last_micro_batches": integer(min=1, required=False, since=SHORT_STEP_VERSION),
    "filler_rows": integer(min=0, required=False, since=SHORT_STEP_VERSION),
}
JSON_PLAN = obj(
    {**HEADER_KEYS, "lengths": array(required=False), "steps": array(), "natural_step": array(required=False)}
)
NPZ_ARRAYS: tuple[str, ...] = (
    "lengths",
    "doc",
    "start",
    "end",
    "mb_ptr",
    "header",
    "group_start",
    "group_size",
    "slot_ptr",
)
NPZ_ARRAYS += ("natural_step", "filler")


class PlanFileError(ValueError):
    """A plan file that cannot be read as a valid plan."""


# ---------------------------------------------------------------------------------------------------- writing
def _micro_batch_record(mb) -> dict:
    record = {"docs": mb.docs, "spans": [list(x) for x in mb.spans]} if mb.spans else {"docs": mb.docs}
    return {**record, "fillers": mb.fillers} if mb.fillers else record


def _step_record(step) -> dict:
    if step.slots is not None:
        return {
            "slots": [
                {"groups": [{"ranks": list(g.ranks), **_micro_batch_record(g)} for g in slot.groups]}
                for slot in step.slots
            ]
        }
    return {"replicas": [{"micro_batches": [_micro_batch_record(mb) for mb in r.micro_batches]} for r in step.replicas]}


def header(plan: Plan) -> dict:
    seconds = plan.plan_seconds
    version = PLAN_FORMAT.header()
    short = plan.last_micro_batches < plan.topology.micro_batches
    # the oldest version whose keys the plan uses: older readers load it
    if not short and not plan.filler_rows:
        version["format_version"] = SPEEDS_VERSION if plan.topology.rank_speeds is not None else SPEEDS_VERSION - 1
    return {
        **version,
        "topology": plan.topology.to_dict(),
        "cost_model": plan.cost_model.to_dict(),
        "num_docs": plan.num_docs,
        "seed": plan.seed,
        "plan_seconds": None if seconds is None or not math.isfinite(seconds) else seconds,
        "dropped_tokens": plan.dropped_tokens,
        "window": None if plan.window is None else dataclasses.asdict(plan.window),
        **({} if plan.layout is None else {"layout": plan.layout}),
        **({"last_micro_batches": plan.last_micro_batches} if short else {}),
        **({"filler_rows": plan.filler_rows} if plan.filler_rows else {}),
    }


def plan_to_dict(plan: Plan) -> dict:
    head = header(plan)
    keys: tuple[str, ...] = (
        "format",
        "format_version",
        "topology",
        "cost_model",
        "num_docs",
        "seed",
        "window",
        "layout",
    )
    keys += ("last_micro_batches", "filler_rows")
    data = {k: head[k] for k in keys if k in head}
    data["lengths"] = plan.lengths.tolist()
    data["steps"] = [_step_record(st) for st in plan.steps]
    return data


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
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
        if plan.filler is not None:
            arrays["filler"] = plan.filler.astype(np.int64)
        atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    else:
        data = plan_to_dict(plan)
        data.update({k: v for k, v in header(plan).items() if k not in data})
        if plan.natural_step is not None:
            data["natural_step"] = plan.natural_step.tolist()
        atomic_write(path, lambda f: f.write(json.dumps(data, separators=(",", ":"), allow_nan=False).encode()))


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


def _parse_header(path, head, schema) -> tuple[Topology, CostModel]:
    """Check the header's keys strictly (a JSON plan's top level, or an .npz plan's `header`) and build the
    topology and cost model."""
    name = str(path)
    if isinstance(head, dict) and isinstance(head.get("plan_seconds"), float) and math.isnan(head["plan_seconds"]):
        head = {**head, "plan_seconds": None}  # version 1 wrote NaN for "not timed"
    version = check_format(head, name, PLAN_FORMAT)
    check(head, schema, name, version=version)
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


def load_plan(cls: type[Plan], path: str | os.PathLike, lengths: ArrayLike | None, validate: bool) -> Plan:
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
        message = str(e)
        raise PlanFileError(message if message.startswith(f"{path}:") else f"{path}: not a valid plan: {e}") from None
    return plan


def _read_npz(path: Path) -> dict:
    """Every array of the archive; a damaged or foreign file is a PlanFileError (opening it is an OSError)."""
    with open(path, "rb") as f:
        try:
            with np.load(f, allow_pickle=False) as z:
                unknown = sorted(set(z.files) - set(NPZ_ARRAYS))
                if unknown:
                    raise PlanFileError(f"{path}: plan .npz holds an unknown array {unknown[0]!r}")
                return {k: z[k] for k in z.files}
        except (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError) as e:
            if isinstance(e, PlanFileError):
                raise
            raise PlanFileError(f"{path}: not a readable plan .npz file ({type(e).__name__}: {e})") from None


def _load_npz(cls, path: Path, lengths):
    arrays = _read_npz(path)
    for key in ("header", "doc", "start", "end", "mb_ptr"):
        if key not in arrays:
            raise PlanFileError(f"{path}: plan .npz has no '{key}' array")
    if arrays["header"].dtype != np.uint8 or arrays["header"].ndim != 1:
        raise PlanFileError(f"{path}: field 'header' must be JSON bytes (uint8), got {arrays['header'].dtype}")
    head = parse_json(arrays.pop("header").tobytes(), f"{path}[header]", allow_nan=True)
    topology, cost = _parse_header(path, head, obj(HEADER_KEYS))
    lengths = _check_lengths(path, arrays.get("lengths"), lengths)
    doc, start, end = (_int_array(path, k, arrays[k]) for k in ("doc", "start", "end"))
    mb_ptr = _int_array(path, "mb_ptr", arrays["mb_ptr"])
    groups = None
    group_keys = ("group_start", "group_size", "slot_ptr")
    if topology.dynamic:
        missing = [k for k in group_keys if k not in arrays]
        if missing:
            raise PlanFileError(f"{path}: dynamic-CP plan .npz has no '{missing[0]}' array")
        groups = tuple(_int_array(path, k, arrays[k]) for k in group_keys)
    elif any(k in arrays for k in group_keys):
        raise PlanFileError(f"{path}: a static-CP plan (no cp_sizes) holds dynamic-CP group arrays")
    natural = _int_array(path, "natural_step", arrays["natural_step"]) if "natural_step" in arrays else None
    filler = _int_array(path, "filler", arrays["filler"]) if "filler" in arrays else None
    if filler is not None and (len(filler) != len(doc) or filler.max(initial=0) > 1):
        raise PlanFileError(f"{path}: field 'filler' must hold one 0/1 per placement ({len(doc)})")
    flat = (doc, start, end, mb_ptr, None if filler is None else filler.astype(bool))
    return _build(cls, path, head, lengths, topology, cost, flat, groups, natural)


def _load_json(cls, path: Path, lengths):
    data = load_json(path, allow_nan=True)
    if not isinstance(data, dict):
        raise PlanFileError(f"{path}: not a plan JSON file (the top level is not an object)")
    for key in ("topology", "cost_model", "steps"):
        if key not in data:
            raise PlanFileError(f"{path}: plan JSON has no '{key}'")
    topology, cost = _parse_header(path, data, JSON_PLAN)
    lengths = _check_lengths(path, data.get("lengths"), lengths)
    last = _last_micro_batches(path, data, topology)
    flat, groups = _json_steps(path, data["steps"], lengths, topology, last)
    natural = data.get("natural_step")
    natural = None if natural is None else _int_array(path, "natural_step", natural)
    return _build(cls, path, data, lengths, topology, cost, flat, groups, natural)


def _json_micro_batch(path, where: str, mb, lengths, out, extra: tuple = ()) -> None:
    doc, start, end, filler = out
    if not isinstance(mb, dict) or not isinstance(mb.get("docs"), list):
        raise PlanFileError(f"{path}: {where} must be an object with a 'docs' list")
    _no_unknown_keys(path, where, mb, ("docs", "spans", "fillers", *extra))
    for d in mb["docs"]:
        d = _int(path, f"{where}.docs", d)
        if not 0 <= d < len(lengths):
            raise PlanFileError(f"{path}: {where}.docs holds document {d}, outside 0..{len(lengths) - 1}")
        doc.append(d), start.append(0), end.append(int(lengths[d])), filler.append(False)
    spans = mb.get("spans", [])
    if not isinstance(spans, list):
        raise PlanFileError(f"{path}: {where}.spans must be a list of [doc, start, end]")
    for span in spans:
        if not isinstance(span, list) or len(span) != 3:
            raise PlanFileError(f"{path}: {where}.spans holds {span!r}, not [doc, start, end]")
        d, a, b = (_int(path, f"{where}.spans", x) for x in span)
        if not 0 <= d < len(lengths):
            raise PlanFileError(f"{path}: {where}.spans holds document {d}, outside 0..{len(lengths) - 1}")
        doc.append(d), start.append(a), end.append(b), filler.append(False)
    fillers = mb.get("fillers", [])
    if not isinstance(fillers, list):
        raise PlanFileError(f"{path}: {where}.fillers must be a list of row ids")
    for d in fillers:
        d = _int(path, f"{where}.fillers", d)
        if not 0 <= d < len(lengths):
            raise PlanFileError(f"{path}: {where}.fillers holds row {d}, outside 0..{len(lengths) - 1}")
        doc.append(d), start.append(0), end.append(int(lengths[d])), filler.append(True)


def _no_unknown_keys(path, where: str, record: dict, known: tuple) -> None:
    for key in record:
        if key not in known:
            raise PlanFileError(
                f"{path}: {where}.{key}: unknown key (a {where.rsplit('.', 1)[-1].split('[')[0]} "
                f"holds {', '.join(known)})"
            )


def _json_list(path, where: str, value, key: str, count: int, unit: str) -> list:
    """`value[key]`: a list of exactly `count` entries (the topology's nesting), else a PlanFileError."""
    if not isinstance(value, dict) or not isinstance(value.get(key), list):
        raise PlanFileError(f"{path}: {where} must be an object with a '{key}' list")
    _no_unknown_keys(path, where, value, (key,))
    if len(value[key]) != count:
        raise PlanFileError(
            f"{path}: {where}.{key} has {len(value[key])} entries, but the topology has {unit} = {count}"
        )
    return value[key]


def _json_groups(path, where: str, slot, lengths, flat, ptr, groups) -> None:
    group_start, group_size, slot_ptr = groups
    if not isinstance(slot, dict) or not isinstance(slot.get("groups"), list) or not slot["groups"]:
        raise PlanFileError(f"{path}: {where} must be an object with a non-empty 'groups' list")
    _no_unknown_keys(path, where, slot, ("groups",))
    for g, grp in enumerate(slot["groups"]):
        at = f"{where}.groups[{g}]"
        ranks = grp.get("ranks") if isinstance(grp, dict) else None
        if not isinstance(ranks, list) or len(ranks) != 2:
            raise PlanFileError(f"{path}: {at}.ranks must be [start, size]")
        group_start.append(_int(path, f"{at}.ranks", ranks[0]))
        group_size.append(_int(path, f"{at}.ranks", ranks[1]))
        _json_micro_batch(path, at, grp, lengths, flat, ("ranks",))
        ptr.append(len(flat[0]))
    slot_ptr.append(len(group_start))


def _last_micro_batches(path, head: dict, topology: Topology) -> int:
    """The header's `last_micro_batches` (M' of a short last step), checked against the topology; M if absent."""
    last = head.get("last_micro_batches", topology.micro_batches)
    if last > topology.micro_batches:
        raise PlanFileError(
            f"{path}: field 'last_micro_batches' = {last} exceeds the topology's micro_batches = "
            f"{topology.micro_batches}"
        )
    return last


def _json_steps(path, steps, lengths, topology: Topology, last: int):
    """The flat arrays of the nested `steps`, whose nesting must match the topology: `dp` replicas of
    `micro_batches` micro-batches per step (dynamic: `micro_batches` slots), the last step `last` of them;
    nothing is re-sliced."""
    if not isinstance(steps, list):
        raise PlanFileError(f"{path}: field 'steps' must be a list")
    flat: tuple[list[int], list[int], list[int], list[bool]] = ([], [], [], [])
    ptr = [0]
    groups: tuple[list[int], list[int], list[int]] = ([], [], [0])
    for s, st in enumerate(steps):
        m = last if s == len(steps) - 1 else topology.micro_batches
        if topology.dynamic:
            for k, slot in enumerate(_json_list(path, f"steps[{s}]", st, "slots", m, "micro_batches")):
                _json_groups(path, f"steps[{s}].slots[{k}]", slot, lengths, flat, ptr, groups)
        else:
            for r, rep in enumerate(_json_list(path, f"steps[{s}]", st, "replicas", topology.dp, "dp")):
                where = f"steps[{s}].replicas[{r}]"
                for i, mb in enumerate(_json_list(path, where, rep, "micro_batches", m, "micro_batches")):
                    _json_micro_batch(path, f"{where}.micro_batches[{i}]", mb, lengths, flat)
                    ptr.append(len(flat[0]))
    arrays: tuple[np.ndarray | None, ...] = tuple(np.asarray(a, dtype=np.int64) for a in flat[:3])
    arrays += (np.asarray(ptr, dtype=np.int64),)
    arrays += (np.asarray(flat[3], dtype=bool) if any(flat[3]) else None,)
    if not topology.dynamic:
        return arrays, None
    return arrays, tuple(np.asarray(a, dtype=np.int64) for a in groups)


def _build(cls, path, head, lengths, topology, cost, flat, groups, natural):
    doc, start, end, mb_ptr, filler = flat
    count = 0 if filler is None else int(filler.sum())
    if head.get("filler_rows", 0) != count:
        raise PlanFileError(f"{path}: field 'filler_rows' = {head.get('filler_rows', 0)} but the plan holds {count}")
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
    seed, dropped = head.get("seed"), head.get("dropped_tokens")  # types and ranges checked with the header
    window = _window(path, head.get("window"), len(lengths))
    plan_seconds = head.get("plan_seconds")
    plan_seconds = float("nan") if plan_seconds is None else plan_seconds
    try:
        return cls(
            lengths, topology, cost, doc, start, end, mb_ptr, seed=seed, natural_step=natural,
            plan_seconds=float(plan_seconds), dropped_tokens=dropped, groups=groups, window=window,
            layout=head.get("layout"), last_micro_batches=_last_micro_batches(path, head, topology), filler=filler,
        )  # fmt: skip
    except ValueError as e:
        raise PlanFileError(f"{path}: {e}") from None


def _window(path, record: dict | None, num_docs: int) -> WindowInfo | None:
    """The window a window plan places (its record's counts must agree with the epoch it names)."""
    if record is None:
        return None
    window = WindowInfo(**record)
    try:
        expected = (
            num_windows(num_docs, window.window_docs),
            *window_range(num_docs, window.window_docs, window.index),
        )
    except ValueError as e:
        raise PlanFileError(f"{path}: field 'window': {e}") from None
    if (window.num_windows, window.first, window.stop) != expected:
        raise PlanFileError(
            f"{path}: field 'window' says window {window.index} of {window.num_windows} holds shuffle positions "
            f"[{window.first}, {window.stop}), but {num_docs} documents in windows of {window.window_docs} make "
            f"window {window.index} of {expected[0]} at [{expected[1]}, {expected[2]})"
        )
    return window
