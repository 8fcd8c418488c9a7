"""fastpersistd never reaches outside its --root, even when the root is writable
by someone who swaps directories for symbolic links while requests run.

Each test plants a sentinel directory outside the root, attacks the daemon
through what lies inside the root (a symlink swapped in after a check, a
planted manifest.json, a leftover that is a link), and checks that nothing
outside changed and that every answer is a specific status code.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from daemon_raw import (
    Raw,
    assert_serving,
    close_remote_savers,
    code_of,
    file_header,
    tree_of,
    valid_tree,
)
from daemon_support import Daemon
from grpc import StatusCode as Code

import fastpersist
from fastpersist import _engine
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.daemon.paths import MAX_NAME_BYTES
from fastpersist.storage.commit import leftover_name

Status = pb.CheckpointStatus
UNSPECIFIC = {Code.INTERNAL, Code.UNKNOWN}


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    r = Raw(daemon)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A sentinel directory outside the root, holding a checkpoint."""
    out = tmp_path / "outside"
    fastpersist.save({"w": torch.ones(2)}, out / "ck", daemon="")
    (out / "secret.txt").write_text("TOPSECRET")
    return out


class Flipper:
    """Swaps root/NAME (a directory) with a symbolic link to `target`, atomically
    (renameat2 RENAME_EXCHANGE) and as fast as it can, until stopped: the
    daemon finds a directory or a link at every moment, whichever it looks."""

    def __init__(self, root: Path, name: str, target: Path) -> None:
        self.a = root / name
        self.b = root / f"{name}-link"
        self.b.symlink_to(target, target_is_directory=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            _engine.rename_exchange(str(self.a), str(self.b))

    def __enter__(self) -> Flipper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.a.is_symlink():  # put the directory back under its name
            _engine.rename_exchange(str(self.a), str(self.b))


def _codes(calls: int, fn: Callable[[int], object]) -> Counter[str]:
    codes: Counter[str] = Counter()
    for i in range(calls):
        try:
            fn(i)
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
            assert exc.code() not in UNSPECIFIC, exc.details()
    return codes


def test_staging_directory_swapped_for_a_symlink_after_begin(daemon: Daemon, raw: Raw,
                                                             outside: Path) -> None:
    before = tree_of(outside)
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x01" * n)
    ident = raw.begin("a/ck")
    (staging,) = [p for p in (daemon.root / "a").iterdir() if ".fp-tmp" in p.name]
    staging.rename(daemon.root / "a" / "moved")
    staging.symlink_to(outside, target_is_directory=True)
    raw.watch(ident)
    raw.submit(ident, 0, header, seg.name, 0, n)
    # The daemon may fail the checkpoint as soon as it finds out, before Commit.
    code_of(lambda: raw.commit(ident, valid_tree(), ["w"]))
    status = raw.wait(ident)
    assert tree_of(outside) == before, "the daemon wrote through the swapped-in symlink"
    assert not (daemon.root / "a" / "ck").is_symlink(), "the daemon published the symlink"
    assert status.state == Status.FAILED, status
    assert_serving(daemon)


def test_begin_racing_a_symlink_swap_creates_nothing_outside(daemon: Daemon, raw: Raw,
                                                            outside: Path) -> None:
    before = tree_of(outside)
    (daemon.root / "a").mkdir()

    def begin(i: int) -> None:
        raw.abort(raw.begin(f"a/b{i}/ck", client=f"c{i}"))

    with Flipper(daemon.root, "a", outside):
        codes = _codes(300, begin)
    assert tree_of(outside) == before, codes
    assert_serving(daemon)


def test_delete_racing_a_symlink_swap_renames_nothing_outside(daemon: Daemon, raw: Raw,
                                                             outside: Path) -> None:
    for i in range(40):  # a checkpoint inside, and a victim outside, of each name
        fastpersist.save({"w": torch.zeros(1)}, daemon.root / "a" / f"ck{i}", daemon="")
        fastpersist.save({"w": torch.ones(1)}, outside / f"ck{i}", daemon="")
    before = tree_of(outside)
    with Flipper(daemon.root, "a", outside):
        codes = _codes(40, lambda i: raw.delete(f"a/ck{i}"))
    assert tree_of(outside) == before, codes
    assert_serving(daemon)


def test_list_does_not_follow_a_planted_manifest_symlink(daemon: Daemon, raw: Raw,
                                                        outside: Path) -> None:
    (daemon.root / "planted").mkdir()
    (daemon.root / "planted" / "manifest.json").symlink_to(outside / "ck" / "manifest.json")
    (daemon.root / "echo").mkdir()
    (outside / "doc.json").write_text(json.dumps({"schema_version": "TOPSECRET", "files": [],
                                                  "tensors": [], "tree": "TOPSECRET"}))
    (daemon.root / "echo" / "manifest.json").symlink_to(outside / "doc.json")
    (daemon.root / "fifo").mkdir()
    os.mkfifo(daemon.root / "fifo" / "manifest.json")
    reply = raw.list("")
    states = {e.name: e.state for e in reply.entries}
    assert states.get("planted") != "committed", states
    assert "TOPSECRET" not in str(reply), states
    assert_serving(daemon)


def test_path_components_at_the_name_limit_are_invalid_argument(daemon: Daemon,
                                                               raw: Raw) -> None:
    """The staging directory's name is longer than the target's: a name that
    passes the 255-byte component limit may still be too long for it."""
    for n in (255, MAX_NAME_BYTES + 1):
        code = code_of(lambda n=n: raw.begin("a/" + "n" * n))
        assert code == Code.INVALID_ARGUMENT, (n, code)
        code = code_of(lambda n=n: raw.stub.BeginJob(pb.BeginJobRequest(
            path="j/" + "n" * n, client_id="t"), timeout=10))
        assert code == Code.INVALID_ARGUMENT, (n, code)
    raw.abort(raw.begin("a/" + "n" * MAX_NAME_BYTES))
    assert_serving(daemon)


def _dead_pid() -> int:
    for pid in range(4_000_000, 3_000_000, -7919):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.skip("found no unused process id")


def test_startup_cleanup_does_not_follow_links_or_die_on_odd_files(
        tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leftovers of a dead save are cleaned at startup; a leftover's name on a
    symlink to elsewhere, a FIFO or a socket must neither be followed (an old
    copy restored from a link would publish the link) nor stop the daemon."""
    before = tree_of(outside)
    root = tmp_path / "root"
    root.mkdir()
    pid = _dead_pid()

    def name(target: str, kind: str) -> str:
        # The daemon's cleanup recognises leftovers of dead processes of this host.
        return leftover_name(target, kind).replace(f"-{os.getpid()}-", f"-{pid}-")

    (root / name("x", "old")).symlink_to(outside / "ck", target_is_directory=True)
    (root / name("y", "tmp")).symlink_to(outside, target_is_directory=True)
    os.mkfifo(root / name("z", "tmp"))
    (root / "d").mkdir()
    os.mkfifo(root / "d" / "manifest.json")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / name("s", "del")))
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", root=root)
    try:
        d.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        assert not (root / "x").is_symlink(), "startup restored a leftover that is a symlink"
        assert tree_of(outside) == before
        assert_serving(d)
    finally:
        sock.close()
        close_remote_savers()
        d.cleanup()
