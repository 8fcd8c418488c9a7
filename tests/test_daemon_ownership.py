"""A daemon owns everything under its --root; a trainer needs read access only.

The deployment of deploy/: fastpersistd as root with umask 0027, its root 0750
and owned by root with the trainers' group G, the socket 0660 in group G. The
trainer is another process, an unprivileged uid whose only supplementary group
is G (tests/helpers/unprivileged_trainer.py). A Checkpointer with keep_last=2
saves steps through the daemon: every future succeeds, `latest` names the
newest, retention keeps exactly the newest two, the trainer loads the latest
checkpoint, and nothing is left under the root that gc would not recognise.

Also: a policy the daemon cannot apply fails the future with PostCommitError
while the checkpoint stays committed, and the daemon logs it; a policy is
refused for a checkpoint that is not a Checkpointer's (step-N).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastpersist
from fastpersist import PostCommitError
from fastpersist.errors import DaemonError
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.storage.commit import walk_leftovers
from fastpersist.storage.retention import AfterCommit

HELPERS = Path(__file__).parent / "helpers"
# Numeric ids without /etc/passwd or /etc/group entries, as in a container.
TRAINER_UID = TRAINER_GID = 61234
GROUP = 61235  # the daemon's group: the socket's and the root's
STEPS, KEEP_LAST = 5, 2

as_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: the daemon runs as root and the trainer as another uid, as in deploy/")


def _readable_by_others(path: Path) -> bool:
    """Whether a uid without privileges can reach `path` (every directory on the
    way searchable by others)."""
    for p in [path, *path.parents]:
        try:
            mode = os.stat(p).st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return True


@pytest.fixture
def shared_tree() -> Iterator[Path]:
    """A directory others can reach (pytest's tmp_path is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="fp-owner-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@as_root
def test_checkpointer_through_a_root_daemon_needs_only_read_access(shared_tree: Path) -> None:
    from daemon_support import Daemon, root_entries

    root = shared_tree / "root"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o750)
    shm_dir = Path(tempfile.mkdtemp(prefix="fpt-owner-", dir="/dev/shm"))
    os.chown(shm_dir, 0, GROUP)
    os.chmod(shm_dir, 0o1770)  # like /dev/shm, for the group only
    home = shared_tree / "home"
    home.mkdir()
    os.chown(home, TRAINER_UID, TRAINER_GID)

    (shared_tree / "daemon").mkdir()
    d = Daemon(shared_tree / "daemon", "--socket-group", str(GROUP), root=root,
               shm_dir=shm_dir, umask=0o027)
    # The socket's directory: searchable by the group (the socket itself is 0660).
    os.chown(d.socket.parent, 0, GROUP)
    os.chmod(d.socket.parent, 0o750)
    d.start()
    try:
        run = root / "run"
        job = {"uid": TRAINER_UID, "gid": TRAINER_GID, "groups": [GROUP],
               # The interpreter, the virtualenv and this checkout (a clean clone
               # may sit in a 0700 temporary directory, as in CI).
               "drop_first": all(_readable_by_others(Path(p)) for p in (
                   sys.base_prefix, sys.prefix, Path(__file__).parent.parent)),
               "root": str(run), "address": d.address, "steps": STEPS, "keep_last": KEEP_LAST}
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
        env.update({"HOME": str(home), "TMPDIR": str(home), "PYTHONDONTWRITEBYTECODE": "1",
                    "FASTPERSIST_SHM_DIR": str(shm_dir)})
        proc = subprocess.run([sys.executable, str(HELPERS / "unprivileged_trainer.py"),
                               json.dumps(job)], capture_output=True, text=True, env=env,
                              cwd=shared_tree, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:] + d.log[-4000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])

        # The trainer was who it should be, and could not write the root.
        assert (seen["uid"], seen["gid"], seen["groups"]) == (TRAINER_UID, TRAINER_GID, [GROUP])
        assert seen["root_writable"] is False
        assert seen["latest_before"] is None
        # Every future succeeded; latest and retention are right, seen by the trainer.
        assert seen["errors"] == [], "\n".join(seen["errors"])
        kept = list(range(STEPS - KEEP_LAST, STEPS))
        assert seen["steps"] == kept
        assert seen["latest"] == f"step-{STEPS - 1:08d}"
        assert seen["loaded_step"] == STEPS - 1 and seen["loaded_equal"] is True

        # On disk: the pointer and the newest two checkpoints, the daemon's and
        # readable by the group only; nothing gc would not recognise.
        assert sorted(os.listdir(run)) == ["latest", *(f"step-{s:08d}" for s in kept)]
        assert (run / "latest").read_text() == f"step-{STEPS - 1:08d}\n"
        assert walk_leftovers(root) == []
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                p = Path(dirpath) / name
                st = os.lstat(p)
                assert (st.st_uid, st.st_gid) == (0, GROUP), (p, st.st_uid, st.st_gid)
                assert not st.st_mode & 0o007, (p, oct(st.st_mode))
                assert st.st_mode & stat.S_IRGRP, (p, oct(st.st_mode))
        for s in kept:
            assert (run / f"step-{s:08d}" / MANIFEST_NAME).is_file()
        assert root_entries(root) == ["run"]
    finally:
        d.cleanup()


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def test_a_policy_that_fails_leaves_the_checkpoint_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon_support import Daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    daemon = Daemon(tmp_path, "--metrics-listen", f"127.0.0.1:{port}").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(daemon.shm_dir))
    try:
        _fail_a_policy(daemon)
        assert _metric(port, "fastpersist_after_commit_failures_total") == 1
    finally:
        daemon.cleanup()


def _fail_a_policy(daemon: Any) -> None:
    run = daemon.root / "run"
    with fastpersist.Checkpointer(run, keep_last=1, daemon=daemon.address) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)}).result()
        # Something in the way of the pointer: a directory named `latest`.
        os.unlink(run / "latest")
        (run / "latest").mkdir()
        (run / "latest" / "in-the-way").write_text("")
        with pytest.raises(PostCommitError, match=r"step-00000002 is committed, but moving"):
            ckpt.save(2, {"w": torch.full((8,), 2.0)}).result()
        assert torch.equal(fastpersist.load(run / "step-00000002")["w"], torch.full((8,), 2.0))
        # Retention did not run either (the pointer comes first), and the next
        # save once the way is clear applies both.
        assert ckpt.steps() == [1, 2]
        shutil.rmtree(run / "latest")
        ckpt.save(3, {"w": torch.full((8,), 3.0)}).result()
        assert ckpt.steps() == [3] and ckpt.latest() == run / "step-00000003"
    (failure,) = daemon.events("after-commit-failed")
    assert failure["path"] == "run/step-00000002" and "is committed" in failure["error"]
    assert [e["deleted"] for e in daemon.events("after-commit")] == [
        [], ["step-00000002", "step-00000001"]]
    assert walk_leftovers(daemon.root) == []


def test_a_policy_is_only_for_a_checkpointers_checkpoints(daemon: Any) -> None:
    client = daemon.client()
    try:
        ident, stream = client.open("run/not-a-step", 0, 0)
        with pytest.raises(DaemonError, match="named step-N") as raised:
            client.commit(ident, "null", [], after_commit=AfterCommit(True, 2, None))
        assert raised.value.code == "INVALID_ARGUMENT"
        client.abort(ident)
        stream.cancel()
    finally:
        client.close()
