"""A passing error never drops an upload (issue 33 item 2): EMFILE, ENOMEM or
EIO opening a checkpoint or its files is retried with backoff, the
checkpoint stays pending (so local retention keeps it), and only a
checkpoint whose directory is really gone (ENOENT, seen twice) leaves the
queue. Against a real S3 server (moto) and, for retention, a real daemon."""

from __future__ import annotations

import errno
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
from fastpersist.storage import dirs
from fastpersist.tier.client import S3
from fastpersist.tier.uploader import Job, Uploader
from fastpersist.tier.url import TierURL


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _manifests(s3: Any) -> list[str]:
    return sorted(k.removesuffix("/manifest.json") for k in keys(s3.client, s3.bucket)
                  if k.endswith("/manifest.json"))


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, level: str, event: str, **fields: Any) -> None:
        self.seen.append((level, event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for _, e, f in self.seen if e == event]


def _uploader(s3: Any, events: Events) -> Uploader:
    return Uploader(S3(), TierURL.parse(s3.url), events=events, backoff=(0.05, 0.2),
                    compression=None).start()


def _job(s3: Any, path: Path, open_dir: Callable[[], int]) -> Job:
    return Job(str(path), TierURL.parse(s3.url).child(path.name), open_dir)


def _opener(path: Path, failures: list[int]) -> Callable[[], int]:
    """Opens `path`, first raising OSError(errno) for each of `failures`."""
    left = list(failures)

    def open_dir() -> int:
        if left:
            code = left.pop(0)
            raise OSError(code, os.strerror(code), str(path))
        return os.open(path, dirs.DIR_FLAGS)
    return open_dir


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOMEM, errno.EIO, errno.EACCES])
def test_a_passing_error_opening_the_checkpoint_is_retried(s3: Any, tmp_path: Path,
                                                           code: int) -> None:
    """Before: any OSError from open_dir counted as "gone": dropped for good."""
    ckpt = tmp_path / "step-00000001"
    fastpersist.save({"w": torch.ones(100)}, ckpt)
    events = Events()
    up = _uploader(s3, events)
    up.add(_job(s3, ckpt, _opener(ckpt, [code, code])))
    assert up.wait(30)
    up.close()
    assert _manifests(s3) == ["ckpts/step-00000001"]
    assert [f["attempt"] for f in events.named("tier-upload-failed")] == [1, 2]
    assert os.strerror(code) in events.named("tier-upload-failed")[0]["error"]
    assert events.named("tier-upload-dropped") == []


def test_emfile_opening_a_data_file_is_retried_and_pending(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an OSError opening a data file was NotUploadable: dropped, not
    pending, and local retention could delete the only copy."""
    ckpt = tmp_path / "step-00000001"
    fastpersist.save({"w": torch.ones(100)}, ckpt)
    real_open = os.open
    fail = {"left": 3}
    seen_pending = []
    events = Events()
    up = _uploader(s3, events)

    def flaky_open(name: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(name).startswith("data-") and fail["left"] and \
                not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            fail["left"] -= 1
            seen_pending.append(up.is_pending(str(ckpt)))
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", flaky_open)
    up.add(_job(s3, ckpt, _opener(ckpt, [])))
    assert up.wait(30)
    up.close()
    monkeypatch.setattr(os, "open", real_open)
    assert _manifests(s3) == ["ckpts/step-00000001"]
    assert seen_pending == [True, True, True]
    failed = events.named("tier-upload-failed")
    assert len(failed) == 3 and "Too many open files" in failed[0]["error"]
    assert "data-00000.safetensors" in failed[0]["error"]


def test_only_a_checkpoint_gone_twice_is_dropped(s3: Any, tmp_path: Path) -> None:
    events = Events()
    up = _uploader(s3, events)
    # Missing for a moment (a directory being replaced): looked at again, uploaded.
    back = tmp_path / "step-00000001"
    fastpersist.save({"w": torch.ones(100)}, back)
    up.add(_job(s3, back, _opener(back, [errno.ENOENT])))
    # Really gone: dropped once the second look finds nothing either.
    gone = tmp_path / "step-00000002"
    up.add(_job(s3, gone, _opener(gone, [])))
    assert up.wait(30)
    assert up.status().pending == () and not up.is_pending(str(back))
    up.close()
    assert _manifests(s3) == ["ckpts/step-00000001"]
    (dropped,) = events.named("tier-upload-dropped")
    assert dropped["path"] == str(gone) and dropped["attempt"] == 2
    assert "gone" in dropped["error"]


def test_the_daemon_keeps_what_a_passing_error_held_back(s3: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """fastpersistd --tier with keep_last=1: the uploader's first opens of data
    files fail with EMFILE. Before: step 1 was dropped at once, and the
    retention of step 2's commit deleted its only copy."""
    prelude = (
        "import errno, os\n"
        "_open = os.open\n"
        "_left = [2]\n"
        "def flaky(name, flags, *a, **k):\n"
        "    if str(name).startswith('data-') and _left[0] and \\\n"
        "            not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):\n"
        "        _left[0] -= 1\n"
        "        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))\n"
        "    return _open(name, flags, *a, **k)\n"
        "os.open = flaky\n")
    d = Daemon(tmp_path, "--tier", s3.url, "--tier-compression", "none",
               prelude=prelude).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        root = d.root / "run"
        ckpt = fastpersist.Checkpointer(root, daemon=d.address, keep_last=1)
        ckpt.save(1, {"w": torch.full((10,), 1.0)}).result()
        _until("step 1's first failure", lambda: d.events("tier-upload-failed")
               or d.events("tier-upload-dropped"))
        for step in (2, 3):
            ckpt.save(step, {"w": torch.full((10,), float(step))}).result()
        _until("every upload", lambda: _manifests(s3) == [
            "ckpts/run/step-00000001", "ckpts/run/step-00000002", "ckpts/run/step-00000003"])
        assert fastpersist.load(f"{s3.url}/run/step-00000001")["w"][0] == 1.0
        assert d.events("tier-upload-dropped") == []
        ckpt.save(4, {"w": torch.full((10,), 4.0)}).result()  # uploaded ones may go now
        ckpt.close()
        assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004"]
    finally:
        _forget_savers()
        d.cleanup()


def test_retention_keeps_what_was_never_confirmed_uploaded(s3: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The walk at start skips a directory it cannot open (os.fwalk's way with
    EMFILE or EACCES; here the prelude makes it skip run/). Before: what it
    missed was "not pending", and the next commit's retention deleted those
    checkpoints, never uploaded. Now retention keeps every checkpoint whose
    upload the daemon has not confirmed."""
    root = tmp_path / "root"
    for step in (1, 2):
        fastpersist.save({"w": torch.full((10,), float(step))}, root / "run" / f"step-{step:08d}")
    prelude = (
        "import os\n"
        "_fwalk = os.fwalk\n"
        "def fwalk(top='.', *a, **k):\n"
        "    for dirpath, dirnames, filenames, fd in _fwalk(top, *a, **k):\n"
        "        if dirpath == '.' and 'run' in dirnames:\n"
        "            dirnames.remove('run')\n"
        "        yield dirpath, dirnames, filenames, fd\n"
        "os.fwalk = fwalk\n")
    d = Daemon(tmp_path, "--tier", s3.url, root=root, prelude=prelude).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        assert d.events("tier-start")[-1]["queued"] == 0
        ckpt = fastpersist.Checkpointer(root / "run", daemon=d.address, keep_last=1)
        ckpt.save(3, {"w": torch.full((10,), 3.0)}).result()
        _until("step 3 uploaded", lambda: _manifests(s3) == ["ckpts/run/step-00000003"])
        ckpt.save(4, {"w": torch.full((10,), 4.0)}).result()
        ckpt.close()
        # Steps 1 and 2 were never uploaded: kept. (Step 3 is, and may go.)
        assert {"step-00000001", "step-00000002"} <= {p.name for p in (root / "run").iterdir()}
        d.stop()
        _forget_savers()
        d.cleanup()
        d = Daemon(tmp_path, "--tier", s3.url, root=root).start()  # a walk that sees them
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        _until("all uploaded", lambda: len(_manifests(s3)) == 4)
        ckpt = fastpersist.Checkpointer(root / "run", daemon=d.address, keep_last=1)
        ckpt.save(5, {"w": torch.full((10,), 5.0)}).result()
        ckpt.close()
        assert sorted(p.name for p in (root / "run").glob("step-*")) == ["step-00000005"]
    finally:
        _forget_savers()
        d.cleanup()


def _forget_savers() -> None:
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)
