#!/usr/bin/env bash
# Set up .venv with the test extras (tools/setup.sh), lint (ruff check + format check), type-check (mypy), run the
# whole test suite (progress per file). --quick (first argument): only the tests not marked slow (-m "not slow").
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the packages and settings: pyproject.toml [tool.mypy]
quick=()
if [[ "${1:-}" == "--quick" ]]; then
    shift
    quick=(-m "not slow")
fi
exec .venv/bin/python -m pytest ${quick[@]+"${quick[@]}"} "$@"
