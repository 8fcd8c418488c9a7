"""Through fastpersistd: a node-local save becomes visible only with the job's
commit, and every rank that survives a lost rank reports the job's one
outcome (the same as test_distributed_outcomes.py in-process).

The jobs are real gloo processes, SIGKILLed at the commit point; each node's
daemon is a real daemon process, and survives the job as it would a crash of
the trainers. ResolvePrepared, the daemon's half of deciding a prepared
part, is driven from this process too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, root_entries
from dist_support import check_loaded, describe_here, ok, run_job

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.errors import CheckpointNotFoundError, DaemonError
from fastpersist.storage.leftovers import IN_DOUBT_HELP

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch without distributed")


def _daemons(tmp_path: Path) -> dict[str, Daemon]:
    out = {}
    for n in ("a", "b"):
        (tmp_path / f"daemon-{n}").mkdir()
        out[n] = Daemon(tmp_path / f"daemon-{n}", root=tmp_path / "disks" / n).start()
    return out


def _node_env(daemons: dict[str, Daemon]) -> dict[str, dict[str, str]]:
    return {n: {"FASTPERSIST_DAEMON": d.address, "FASTPERSIST_SHM_DIR": str(d.shm_dir)}
            for n, d in daemons.items()}


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_whole_job_crash_at_the_commit_through_the_daemons(
        tmp_path: Path, when: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Node-local through each node's daemon; every rank is killed just before
    (or after) rank 0's CommitJob. Node b's daemon holds b's part prepared,
    hidden, and keeps it over a restart; the job's next run settles it
    through the daemons."""
    daemons = _daemons(tmp_path)
    try:
        args = {"path": str(tmp_path / "disks" / "{node}" / "ckpt"), "node_local": True,
                "when": when, "everyone": True}
        reports = run_job(tmp_path, "die_at_commit", ["a", "b"], args,
                          env_by_node=_node_env(daemons))
        assert all(r.get("missing") for r in reports), reports
        root_a, root_b = daemons["a"].root, daemons["b"].root
        assert _visible(root_a) == ([] if when == "before" else ["ckpt"])
        assert _visible(root_b) == [], "node b shows a checkpoint the job may not have committed"
        capsys.readouterr()
        assert fpctl(["ls", str(root_b), "--json"]) == 0
        (entry,) = json.loads(capsys.readouterr().out)
        assert entry["state"].startswith("in doubt") and "node a's copy" in entry["state"]
        # A restarted daemon keeps what only the job can decide.
        daemons["b"].stop()
        daemons["b"].start()
        assert (root_b / entry["name"]).is_dir()

        settled = run_job(tmp_path, "settle", ["a", "b"], args, env_by_node=_node_env(daemons))
        ok(settled)
        if when == "before":
            assert settled[1]["removed"] == ["ckpt"]
            assert daemons["b"].events("discarded-prepared")
            assert root_entries(root_b) == []
        else:
            assert settled[1]["promoted"] == ["ckpt"]
            assert daemons["b"].events("published-prepared")
            assert _visible(root_b) == ["ckpt"]
            assert fpctl(["gather", str(root_a / "ckpt"), str(root_b / "ckpt"),
                          "--to", str(tmp_path / "gathered")]) == 0
            check_loaded(describe_here(fastpersist.load(tmp_path / "gathered")), tp=False)
    finally:
        for d in daemons.values():
            d.cleanup()


def test_rank0_killed_right_after_its_commit_job_no_survivor_reports_failure(
        daemon: Daemon, tmp_path: Path) -> None:
    """Shared storage through the daemon, the store dying with rank 0: the
    survivors learn from the daemon that it committed the job."""
    ckpt = daemon.root / "ckpt"
    reports = run_job(tmp_path, "die_at_commit", ["n0", "n0", "n1"],
                      {"path": str(ckpt), "when": "after"},
                      env={"FASTPERSIST_DAEMON": daemon.address})
    assert reports[0].get("missing") and reports[0]["returncode"] == -9
    survivors = reports[1:]
    ok(survivors)
    for r in survivors:
        assert any("rank 0 died" in w and "committed" in w for w in r["warnings"]), r
    check_loaded(describe_here(fastpersist.load(ckpt)), tp=False)
    assert len(daemon.events("committed-job")) == 1


# --- ResolvePrepared -------------------------------------------------------------------


def _prepared(root: Path, name: str, value: bytes) -> Path:
    """A prepared part of `name`, as a node other than rank 0's leaves one,
    made on the daemon's root by a process that then exits."""
    code = ("import sys; from pathlib import Path; from fastpersist.storage.commit import Staging; "
            "from fastpersist.storage.prepared import prepare; "
            "s = Staging.create(Path(sys.argv[1])); (s.path / 'data').write_bytes(sys.argv[2]"
            ".encode()); print(prepare(s, b'{}', 'a'))")
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
        assert sorted(e["action"] for e in daemon.events("cleanup")) == [
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
