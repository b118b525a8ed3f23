"""The docs hold what they promise: a short README that starts with the two commands, links that resolve,
benchmark tables generated from the results, and a quick start that runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("tools/setup.sh && .venv/bin/balancer demo")
    assert first_block[1].startswith("tools/test.sh")
    assert first_block[2].startswith("tools/test.sh --quick")  # the quick subset, right beside the full command
    assert "bash tools/test.sh" in (REPO / ".ci" / "run").read_text()


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_docs_index_lists_every_page():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"pages not linked from the README: {missing}"


def test_no_outside_design_file_is_cited():
    offenders = []
    for path in [*PAGES, *REPO.glob("balancer/**/*.py"), *REPO.glob("attention/**/*.py"), *REPO.glob("*/*.py")]:
        if "DESIGN" + ".md" in path.read_text():
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def test_benchmark_tables_are_generated_from_results():
    run = subprocess.run([sys.executable, "benchmarks/tables.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_readme_quick_start_runs(tmp_path):
    """As written, in a scratch folder (it saves plan.json where it runs, never in the repository)."""
    text = (REPO / "README.md").read_text()
    code = text.split("## Quick start (Python)", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "epoch_efficiency" in run.stdout
