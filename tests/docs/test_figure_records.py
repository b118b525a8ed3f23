"""Records without their commit or machine load are refused before anything is written, by benchmarks/tables.py
(the docs tables) and by benchmarks/readme_figures.py (README.md's figures), and README.md's Results section quotes
no figure outside the generated paragraphs."""

from __future__ import annotations

import copy
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:x\b|%| s\b| ms\b| min\b)")  # a speedup, share or time quoted in prose
NAMED = {"git": {"commit": "abc1234def"}, "machine": {"load_average_start": [0.5, 0.5, 0.5]}}


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """benchmarks/tables.py rendering one page of tmp_path with one table whose function reads the record that
    `tables.record` holds (a real page file, the real main())."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("tables")
    render = sys.modules["_render"]
    monkeypatch.setattr(render, "LOADED", {})
    monkeypatch.setattr(module, "LOADED", render.LOADED)
    monkeypatch.setattr(module, "DOCS", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- table:t -->\nold\n<!-- /table:t -->\nafter\n")
    holder = {"record": NAMED}

    def table() -> str:
        render.LOADED["fake"] = holder["record"]
        return "| fresh |"

    monkeypatch.setattr(module, "declared_tables", lambda: {"t": table})
    module.page, module.holder = page, holder
    return module


@pytest.mark.parametrize(
    ("record", "lack"),
    [
        ({"machine": {"load_average_start": [1.0, 1.0, 1.0]}}, "fake (no commit)"),
        ({"git": {"commit": "abc"}, "machine": {}}, "fake (no load at start)"),
        ({"git": {"commit": None}, "machine": {"load_average_start": [1.0, 1.0, 1.0]}}, "fake (no commit)"),
    ],
)
def test_tables_refuse_a_record_without_commit_or_load_and_write_nothing(tables, record, lack):
    tables.holder["record"] = record
    for argv in (["--check"], []):
        with pytest.raises(SystemExit, match=re.escape(lack)):
            tables.main(argv)
        assert "old" in tables.page.read_text()  # nothing written


def test_tables_render_a_record_that_names_both(tables):
    assert tables.main(["--check"]) == 1  # out of date, nothing refused
    assert tables.main([]) == 0 and "| fresh |" in tables.page.read_text()
    assert tables.main(["--check"]) == 0


def test_a_history_record_is_judged_by_itself(tables):
    tables.LOADED["name@abc1234"] = {"machine": {"load_average_start": [1.0, 1.0, 1.0]}}
    tables.LOADED["name"] = dict(NAMED)
    assert tables.unnamed_records() == ["name@abc1234 (no commit)"]


@pytest.fixture
def figures(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("readme_figures")


@pytest.mark.parametrize("name", ["compare", "trainer", "peers", "measured_balance", "calibration", "balance_batch"])
def test_readme_figures_refuse_a_record_without_commit(figures, monkeypatch, name):
    real = figures.load
    record = figures.TEXTS[name][0][-1]
    stripped = copy.deepcopy(real(record))
    stripped.pop("git", None)
    stripped.pop("commit", None)
    monkeypatch.setattr(figures, "load", lambda n: stripped if n == record else real(n))
    with pytest.raises(SystemExit, match=rf"README figure {name!r}.*{record} \(no commit\)"):
        figures.paragraph(name)


def test_readme_figures_refuse_a_record_without_load(figures, monkeypatch):
    real = figures.load
    stripped = copy.deepcopy(real("balance_batch_speed"))
    stripped["machine"].pop("load_average_start")
    monkeypatch.setattr(figures, "load", lambda n: stripped if n == "balance_batch_speed" else real(n))
    with pytest.raises(SystemExit, match=r"balance_batch_speed \(no load at start\)"):
        figures.render_readme(check=True)


def test_readme_quotes_no_figure_outside_the_generated_paragraphs(figures):
    readme = (ROOT / "README.md").read_text()
    outside = figures.MARKER.sub("", readme)
    quoted = FIGURE.findall(outside)
    assert quoted == [], f"README.md quotes {quoted} outside the generated figures"
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert len(list(figures.MARKER.finditer(results))) == len(figures.TEXTS)  # every generated paragraph in Results


def test_the_figure_guard_sees_a_hand_typed_figure(figures):
    page = "<!-- figure:a -->\n- 1.5x faster\n<!-- /figure:a -->\n- and 12% less by hand\n"
    assert FIGURE.findall(figures.MARKER.sub("", page)) == ["12%"]


def test_a_changed_measured_record_changes_its_figure(figures, monkeypatch):
    real = figures.load
    data = copy.deepcopy(real("measured_balance_interleaved"))
    uneven = next(c for c in data["configs"] if c["config"] == "uneven")
    uneven["speedup_median"], uneven["speedup_min"] = 1.777, 1.666
    monkeypatch.setattr(figures, "load", lambda n: data if n == "measured_balance_interleaved" else real(n))
    text = figures.figure_measured_balance()
    assert "1.78x faster than the static plan" in text and "every pair at least 1.67x" in text


def test_the_command_re_measures_exactly_the_records_the_readme_reads(figures):
    read = {record for records, _ in figures.TEXTS.values() for record in records}
    assert read == set(figures.FIGURES)


def test_tables_refuse_a_results_file_no_table_loads_through_load(tables, tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(tables, "RESULTS", results)
    (results / "cost.json").write_text('{"attn_coef": 1e-9}')  # a fitted cost model: no record
    (results / "good.json").write_text(json.dumps({"command": "python x.py", **NAMED}))
    assert tables.unnamed_files() == []
    (results / "read_by_hand.json").write_text(json.dumps({"command": "python y.py", "machine": NAMED["machine"]}))
    assert tables.unnamed_files() == ["read_by_hand.json (no commit)"]
    with pytest.raises(SystemExit, match=re.escape("read_by_hand.json (no commit)")):
        tables.main(["--check"])
    assert "old" in tables.page.read_text()
