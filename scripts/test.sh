#!/usr/bin/env bash
# The test command: set up (from nothing if need be), then lint, type-check,
# run the whole test suite, and run the C extensions' tests and a fuzz pass
# under ASan/UBSan (scripts/sanitize.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q "$@"
bash scripts/sanitize.sh
