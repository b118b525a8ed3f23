"""Test-suite settings.

- Under CI (CI set in the environment) hypothesis draws a fixed sequence of examples, so a submission is judged on
  the same cases every run; locally it explores new random cases each run.
- No test writes into the repository: the git working tree (tracked changes and untracked files, ignored ones
  included except caches and environments) is compared before and after the session; a test that leaves a file
  behind fails the run naming it. Tests write under pytest's `tmp_path`.
- Slow tests (multi-process, Ray, Trainer, kill -9 runs, anything over a few seconds) carry `@pytest.mark.slow`;
  `tools/test.sh --quick` runs the others (`-m "not slow"`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
CACHES = ("__pycache__/", ".pytest_cache/", ".hypothesis/", ".venv/", ".egg-info/", ".ruff_cache/")

# no per-example deadline: a busy 2-core machine can make any example slow, and a timing failure is not a defect
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("dev")
if os.environ.get("CI"):
    settings.load_profile("ci")


def working_tree() -> set[str] | None:
    """`git status` lines of the repository (ignored files too, caches and environments left out); None outside a
    git checkout."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {line for line in done.stdout.splitlines() if not any(cache in line for cache in CACHES)}


@pytest.fixture(scope="session", autouse=True)
def repository_unchanged():
    before = working_tree()
    yield
    after = working_tree()
    if before is not None and after is not None:
        new = sorted(after - before)
        assert not new, f"the tests left files in the repository (write under tmp_path instead): {new}"
