"""Requests that grow with the job: a Commit's tree and tensor names, a
CommitJob's manifest, sent in chunks (CommitStream, CommitJobStream) so that
no message the daemon takes from a client is over a few MiB, within the
daemon's own limit on the payload (MAX_PAYLOAD_BYTES) instead of gRPC's
message limit (64 MiB, which refused them before).

Real daemon processes (tests/daemon_support.py); the job's part is written by
the storage layer the ranks use (as in test_distributed_daemon.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from daemon_raw import Raw, assert_serving, close_remote_savers, file_header, sent_at_once
from daemon_support import Daemon
from grpc import StatusCode as Code
from test_daemon_tcp import TCP
from test_distributed_daemon import _manifest, _part

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.distributed.storage import ThroughDaemon
from fastpersist.errors import DaemonError
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.protocol import chunked
from fastpersist.protocol.client import DaemonClient
from fastpersist.saving.files import StagedFiles
from fastpersist.saving.snapshot import stage_file
from fastpersist.tensors import plan, state
from fastpersist.tensors.plan import StoredTensor

MIB = 1 << 20
SERVICE = "/fastpersist.v1.FastPersist/"
# Just over the 64 MiB that gRPC's message limit allowed a Commit or CommitJob.
BIG = 65 * MIB


@pytest.mark.slow
def test_a_job_manifest_over_64_mib_commits_through_the_daemon(daemon: Daemon) -> None:
    """The manifest holds a 65 MiB string of the state beside a sharded tensor:
    the smallest real way to a manifest over gRPC's old limit. It was refused
    (RESOURCE_EXHAUSTED, gRPC's message size); now it is streamed, checked,
    committed, and loads."""
    storage = ThroughDaemon(daemon.address)
    try:
        target = daemon.root / "ckpt"
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        job = storage.stage(target)
        records = _part(storage, target, job, 0, {"w.0": full[:4].clone(),
                                                   "w.1": full[4:].clone()})
        m = _manifest(records, full, [("w.0", 0), ("w.1", 4)])
        note = "n" * BIG
        tree, leaves = state.encode({"w": full, "note": note}, sharded=True)
        leaves[0].node["e"] = 0
        manifest = type(m)(**{**vars(m), "tree": tree}).to_json()
        assert len(manifest) > 64 * MIB
        assert storage.publish(job, manifest, None) == ""
        loaded = fastpersist.load(target)
        assert torch.equal(loaded["w"], full) and loaded["note"] == note
    finally:
        storage.close()


@pytest.mark.slow
def test_a_commit_whose_tree_is_over_64_mib_goes_through_the_daemon(daemon: Daemon,
                                                                    tmp_path: Path) -> None:
    """A single-process save whose tree (a 65 MiB string) was over gRPC's limit."""
    target = daemon.root / "single"
    note = "t" * BIG
    fastpersist.save({"w": torch.ones(4), "note": note}, target, daemon=daemon.address)
    loaded = fastpersist.load(target)
    assert loaded["note"] == note and torch.equal(loaded["w"], torch.ones(4))


def test_a_payload_over_the_limit_is_refused_before_it_is_received(daemon: Daemon) -> None:
    """A stream that announces more than MAX_PAYLOAD_BYTES is refused at its
    first chunk, naming the limit; so is one that sends more than it announced."""
    from fastpersist.daemon import large_requests

    client = daemon.client()
    try:
        job = client.begin_job("over")
        chunks = client.stub.CommitJobStream
        over = large_requests.MAX_PAYLOAD_BYTES + 1
        with pytest.raises(grpc.RpcError) as caught:
            chunks(iter([pb.CommitJobChunk(header=pb.CommitJobRequest(job_id=job),
                                           payload_length=over)]), timeout=30)
        assert caught.value.code() == Code.RESOURCE_EXHAUSTED
        assert f"limited to {large_requests.MAX_PAYLOAD_BYTES} bytes" in (
            caught.value.details() or ""), caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            chunks(iter([pb.CommitJobChunk(header=pb.CommitJobRequest(job_id=job),
                                           payload_length=10),
                         pb.CommitJobChunk(data=bytes(11))]), timeout=30)
        assert caught.value.code() == Code.INVALID_ARGUMENT
        assert "more than the 10 bytes" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:  # an unknown job: nothing is received
            chunks(iter([pb.CommitJobChunk(header=pb.CommitJobRequest(job_id="x:y"),
                                           payload_length=MIB)]), timeout=30)
        assert caught.value.code() == Code.NOT_FOUND
    finally:
        client.close()
    assert_serving(daemon)


def test_an_older_clients_large_unary_commit_is_told_to_upgrade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client older than CommitStream sends a large Commit as one message:
    refused, with what to do about it (the daemon is often upgraded first).
    Over TCP, where gRPC receives up to 64 MiB (a peer's Replicate); on the
    Unix socket gRPC's own limit refuses it first, with its own words."""
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)  # (a TCP channel to 127.0.0.1)
    tcp = TCP(tmp_path).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(tcp.daemon.shm_dir))
    client = tcp.daemon.client()
    channel = tcp.channel(tcp.files["token"].read_text().strip())
    try:
        ident = client.begin("old-client", 0, 1)
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(SERVICE + "Commit")(pb.CommitRequest(
                checkpoint_id=ident, tree_json="x" * (chunked.UNARY_PAYLOAD_BYTES + MIB)
            ).SerializeToString(), timeout=30)
        assert caught.value.code() == Code.RESOURCE_EXHAUSTED
        details = caught.value.details() or ""
        assert "larger ones go as CommitStream" in details, details
        assert "upgrade fastpersist where the trainer runs" in details, details
        assert_serving(tcp.daemon)
    finally:
        channel.close()
        client.close()
        close_remote_savers()
        tcp.daemon.cleanup()


def test_an_older_clients_large_header_is_told_to_upgrade(daemon: Daemon) -> None:
    """A client older than the large-headers feature sends a header of 1-4 MiB
    in its SubmitShm: refused, saying where a newer client puts it."""
    client = daemon.client()
    try:
        ident = client.begin("old-header", 1 << 20, 1)
        header, n = file_header([(f"t{i:06d}", 4) for i in range(20_000)])
        assert chunked.INLINE_HEADER_BYTES < len(header) < 4 * MIB
        with pytest.raises(grpc.RpcError) as caught:
            client.stub.SubmitShm(pb.SubmitShmRequest(
                checkpoint_id=ident, file=pb.DataFile(index=0, header=header),
                data=pb.ShmRef(segment="fastpersist-none", offset=4096, length=n)), timeout=30)
        assert caught.value.code() == Code.RESOURCE_EXHAUSTED
        details = caught.value.details() or ""
        assert "a larger header goes in shared memory" in details, details
        assert "upgrade fastpersist where the trainer runs" in details, details
    finally:
        client.close()
    assert_serving(daemon)


@pytest.mark.slow
def test_garbage_commits_of_60_mib_are_refused_without_the_daemon_holding_them(
        daemon: Daemon) -> None:
    """Eight clients send a 60 MiB unary Commit at once. gRPC took each whole
    (64 MiB was the limit Commit needed) before the daemon could look at it:
    +390 MiB of RSS. Now a unary Commit is limited to a few MiB, refused by
    gRPC from the message's length prefix, and the daemon's peak memory
    grows by less than one such message."""
    garbage = pb.CommitRequest(checkpoint_id="x", tree_json="x" * (60 * MIB)).SerializeToString()
    codes, grown = sent_at_once(daemon, "Commit", garbage, 8)
    assert codes == [Code.RESOURCE_EXHAUSTED] * 8, codes
    assert grown < 60 * MIB, f"the daemon's peak RSS grew by {grown / MIB:.0f} MiB"
    assert_serving(daemon)


def test_a_streamed_commit_sent_again_after_a_lost_reply_is_settled(daemon: Daemon) -> None:
    """outcome() sends a Commit again when its reply was lost: a streamed one
    is refused at its header (FAILED_PRECONDITION: the first arrived), before
    its payload is read, and the checkpoint's outcome is found as for a unary
    one."""
    note = "r" * (5 * MIB)  # over UNARY_PAYLOAD_BYTES: streamed
    tree, leaves = state.encode({"w": torch.zeros(4), "note": note})
    stored = plan.plan_tensors(leaves)
    header, n = file_header([("w", 4)])
    raw, client = Raw(daemon), daemon.client()
    try:
        seg = raw.segment(bytes(16))
        ident = raw.begin("again", staging=seg.size)
        raw.submit(ident, 0, header, seg.name, 0, n)
        raw.watch(ident)
        order = [s.name for s in stored]
        client.commit(ident, json.dumps(tree), order)
        with pytest.raises(DaemonError) as caught:
            client.commit(ident, json.dumps(tree), order)
        assert caught.value.code == "FAILED_PRECONDITION"
        status = client.outcome(ident, commit=(json.dumps(tree), order, None))
        assert status.state == pb.CheckpointStatus.COMMITTED, status
    finally:
        raw.close()
        client.close()
    assert fastpersist.load(daemon.root / "again")["note"] == note


def test_a_daemon_without_the_streams_gets_the_unary_call() -> None:
    """A daemon older than CommitStream answers UNIMPLEMENTED: the same
    request goes as one message (which such a daemon takes up to 64 MiB)."""
    sent: list[pb.CommitRequest] = []

    class Unimplemented(grpc.RpcError):
        def code(self) -> Code:
            return Code.UNIMPLEMENTED

    def stream(chunks: Any, timeout: float) -> None:
        list(chunks)
        raise Unimplemented()

    def unary(request: pb.CommitRequest, timeout: float) -> str:
        sent.append(request)
        return "unary"

    payload = pb.CommitRequest(tree_json="x" * (chunked.UNARY_PAYLOAD_BYTES + 1),
                               tensor_order=["w"])
    reply = chunked.send_large(unary, stream, pb.CommitChunk, pb.CommitRequest(
        checkpoint_id="c"), payload, 1.0)
    assert reply == "unary" and sent == [pb.CommitRequest(
        checkpoint_id="c", tree_json=payload.tree_json, tensor_order=["w"])]


@pytest.mark.slow
def test_a_node_local_part_with_a_manifest_over_64_mib_is_prepared(daemon: Daemon) -> None:
    """CommitJob with prepare_for (a node other than rank 0's) goes the same
    way: the part is made durable under its prepared name with the whole
    manifest, and ResolvePrepared publishes it."""
    storage = ThroughDaemon(daemon.address)
    try:
        target = daemon.root / "local"
        full = torch.arange(8, dtype=torch.float32).reshape(2, 4)
        job = storage.stage(target)
        stored = [StoredTensor("w.0", "F32", (2, 4), full, full.nbytes)]
        buffer = storage.pool.acquire(full.nbytes, 0, False)
        records = storage.write(target, job, 0,
                                StagedFiles.copied([stage_file(stored, buffer, False)]), "n1")
        m = _manifest(records, full, [("w.0", 0)])
        tree, leaves = state.encode({"w": full, "note": "p" * BIG}, sharded=True)
        leaves[0].node["e"] = 0
        manifest = type(m)(**{**vars(m), "tree": tree}).to_json()
        prepared = Path(storage.prepare(target, job, manifest, "n1", "n0"))
        assert (prepared / MANIFEST_NAME).read_bytes() == manifest and not target.exists()
        storage.resolve(target, str(prepared), True)
        assert (target / MANIFEST_NAME).read_bytes() == manifest
    finally:
        storage.close()


def test_payloads_wait_for_room_rather_than_add_up() -> None:
    """The payloads held at once stay within the budget: a stream that does not
    fit waits for another to give its room back, and gives up when its call
    ends (the daemon's CommitStream and CommitJobStream use one Room)."""
    from fastpersist.daemon.large_requests import Room
    from fastpersist.daemon.requests import RequestError

    room = Room(10)
    room.take(8, lambda: True)
    took = threading.Event()
    waiter = threading.Thread(target=lambda: (room.take(5, lambda: True), took.set()))
    waiter.start()
    assert not took.wait(1.5) and room.held == 8  # waits past one of its 1 s checks
    room.give(8)
    assert took.wait(10) and room.held == 5
    waiter.join()
    with pytest.raises(RequestError) as caught:
        room.take(6, lambda: False)
    assert caught.value.code == "CANCELLED" and room.held == 5


def test_room_goes_to_calls_in_the_order_they_asked() -> None:
    """A large payload waiting for room is not overtaken by smaller ones
    that would fit (it waited behind each of them before, possibly for
    ever); a waiter whose call ends leaves the line to the next."""
    from fastpersist.daemon.large_requests import Room

    room = Room(100)
    room.take(60, lambda: True)
    order: list[str] = []
    cancelled = threading.Event()

    def take(name: str, nbytes: int, alive: Any = lambda: True) -> threading.Thread:
        """Start a call that asks for room; return once it is in line."""
        def run() -> None:
            try:
                room.take(nbytes, alive)
                order.append(name)
            except Exception:
                order.append(f"{name} gave up")
        in_line = len(room.waiting) + 1
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 10
        while len(room.waiting) < in_line and time.monotonic() < deadline:
            time.sleep(0.01)
        return t

    large = take("large", 50)  # does not fit: waits
    gone = take("gone", 10, lambda: not cancelled.is_set())  # would fit; in line behind it
    small = take("small", 30)  # would fit too
    assert order == [] and room.held == 60
    cancelled.set()
    gone.join(10)
    assert order == ["gone gave up"] and room.held == 60
    room.give(60)
    large.join(10)
    small.join(10)
    assert order == ["gone gave up", "large", "small"] and room.held == 80


@pytest.mark.slow
def test_a_stalled_payload_stream_gives_its_room_back(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A client announces a payload of the whole budget, sends a chunk and
    stalls: a save's streamed Commit waits for room, and after --idle-timeout
    without a chunk the daemon cancels the stalled stream and the save goes
    through (it waited for ever before)."""
    from fastpersist.daemon import large_requests

    d = Daemon(tmp_path, "--idle-timeout", "2").start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    raw = Raw(d)
    sent, go_on = threading.Event(), threading.Event()

    def stalling() -> Any:
        yield pb.CommitChunk(header=pb.CommitRequest(checkpoint_id=ident),
                             payload_length=large_requests.MAX_PAYLOAD_BYTES)
        yield pb.CommitChunk(data=bytes(MIB))
        sent.set()
        go_on.wait(120)

    try:
        ident = raw.begin("stalled", client="stalled")
        raw.watch(ident)
        call = raw.stub.CommitStream.future(stalling(), timeout=300)
        assert sent.wait(60)
        note = "s" * (5 * MIB)  # streamed: needs room
        fastpersist.save({"w": torch.ones(4), "note": note}, d.root / "waited",
                         daemon=d.address)
        assert fastpersist.load(d.root / "waited")["note"] == note
        with pytest.raises(grpc.RpcError) as caught:
            call.result()
        assert caught.value.code() == Code.CANCELLED
        assert len(d.events("commit-stream-stalled")) == 1
    finally:
        go_on.set()
        raw.close()
        d.cleanup()


@pytest.mark.slow
def test_a_checkpoint_whose_manifest_is_over_64_mib_is_listed_committed(daemon: Daemon) -> None:
    """The daemon's List reads a manifest of at most 64 MiB; a larger one was
    listed "corrupt: cannot read manifest.json (larger than 67108864 bytes)".
    Now it is committed, with a note saying what is not shown and why."""
    client = DaemonClient(daemon.address)
    try:
        big = daemon.root / "run" / "step-00000001"
        fastpersist.save({"w": torch.ones(4), "note": "l" * BIG}, big, daemon=daemon.address)
        fastpersist.save({"w": torch.ones(4)}, daemon.root / "run" / "step-00000002",
                         daemon=daemon.address)
        entries = {e.name: e for e in client.list("run").entries}
        assert entries["step-00000001"].state == "committed", entries["step-00000001"]
        assert "over the 64 MiB" in entries["step-00000001"].note
        assert "fpctl inspect" in entries["step-00000001"].note
        assert entries["step-00000002"].state == "committed"
        assert entries["step-00000002"].note == "" and entries["step-00000002"].bytes > 0
        assert (big / MANIFEST_NAME).exists()
        assert fastpersist.load(big)["note"] == "l" * BIG
    finally:
        client.close()
