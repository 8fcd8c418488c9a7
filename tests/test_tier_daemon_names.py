"""fastpersistd --tier and the names of checkpoints: one rule (storage/names.py)
for what the daemon accepts at Begin and what the tier can name as an object
key, so that nothing fails after a commit (issue 33 item 12). Against real
processes: the daemon and an S3 server (moto)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon
from tier_support import keys

import fastpersist
from fastpersist.errors import CheckpointError

# Names the daemon accepted before and the tier could never upload (or,
# for the non-UTF-8 one, that boto3 could never send).
ODD_NAMES = ["back\\slash", "bell\x07", "new\nline", "del\x7f", os.fsdecode(b"latin-\xe9")]


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _manifests(s3: Any) -> list[str]:
    return sorted(k.removesuffix("/manifest.json") for k in keys(s3.client, s3.bucket)
                  if k.endswith("/manifest.json"))


@pytest.fixture
def daemon_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    started: list[Daemon] = []

    def start(*args: str, prelude: str = "") -> Daemon:
        d = Daemon(tmp_path, *args, root=tmp_path / "root", prelude=prelude).start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        started.append(d)
        return d

    yield start
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)
    for d in started:
        d.cleanup()


@pytest.mark.parametrize("name", ODD_NAMES[:4])
def test_begin_refuses_a_name_the_tier_cannot_hold(s3: Any, daemon_on: Any, name: str) -> None:
    """Before: the daemon committed run/NAME, the tier raised, and the client
    was told FAILED for a committed checkpoint that was never uploaded."""
    d = daemon_on("--tier", s3.url)
    with pytest.raises(CheckpointError) as refused:
        fastpersist.save({"w": torch.ones(10)}, d.root / "run" / name, daemon=d.address)
    assert not (d.root / "run" / name).exists()  # refused at Begin, not failed after commit
    assert "the object-store tier's keys" in str(refused.value)
    # The daemon goes on: a plain name is saved and uploaded.
    fastpersist.save({"w": torch.ones(10)}, d.root / "run" / "plain", daemon=d.address)
    _until("the upload", lambda: _manifests(s3) == ["ckpts/run/plain"])


def test_the_restart_walk_skips_odd_names_and_queues_the_rest(s3: Any, daemon_on: Any,
                                                             tmp_path: Path) -> None:
    """Before: the walk at start stopped at the first name the tier could not
    hold; the checkpoints after it were never queued (and retention could
    delete them: not pending)."""
    root = tmp_path / "root"
    good = [f"good-{i}" for i in range(5)]
    for name in good + ODD_NAMES:  # left by an older daemon, or by hand
        fastpersist.save({"w": torch.full((10,), 1.0)}, root / name)
    d = daemon_on("--tier", s3.url)
    _until("the good ones uploaded", lambda: _manifests(s3) == [f"ckpts/{n}" for n in good])
    assert d.events("tier-start")[-1]["queued"] == len(good)
    skipped = {e["path"] for e in d.events("tier-unnameable")}
    assert skipped == set(ODD_NAMES)
    assert all("rename it to upload it" in e["error"] for e in d.events("tier-unnameable"))


def test_a_failure_to_queue_never_fails_a_committed_checkpoint(s3: Any, daemon_on: Any) -> None:
    """Whatever the tier raises when a checkpoint is queued, the client hears
    COMMITTED (it is), and the daemon logs what was not queued."""
    prelude = (
        "from fastpersist.daemon import tiering\n"
        "_add = tiering.DaemonTier.add\n"
        "def add(self, relpath):\n"
        "    if relpath.startswith('boom/'):\n"
        "        raise RuntimeError('injected: the queue is broken')\n"
        "    _add(self, relpath)\n"
        "tiering.DaemonTier.add = add\n")
    d = daemon_on("--tier", s3.url, prelude=prelude)
    fastpersist.save({"w": torch.ones(10)}, d.root / "boom" / "step-00000001", daemon=d.address)
    assert fastpersist.load(d.root / "boom" / "step-00000001")["w"].sum() == 10
    (line,) = d.events("tier-not-queued")
    assert line["path"] == "boom/step-00000001" and "injected" in line["error"]
