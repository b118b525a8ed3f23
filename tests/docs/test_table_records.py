"""benchmarks/tables.py renders only records that name their commit and the machine's load at start (no exemption:
tests/docs/test_figure_records.py runs its main() on such a record), and every benchmark declares its own tables."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def tables(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("tables")
    render = sys.modules["_render"]
    monkeypatch.setattr(render, "LOADED", {})
    monkeypatch.setattr(module, "LOADED", render.LOADED)
    return module


def test_a_record_without_commit_or_load_is_refused(tables):
    tables.LOADED["new_benchmark"] = {"machine": {"load_average_start": [1.0, 1.0, 1.0]}}
    tables.LOADED["other"] = {"git": {"commit": "abc"}, "machine": {}}
    tables.LOADED["fine"] = {"git": {"commit": "abc"}, "machine": {"load_average_start": [0.5, 0.5, 0.5]}}
    assert tables.unnamed_records() == ["new_benchmark (no commit)", "other (no load at start)"]


def test_every_declared_table_renders_from_its_record(tables):
    declared = tables.declared_tables()
    assert {"planner_quality", "planner_speed", "measured_balance_interleaved_e524781"} <= set(declared)
    text = declared["measured_balance_interleaved_e524781"]()  # a record read from git history (NAME@REV)
    assert "measured_balance_interleaved@c02ed41" in tables.LOADED and text.startswith("| ranks |")
