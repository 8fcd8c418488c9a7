#!/usr/bin/env bash
# The test command: lint, type-check, then the test suite (both engines).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check fastpersist tests benchmarks
mypy
python -m pytest -q "$@"
