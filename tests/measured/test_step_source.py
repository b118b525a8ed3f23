"""The monitor's step sources: each one is a `balancer.measured.StepSource`, and balancer/measured/ reads no private
attribute of another object (its sources included): an ast check of every module, and a check that it sees one."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import balancer
from balancer.measured import BalanceMonitor, BatchSteps, StepPlace, StepSource, StreamSteps
from balancer.measured.source import STEP_SOURCE_MEMBERS
from balancer.streaming import BalancedStream

MEASURED = Path(__file__).resolve().parents[2] / "balancer" / "measured"
TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
COST = balancer.CostModel(1.0, 50.0)
LENGTHS = np.random.default_rng(0).integers(50, 1500, size=240)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(source: str, path: str = "<string>") -> list[str]:
    """Every read of a private attribute of an object other than `self` / `cls` (`x._a`, `self.x._a`,
    `getattr(x, "_a")`) in `source`, as "path:line: expression"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_measured_reads_no_private_attribute_of_another_object():
    found = []
    for path in sorted(MEASURED.glob("*.py")):
        found += private_reads(path.read_text(), path.name)
    assert not found, "\n".join(found)


def test_the_check_sees_private_reads():
    source = (
        "class A:\n"
        "    def f(self, s):\n"
        "        self._ok = s.public\n"
        "        return s._windows, self.sampler._cursor, getattr(s, '_setup'), self._ok, s.__class__\n"
    )
    assert private_reads(source) == [
        "<string>:4: s._windows",
        "<string>:4: self.sampler._cursor",
        "<string>:4: getattr(s, '_setup')",
    ]


def test_the_members_list_is_the_protocol():
    declared = {n for n in vars(StepSource) if not n.startswith("_")} | set(StepSource.__annotations__)
    assert declared == set(STEP_SOURCE_MEMBERS)


def _rows(n: int) -> list[dict]:
    return [{"input_ids": list(range(int(d)))} for d in LENGTHS[:n]]


@pytest.fixture
def sources():
    sampler = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, window_docs=60)
    stream = BalancedStream(_rows(240), TOPO, COST, window_docs=60)
    return {"sampler": sampler, "batches": BatchSteps(TOPO, COST, dp_rank=0), "stream": StreamSteps(stream)}


@pytest.mark.parametrize("kind", ["sampler", "batches", "stream"])
def test_every_source_is_a_step_source(sources, kind):
    source = sources[kind]
    assert isinstance(source, StepSource)
    monitor = BalanceMonitor(source, mode="adapt", cuda=False)
    assert source.monitor is monitor and source.epoch == 0 and source.position == 0
    assert source.plan_start(0, 1) == (0, 1)


def test_a_non_source_is_refused_naming_what_it_lacks():
    assert not isinstance(object(), StepSource)
    with pytest.raises(TypeError, match="is not a StepSource.*step_place"):
        BalanceMonitor(object(), cuda=False)


def test_step_place_agrees_with_the_sampler_s_windows():
    s = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, window_docs=60)
    step = 0
    for w in range(s.num_windows):
        n = s.windows.steps(w)
        for local in range(n):
            place = s.step_place(step)
            assert place == StepPlace(w, local == n - 1, s.step_micro_batches(step))
            step += 1
    assert step == s.num_steps
    with pytest.raises(IndexError):
        s.step_place(step)


def test_the_sampler_s_plan_start_wraps_into_the_next_epoch():
    s = balancer.BalancedBatchSampler(LENGTHS, TOPO, COST, dp_rank=0, window_docs=60)
    count = s.num_windows
    assert s.plan_start(0, count - 1) == (0, count - 1)
    assert s.plan_start(0, count + 1) == (1, 1)
    s.set_epoch(2)
    assert s.plan_start(1, 0) == (3, 0)  # an epoch it left: from the next one


def source_reads(source: str) -> set[str]:
    """The attributes read of the monitor's source in `source`: of `self.sampler`, and of the names `sampler` and
    `s` (the constructor's argument, the local alias)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ("sampler", "s")) or (
            isinstance(v, ast.Attribute) and v.attr == "sampler" and isinstance(v.value, ast.Name)
        ):
            found.add(node.attr)
    return found


def test_the_monitor_uses_nothing_of_its_source_but_the_protocol():
    used = source_reads((MEASURED / "monitor.py").read_text())
    assert used and used <= set(STEP_SOURCE_MEMBERS), sorted(used - set(STEP_SOURCE_MEMBERS))
    assert source_reads("def f(self):\n    return self.sampler.windows.count\n") == {"windows"}
