"""The README's main job (examples/demo.py, what scripts/demo.sh runs after
setup) runs to the end, through a daemon it starts, on a small model: a
change to the public API that breaks it fails here, not on a new user's
first command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_demo_saves_and_restores_through_the_daemon(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--root", str(tmp_path / "ckpts"),
         "--dim", "64", "--layers", "2", "--heads", "2", "--vocab", "512", "--steps", "8",
         "--every", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "restored step-00000008" in run.stdout, run.stdout[-3000:]
