"""Through fastpersistd: a node-local save becomes visible only with the job's
commit, and every rank that survives a lost rank reports the job's one
outcome (the same as test_distributed_outcomes.py in-process).

The jobs are real gloo processes, SIGKILLed at the commit point; each node's
daemon is a real daemon process, and survives the job as it would a crash of
the trainers. ResolvePrepared, the daemon's half of deciding a prepared
part, is driven from this process too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon

from fastpersist.commit import IN_DOUBT_HELP
from fastpersist.errors import CheckpointNotFoundError, DaemonError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch without distributed")


# --- ResolvePrepared -------------------------------------------------------------------


def _prepared(root: Path, name: str, value: bytes) -> Path:
    """A prepared part of `name`, as a node other than rank 0's leaves one,
    made on the daemon's root by a process that then exits."""
    code = ("import sys; from pathlib import Path; from fastpersist.commit import Staging; "
            "s = Staging.create(Path(sys.argv[1])); (s.path / 'data').write_bytes(sys.argv[2]"
            ".encode()); print(s.prepare(b'{}', 'a'))")
    out = subprocess.run([sys.executable, "-c", code, str(root / name), value.decode()],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def test_resolve_prepared_publishes_or_discards_only_prepared_parts(daemon: Daemon,
                                                                    tmp_path: Path) -> None:
    client = daemon.client()
    try:
        def refused(exc: type[Exception], fn: Any, match: str, code: str = "") -> None:
            with pytest.raises(exc, match=match) as caught:
                fn()
            assert not code or getattr(caught.value, "code", "") == code

        part = _prepared(daemon.root, "ckpt", b"1")
        other = _prepared(daemon.root, "other", b"2")
        (daemon.root / ".ckpt.fp-tmp-1-00000000@host").mkdir()
        os.symlink(part, daemon.root / ".ckpt.fp-prep-1-00000001@host")
        for name, match in [("../x", "not a prepared part"), (".", "not a prepared part"),
                            (other.name, "not a prepared part of ckpt"),
                            (".ckpt.fp-tmp-1-00000000@host", "not a prepared part"),
                            (".ckpt.fp-prep-1-00000001@host", "not a prepared part")]:
            refused(DaemonError, lambda n=name: client.resolve_prepared("ckpt", n, True), match,
                    "INVALID_ARGUMENT")
        refused(CheckpointNotFoundError, lambda: client.resolve_prepared(
            "ckpt", ".ckpt.fp-prep-1-deadbeef@host", True), "no prepared part")
        assert not (daemon.root / "ckpt").exists() and part.is_dir()
        # A restarted daemon cleans up after dead saves, but keeps what only
        # the job can decide.
        client.close()
        daemon.stop()
        daemon.start()
        client = daemon.client()
        assert part.is_dir() and other.is_dir()
        assert [e["action"] for e in daemon.events("cleanup")] == [
            f"kept {n}: in doubt ({IN_DOUBT_HELP})" for n in sorted((part.name, other.name))]

        client.resolve_prepared("ckpt", part.name, True)
        assert (daemon.root / "ckpt" / "data").read_bytes() == b"1"
        assert sorted(p.name for p in (daemon.root / "ckpt").iterdir()) == [
            "data", "manifest.json"]  # no marker left in the checkpoint
        client.resolve_prepared("other", other.name, False)
        assert not other.exists() and not (daemon.root / "other").exists()
        assert [e["prepared"] for e in daemon.events("published-prepared")] == [part.name]
    finally:
        client.close()
