#!/usr/bin/env bash
# The test command: set up (from nothing if need be), then lint, type-check,
# and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q "$@"
