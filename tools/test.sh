#!/usr/bin/env bash
# Set up .venv with the test extras (tools/setup.sh), lint (ruff check + format check), run the whole test suite.
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
