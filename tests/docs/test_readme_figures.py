"""README.md's figure paragraphs are written from the benchmark records (benchmarks/readme_figures.py): they are up
to date, each names its record's commit, clock and load, and every record they read is re-measured by the one
command that re-measures the README's figures."""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def figures(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("readme_figures")


def test_readme_figures_are_up_to_date():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "readme_figures.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr


def test_every_record_a_figure_reads_is_re_measured_by_the_command(figures):
    for name, (records, _) in figures.TEXTS.items():
        assert set(records) <= set(figures.FIGURES), f"{name}: {set(records) - set(figures.FIGURES)} not in FIGURES"
    readme = (ROOT / "README.md").read_text()
    assert {m.group("name") for m in figures.MARKER.finditer(readme)} == set(figures.TEXTS)


def test_each_figure_states_its_conditions_from_the_record(figures):
    for name, (records, build) in figures.TEXTS.items():
        text = build()
        for record in records:
            data = figures.load(record)
            assert f"`{data['command'].split()[1]}`" in text, (name, record)
            assert data["git"]["commit"][:7] in text, (name, record)
            assert f"load {data['machine']['load_average_start'][0]:g} at start" in text, (name, record)


def test_a_changed_record_changes_the_paragraph(figures, monkeypatch):
    real = figures.load
    replay = copy.deepcopy(real("replay"))
    pair = replay["runs"]["dp2"]["pairs"]["balancer vs trl-bfd"]
    pair["wall"] = {"median": 3.0, "min": 2.5, "max": 3.5, "reps": 7, "verdict": "balancer faster"}
    replay["git"] = {"commit": "abcdef0123456789", "dirty": False}
    monkeypatch.setattr(figures, "load", lambda name: replay if name == "replay" else real(name))
    text = figures.figure_replay()
    assert "by wall clock 3.00x (2.50-3.50x, faster in all 7 repetitions)" in text
    assert "at abcdef0," in text and "uncommitted" not in text


def test_a_record_of_another_layout_is_one_error_naming_the_figure(figures, monkeypatch):
    real = figures.load
    monkeypatch.setattr(figures, "load", lambda name: {"rows": []} if name == "planner_speed" else real(name))
    with pytest.raises(SystemExit, match="README figure 'planner'.*planner_speed"):
        figures.paragraph("planner")
