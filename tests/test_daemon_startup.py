"""fastpersistd's start: the socket's address forms, and one daemon per root.

Real daemon processes (tests/daemon_support.py); a second one is started on
purpose where the first still runs, or after it was SIGKILLed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_raw import Raw, close_remote_savers, file_header, valid_tree
from daemon_support import Daemon

import fastpersist
from fastpersist import knobs
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.daemon.rootlock import lock_name


@pytest.fixture
def daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Daemon]]:
    """Daemons a test makes (appended), cleaned up at the end; the working
    directory is the test's own, so that a socket made in it shows."""
    monkeypatch.chdir(tmp_path)
    made: list[Daemon] = []
    try:
        yield made
    finally:
        close_remote_savers()
        for d in made:
            d.cleanup()


def test_socket_given_as_the_clients_address(daemons: list[Daemon], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--socket unix:///PATH`, the form FASTPERSIST_DAEMON and the logs use,
    serves PATH (it made a socket literally named `unix:/PATH` under the
    working directory, and clients found nothing)."""
    d = Daemon(tmp_path / "d")
    daemons.append(d)
    d.args = ["--socket", f"unix://{d.socket}"]  # after Daemon's own --socket: it wins
    d.start(timeout=20)
    assert d.socket.is_socket()
    assert not (tmp_path / "unix:").exists()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    fastpersist.save({"w": torch.arange(8)}, d.root / "ck", daemon=f"unix://{d.socket}")
    assert torch.equal(fastpersist.load(d.root / "ck")["w"], torch.arange(8))


@pytest.mark.parametrize("address", ["https://127.0.0.1:7070", "tcp://host:1", "dns:host:1",
                                     "unix://relative/x.sock", "unix-abstract:fp", "unix:"])
def test_socket_of_another_kind_is_refused(tmp_path: Path, address: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    r = subprocess.run([sys.executable, "-m", "fastpersist.daemon", "--root", str(root),
                        "--socket", address, "--shm-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)  # argparse's usage error
    assert "--socket" in r.stderr and address in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_a_second_daemon_on_the_same_root_is_refused(daemons: list[Daemon],
                                                    tmp_path: Path) -> None:
    """Each would take the other's checkpoints for its own (start-up cleanup,
    retention, uploads). The second exits naming the first's pid and socket;
    a SIGKILL of the first frees the root."""
    first = Daemon(tmp_path / "first")
    daemons.append(first)
    first.start()
    assert first.proc is not None
    raw = Raw(first)
    try:
        header, n = file_header([("w", 4)])
        seg = raw.segment(b"\x07" * n)
        ident = raw.begin("run/ck", staging=seg.size)
        raw.submit(ident, 0, header, seg.name, 0, n)
        raw.watch(ident)

        (tmp_path / "second").mkdir()
        second = Daemon(tmp_path / "second", root=first.root)
        daemons.append(second)
        with pytest.raises(RuntimeError) as refused:
            second.start()
        assert second.proc is not None and second.proc.returncode == 1
        message = str(refused.value)
        assert f"pid {first.proc.pid}" in message and str(first.socket) in message, message
        assert "another fastpersistd" in message
        assert not second.socket.exists()

        # The first daemon and its checkpoint in flight are untouched.
        raw.commit(ident, valid_tree(), ["w"])
        assert raw.wait(ident).state == pb.CheckpointStatus.COMMITTED
        lock_file = first.root / lock_name(knobs.current().node)
        lock = json.loads(lock_file.read_text())
        assert lock["pid"] == first.proc.pid and lock["socket"] == str(first.socket)

        # On shared storage each node's daemon serves the root: another node's starts.
        (tmp_path / "other-node").mkdir()
        other = Daemon(tmp_path / "other-node", root=first.root,
                       env={"FASTPERSIST_NODE": "node-2"})
        daemons.append(other)
        other.start()
        assert (first.root / lock_name("node-2")).is_file()
    finally:
        raw.close()

    first.proc.kill()  # SIGKILL: the kernel drops its lock
    first.proc.wait()
    (tmp_path / "again").mkdir()
    again = Daemon(tmp_path / "again", root=first.root)
    daemons.append(again)
    again.start()
    assert again.proc is not None
    lock = json.loads(lock_file.read_text())
    assert lock["pid"] == again.proc.pid and lock["socket"] == str(again.socket)
    assert fastpersist.load(first.root / "run" / "ck")["w"].numpy().tobytes() == b"\x07" * n
