"""benchmarks/_common.write_result names the commit the benchmark started at (HEAD when the script imported it)
and, where commits landed while it ran, the one at its end too, beside the machine's load at start and end."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
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


def test_the_record_names_the_cpu_model_where_the_kernel_does(common):
    record = json.loads(common.write_result("probe", {}, clock="none").read_text())
    cpuinfo = Path("/proc/cpuinfo")
    named = cpuinfo.exists() and any(line.startswith("model name") for line in cpuinfo.read_text().splitlines())
    assert (record["machine"]["cpu_model"] is not None) == named
    if named:
        assert record["machine"]["cpu_model"] in cpuinfo.read_text()


def test_records_written_by_earlier_benchmarks_leave_the_tree_clean(tmp_path, monkeypatch):
    """A checkout whose only changes are records under benchmarks/results/ is clean; any other change is not."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(BENCHMARKS / "_common.py", tmp_path / "benchmarks" / "_common.py")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.syspath_prepend(str(tmp_path / "benchmarks"))
    monkeypatch.delitem(sys.modules, "_common", raising=False)
    copy = importlib.import_module("_common")
    assert Path(copy.__file__).resolve().parent == (tmp_path / "benchmarks").resolve()
    (tmp_path / "benchmarks" / "results" / "earlier.json").write_text("{}")
    assert copy.git_commit()["dirty"] is False
    (tmp_path / "benchmarks" / "tool.py").write_text("")
    assert copy.git_commit()["dirty"] is True
