#!/usr/bin/env bash
# Creates .venv with everything the demo and the tests need, from nothing, and
# (re)builds the C engine. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# deepspeed (a test extra) from its sdist: compile none of its ops at install (no CUDA
# here; the CPU ops its tests use are built on first use).
export DS_BUILD_OPS=0

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, safetensors, crc32c, tqdm, zstandard, numpy, pytest, hypothesis, ruff, mypy, grpc, grpc_health, grpc_tools, prometheus_client, kubernetes_validate, yaml, lightning, pytorch_lightning, transformers, accelerate, deepspeed, boto3, moto.server, mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
    pip install -q --upgrade pip setuptools wheel
    # Pinned: the CPU wheel of torch 2.13.0 is on this kind of machine's disk; a
    # looser range would download a multi-GB CUDA build.
    pip install -q torch==2.13.0
    pip install -q -e '.[test]'
fi
# torchtitan's checkpoint manager, for fastpersist.integrations.torchtitan's tests,
# with only what its checkpointer imports: torchtitan's training dependencies
# (datasets, pandas, pyarrow, wandb, tensorboard: hundreds of MB) are left out.
if ! python -c "import torchtitan.components.checkpointer, torchtitan.components.optimizer" 2>/dev/null; then
    pip install -q --no-deps torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 \
        typeguard==4.6.1 spmd_types==0.2.3
fi
# Rebuild the extension from the current csrc/ (editable installs do not).
pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "BuildBackendWarning\|^ *!!\|^ *\*\|Please be careful\|name as your package\|with strategy\|^\s*$" || true
python -c "import fastpersist._engine, fastpersist._codec, fastpersist._format" || { echo "setup: the C extensions did not build" >&2; exit 1; }

# The ENOSPC tests mount small ext4 images (mkfs.ext4); the deploy/ tests run
# systemd-analyze and systemd-sysusers on the unit. Install them where we may.
missing=()
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
command -v systemd-analyze >/dev/null || missing+=(systemd)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null) || \
        echo "setup: could not install ${missing[*]}; the tests that need them will skip" >&2
fi
