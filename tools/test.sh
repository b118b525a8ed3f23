#!/usr/bin/env bash
# Set up .venv with the test extras (tools/setup.sh) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
