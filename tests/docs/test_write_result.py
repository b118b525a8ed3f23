"""benchmarks/_common.write_result names the commit the benchmark started at (HEAD when the script imported it)
and, where commits landed while it ran, the one at its end too, beside the machine's load at start and end."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def common(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("_common")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


def test_the_record_names_the_commit_at_start(common, monkeypatch):
    monkeypatch.setattr(common, "COMMIT_AT_START", {"commit": "a" * 40, "dirty": False})
    monkeypatch.setattr(common, "git_commit", lambda: {"commit": "a" * 40, "dirty": False})
    record = json.loads(common.write_result("probe", {"x": 1}, clock="none").read_text())
    assert record["git"] == {"commit": "a" * 40, "dirty": False} and "git_at_end" not in record
    assert len(record["machine"]["load_average_start"]) == 3 and record["x"] == 1


def test_a_commit_landing_during_the_run_is_named_beside_it(common, monkeypatch):
    monkeypatch.setattr(common, "COMMIT_AT_START", {"commit": "a" * 40, "dirty": True})
    monkeypatch.setattr(common, "git_commit", lambda: {"commit": "b" * 40, "dirty": True})
    record = json.loads(common.write_result("probe", {}, clock="none").read_text())
    assert record["git"]["commit"] == "a" * 40 and record["git_at_end"]["commit"] == "b" * 40
