"""A monitor state saved on another number of replicas (an elastic restart onto another DP size): the replicas it
measured are not this run's (rank r of the new world is not rank r of the old one), so the per-replica records are
left behind: the measured steps and the refit's evidence, the fitted replica speeds and a fit not applied yet. The
fitted cost models are kept (a micro-batch's cost does not depend on which replica runs it), each planned from its
window on with even speeds; the first model is this run's own (the source's cost and the topology's speeds)."""

from __future__ import annotations

from typing import Optional


def saved_units(state: dict) -> Optional[int]:
    """The number of replicas (timed units) a monitor state was saved with: its `units`, or for a state saved
    before that was recorded the width of its measured steps; None when it cannot tell (no step measured)."""
    if "units" in state:
        units = state["units"]
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValueError(f'monitor state: "units" must be a positive integer (replicas), got {units!r}')
        return units
    steps = state.get("ledger", {}).get("steps", [])
    widths = {len(s["measured"]) if isinstance(s, dict) and isinstance(s.get("measured"), list) else 0 for s in steps}
    if 0 in widths or len(widths) > 1:
        raise ValueError("monitor state: a malformed record (its measured steps are not one time per replica each)")
    return widths.pop() if widths else None


def without_replicas(state: dict, own: dict) -> dict:
    """`state` (a monitor's `state_dict()`) with its per-replica records left out (module docstring); `own`: this
    monitor's first model (`Model.to_dict()`)."""
    fitted = [{**m, "speeds": None, "plan_speeds": None, "fresh_from": 0} for m in state["models"][1:]]
    ledger = {"steps": [], "mb": [], "samples": [], "dropped": 0}
    return {**state, "models": [own, *fitted], "pending_fit": None, "ledger": ledger}
