#!/usr/bin/env bash
# The main job: set up (from nothing if need be), then train a small GPT-style
# model, checkpoint it with fastpersist, restore it and check it bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/demo.py "$@"
