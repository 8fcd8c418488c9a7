"""A distributed save has one outcome on every rank that survives it, and a
node-local save becomes visible only with the job's commit (in-process; the
same through fastpersistd: test_distributed_daemon_outcomes.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastpersist.cli import main as fpctl
from fastpersist.commit import Staging


def _ls(directory: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert fpctl(["ls", str(directory), "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_ls_shows_a_prepared_part_in_doubt_and_gc_keeps_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prepared = Staging.create(tmp_path / "ckpt").prepare(b"{}", "node-a")
    assert prepared.name.startswith(".ckpt.fp-prep-")
    (entry,) = _ls(tmp_path, capsys)
    assert entry["state"].startswith("in doubt") and "node node-a's copy" in entry["state"]
    capsys.readouterr()
    assert fpctl(["gc", str(tmp_path), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["action"] == "skipped" and prepared.is_dir()
