"""The shared-memory directory is world-writable (/dev/shm): what anyone may
put there must neither stop fastpersistd nor be taken for a client's segment.

A segment is accepted only when it is a regular file with one link that
carries the checkpoint's tag, which only the segment's owner can write
(shm.Segment.seal): not another client's live segment, not a hard link to
someone's file.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_raw import Raw, assert_serving, close_remote_savers, code_of, file_header, valid_tree
from daemon_support import Daemon
from grpc import StatusCode as Code

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb

Status = pb.CheckpointStatus
OLD = time.time() - 3600  # older than the reclaimer's grace period for new segments


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    r = Raw(daemon)
    try:
        yield r
    finally:
        r.close()


def _plant_odd_entries(shm_dir: Path) -> tuple[list[Path], socket.socket]:
    """A directory, a FIFO, a socket, a symlink and a file of another user, all
    named as segments and old enough to be reclaimed."""
    (shm_dir / "fastpersist-dir").mkdir()
    (shm_dir / "fastpersist-dir" / "inside").write_bytes(b"x")
    os.mkfifo(shm_dir / "fastpersist-fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(shm_dir / "fastpersist-sock"))
    (shm_dir / "fastpersist-link").symlink_to("/etc/hostname")
    odd = [shm_dir / n for n in ("fastpersist-dir", "fastpersist-fifo", "fastpersist-sock",
                                 "fastpersist-link")]
    for p in odd:
        os.utime(p, (OLD, OLD), follow_symlinks=False)
    return odd, sock


def test_odd_entries_in_the_shm_dir_do_not_stop_housekeeping(daemon: Daemon) -> None:
    odd, sock = _plant_odd_entries(daemon.shm_dir)
    try:
        # An orphan (nobody holds its lock), sorted after the odd entries: once
        # it is reclaimed, a housekeeping pass went over all of them.
        orphan = daemon.shm_dir / "fastpersist-zz-orphan"
        orphan.write_bytes(b"\0" * 4096)
        os.utime(orphan, (OLD, OLD))
        deadline = time.monotonic() + 30
        while orphan.exists() and daemon.proc is not None and daemon.proc.poll() is None:
            assert time.monotonic() < deadline, "no housekeeping pass reclaimed the orphan"
            time.sleep(0.1)
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log[-2000:]
        assert all(os.path.lexists(p) for p in odd)
        assert (daemon.shm_dir / "fastpersist-dir" / "inside").exists()
        assert_serving(daemon)
    finally:
        sock.close()


def test_daemon_starts_with_odd_entries_in_the_shm_dir(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    d = Daemon(tmp_path)
    odd, sock = _plant_odd_entries(d.shm_dir)
    try:
        d.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        assert all(os.path.lexists(p) for p in odd)
        assert_serving(d)
    finally:
        sock.close()
        close_remote_savers()
        d.cleanup()


def test_a_hard_link_is_not_a_segment(daemon: Daemon, raw: Raw) -> None:
    """A hard link in the shm directory to a file the linker may not read
    (here: another file on the same tmpfs) must not be written into their
    checkpoint by the daemon, which can read everything."""
    secret = daemon.shm_dir.parent / f"secret-{os.getpid()}-{time.monotonic_ns()}"
    secret.write_bytes(b"S" * 8192)
    try:
        os.link(secret, daemon.shm_dir / "fastpersist-hardlink")
        header, n = file_header([("w", 4)])
        ident = raw.begin("a/ck")
        for offset in (0, 4096):
            code = code_of(lambda o=offset: raw.submit(ident, 0, header, "fastpersist-hardlink",
                                                       o, n, seal=False))
            assert code == Code.PERMISSION_DENIED, code
        # A client's own segment with a second link is refused as well.
        seg = raw.segment(b"\x01" * n)
        os.link(seg.path, daemon.shm_dir / "fastpersist-second-name")
        code = code_of(lambda: raw.submit(ident, 0, header, seg.name, 0, n))
        assert code == Code.PERMISSION_DENIED, code
    finally:
        secret.unlink()
    assert_serving(daemon)


def test_another_clients_segment_is_refused(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    alice_seg = raw.segment(b"\x0a" * n)
    alice = raw.begin("alice/ck", client="alice")
    raw.submit(alice, 0, header, alice_seg.name, 0, n)  # sealed for Alice's checkpoint
    mallory = raw.begin("mallory/ck", client="mallory")
    code = code_of(lambda: raw.submit(mallory, 0, header, alice_seg.name, 0, n, seal=False))
    assert code == Code.PERMISSION_DENIED, code
    # Alice's checkpoint goes through untouched.
    raw.watch(alice)
    raw.commit(alice, valid_tree(), ["w"])
    assert raw.wait(alice).state == Status.COMMITTED
    loaded = fastpersist.load(daemon.root / "alice" / "ck")["w"]
    assert loaded.numpy().tobytes() == b"\x0a" * n
    raw.abort(mallory)
    assert_serving(daemon)
