"""latest() on a node whose disk is gone asks its daemon's peers at once (peer_read.held).

Asked one after another, every peer that is down or blackholed cost a whole
LOOKUP_TIMEOUT before the next was asked: a latest() through a daemon with
several dead peers took that many timeouts. Asked at once, with one
deadline, they cost one. Not a timed check: two blackholed peers each hold
the connection they are asked on open until the other one has been asked
too (or 15 s went by), and then look whether the client still holds its
end. Asked at once, both see the other asked while their client still
waits on them; one after another, the first one never does (the second is
only asked once the first has been given up on, its connection closed).
And the live peer's answer is the one used.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peer_support import Node, PeerGroup, peer_group, wait_for

import fastpersist

GUARD = 15.0  # how long a blackhole holds a connection waiting for its partner


class Blackhole:
    """A TCP port that accepts and never answers (TLS never starts); it
    holds each connection open until its partner has been connected to."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.target = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.partner: Blackhole | None = None
        self.connected = threading.Event()
        self.saw_partner: list[bool] = []  # per connection held: was the partner asked then?
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def reset(self) -> None:
        self.connected.clear()
        self.saw_partner.clear()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            self.connected.set()
            assert self.partner is not None
            came = self.partner.connected.wait(GUARD)
            time.sleep(0.5)  # the client's close, if it gave up just before, arrives
            self.saw_partner.append(came and _still_open(conn))

    def close(self) -> None:
        self._closed = True
        self.sock.close()


def _still_open(conn: socket.socket) -> bool:
    """Whether the client has not closed its end (what it sent is discarded)."""
    conn.setblocking(False)
    try:
        while conn.recv(1 << 16):
            pass
    except BlockingIOError:
        return True  # nothing more to read, and no end of stream
    except OSError:
        return False  # reset
    return False  # end of stream: the client gave up on this peer


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerGroup]:
    yield from peer_group(tmp_path, monkeypatch)


def state_of(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step))}


def test_latest_asks_the_peers_at_once_and_a_blackholed_peer_does_not_cost_one_each(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Blackhole(), Blackhole()
    a.partner, b.partner = b, a
    try:
        holder = group.add("n1", "rack-b", "--replica-bytes", "64M")
        # Its peers in the order a sequential lookup would ask them: the dead first.
        fake = [Node(holder.daemon, f"dead-{i}", int(h.target.rpartition(":")[2]), holder.files)
                for i, h in enumerate((a, b))]
        sender = group.add("n0", "rack-a", "--replicas", "1", peers=[*fake, holder])
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(sender.daemon.shm_dir))
        run = sender.daemon.root / "run"
        with fastpersist.Checkpointer(run, daemon=sender.daemon.address) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state_of(step)).result()
        wait_for("step 2 replicated", lambda: any(
            e["path"] == "run/step-00000002" for e in sender.daemon.events("replicated")))
        a.reset()  # what the daemon's own replication asked them is not what is checked
        b.reset()
        shutil.rmtree(run)  # the node's disk is gone
        again = fastpersist.Checkpointer(run, daemon=sender.daemon.address)
        try:
            assert again.latest() == run / "step-00000002"  # the live peer's answer
        finally:
            again.close()
        # Both blackholes were asked, each while the other still held its connection.
        assert a.saw_partner and b.saw_partner, (a.saw_partner, b.saw_partner)
        assert a.saw_partner[0] and b.saw_partner[0], (a.saw_partner, b.saw_partner)
    finally:
        a.close()
        b.close()
