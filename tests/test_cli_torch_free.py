"""fpctl ls, inspect and verify read no tensor into torch, so they must not
import it (about a second of every command, and the whole of `fpctl ls`):
each is run in a fresh interpreter where importing torch fails, and must do
its whole job there, the same as with torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from support import flip_bit

import fastpersist
from fastpersist.cli import main
from fastpersist.storage import commit
from fastpersist.tensors.committed import read_manifest

# Importing torch (or anything under it) raises in the child interpreter.
_NO_TORCH = textwrap.dedent("""
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("fpctl imported torch: " + name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    from fastpersist.cli import main
    status = main(sys.argv[1:])
    assert "torch" not in sys.modules
    sys.exit(status)
""")


def fpctl_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def fpctl_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    status = main(list(argv))
    return status, capsys.readouterr().out


def training_state() -> dict[str, Any]:
    """A model's and an optimizer's state: nested containers, tied tensors, step
    counters, Python scalars and strings, several dtypes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": OrderedDict(w=w, tied=w, b=torch.randn(32, generator=g).bfloat16(),
                             ids=torch.arange(6).reshape(2, 3)),
        "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g),
                                    "step": torch.tensor(7.0)}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]},
        "epoch": 3, "name": "run-1", "nothing": None,
    }


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "root"
    fastpersist.save(training_state(), root / "step-1")
    # Many files (and so the multi-file read path), and a compressed checkpoint.
    with monkeypatch.context() as m:
        m.setenv("FASTPERSIST_FILE_BYTES", str(16 << 10))
        fastpersist.save({f"t{i}": torch.full((1024,), float(i)) for i in range(40)},
                         root / "step-2")
    assert len(read_manifest(root / "step-2").files) > 4
    fastpersist.save({"z": torch.zeros(1 << 16), "r": torch.randn(256)}, root / "step-3",
                     compression="zstd")
    return root


def test_ls_and_inspect_read_no_torch(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A save still running (this process) and a corrupt manifest, which ls reports.
    leftover = root / commit.leftover_name("step-4", "tmp")
    leftover.mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text('{"format": "something-else"}')
    for argv in (["ls", str(root)], ["ls", str(root), "--json"],
                 *(["inspect", str(root / name), *extra]
                   for name in ("step-1", "step-2", "step-3") for extra in ([], ["--json"]))):
        child = fpctl_without_torch(*argv)
        assert child.returncode == 0, (argv, child.stderr)
        status, out = fpctl_here(capsys, *argv)
        assert status == 0
        assert child.stdout == out, argv  # the same report as with torch imported
    listed = json.loads(fpctl_without_torch("ls", str(root), "--json").stdout)
    states = {e["name"]: e["state"] for e in listed}
    assert states.pop("broken").startswith("corrupt: malformed manifest")
    assert states == {
        "step-1": "committed", "step-2": "committed", "step-3": "committed",
        leftover.name: f"incomplete (save by pid {os.getpid()} on {socket.gethostname()}, "
                       "running)"}


def test_verify_reads_every_byte_without_torch(root: Path) -> None:
    for name in ("step-1", "step-2"):
        child = fpctl_without_torch("verify", str(root / name), "--json")
        assert child.returncode == 0, child.stderr
        report = json.loads(child.stdout)
        assert report["ok"] and report["bytes_checked"] == read_manifest(
            root / name).tensor_bytes

    victim = read_manifest(root / "step-2").tensors[17]
    flip_bit(root / "step-2" / victim.file, victim.offset + 5)
    child = fpctl_without_torch("verify", str(root / "step-2"))
    assert child.returncode == 1, child.stderr
    assert f"tensor {victim.name!r}: CRC32C" in child.stdout + child.stderr
