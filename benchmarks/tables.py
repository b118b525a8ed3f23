"""Render the benchmark tables into docs/*.md: a renderer only, knowing no benchmark.

Every figure table in docs/ sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` and is written from
the records alone (a table may appear on several pages). NAME is either a table a benchmark script declares (its
module-level ``TABLES = {NAME: function}``, each function reading that benchmark's record, benchmarks/_render.py's
helpers shared), or ``RESULT.KEY``, a table a benchmark wrote into its own record (``tables[KEY]`` of
``results/RESULT.json``, written with ``_common.table(columns, rows)``), followed by the record's measuring line.
``python benchmarks/tables.py`` rewrites the pages; ``--check`` exits 1 if one is out of date (the test suite runs
it), so no figure is pasted by hand.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _render import LOADED, RESULTS, ROOT, commit_and_load, fmt, load, markdown, record_line  # noqa: E402

DOCS = ROOT / "docs"


def unnamed_records() -> list[str]:
    """The records read so far (history references NAME@REV included) that name no commit or no machine load at
    start, each with what it lacks: `main` refuses to render while there is one, so every table states both."""
    bad = []
    for name, record in LOADED.items():
        commit, start_load = commit_and_load(record)
        if commit is None or start_load is None:
            bad.append(f"{name} (no {'commit' if commit is None else 'load at start'})")
    return bad


def unnamed_files() -> list[str]:
    """The records in results/ (each JSON file that names the command which wrote it; a fitted cost model is none)
    that name no commit or no machine load at start, whether or not a table reads them through `load` (a table that
    reads its file itself is held to the same rule)."""
    bad = []
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "command" not in record:
            continue
        commit, start_load = commit_and_load(record)
        if commit is None or start_load is None:
            bad.append(f"{path.name} (no {'commit' if commit is None else 'load at start'})")
    return bad


def declared_tables() -> dict[str, Callable[[], str]]:
    """Every table the benchmark scripts declare ({marker name: function}), from each script that assigns a
    module-level TABLES; a name declared twice is an error naming both scripts."""
    tables: dict[str, Callable[[], str]] = {}
    owner: dict[str, str] = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_") or path.name == "tables.py":
            continue
        if not re.search(r"^TABLES\b", path.read_text(), re.M):
            continue
        for name, build in importlib.import_module(path.stem).TABLES.items():
            if name in tables:
                raise SystemExit(f"table {name!r} is declared by both {owner[name]} and {path.name}")
            tables[name], owner[name] = build, path.name
    return tables


MARKER = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def stated_table(name: str) -> str | None:
    """The table `RESULT.KEY` a benchmark wrote into its own record, with the record's measuring line; None when
    the record states no such table."""
    result, _, key = name.partition(".")
    if not key or not (RESULTS / f"{result}.json").exists():
        return None
    data = load(result)
    spec = data.get("tables", {}).get(key)
    if spec is None:
        return None
    rows = [[fmt(cell) if not isinstance(cell, str) else cell for cell in row] for row in spec["rows"]]
    commit = (data.get("git") or {}).get("commit")
    line = record_line(data)[:-1] + (f"; commit {commit[:10]}." if commit else ".")
    return markdown(spec["columns"], rows) + line


def render(page: str, path: Path, tables: dict[str, Callable[[], str]]) -> str:
    """The page with every marked table regenerated; unknown table names are an error."""

    def replace(match: re.Match) -> str:
        name = match.group("name")
        body = tables[name]() if name in tables else stated_table(name)
        if body is None:
            raise SystemExit(f"{path}: unknown table {name!r}; known: {', '.join(sorted(tables))} or RESULT.KEY")
        return match.group(1) + body + "\n" + match.group(4)

    return MARKER.sub(replace, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page of docs/ is out of date")
    args = parser.parse_args(argv)
    tables = declared_tables()
    placed, changed = set(), {}
    for path in sorted(DOCS.glob("*.md")):
        page = path.read_text()
        placed |= {match.group("name") for match in MARKER.finditer(page)}
        fresh = render(page, path, tables)
        if fresh != page:
            changed[path] = fresh
    bad = (
        unnamed_records() + unnamed_files()
    )  # before writing anything: no page shows a figure whose record lacks either
    if bad:
        raise SystemExit(f"records without their commit or load at start: {', '.join(bad)}")
    stale = list(changed) if args.check else []
    for path, fresh in ({} if args.check else changed).items():
        path.write_text(fresh)
        print(f"wrote {path}")
    missing = sorted(set(tables) - placed)
    if missing:
        raise SystemExit(f"no page of {DOCS} shows the tables {', '.join(missing)}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python benchmarks/tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
