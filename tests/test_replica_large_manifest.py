"""Peer replication of a checkpoint whose manifest is over gRPC's 64 MiB
message limit: the manifest goes in bounded chunks after the header
(replica_manifest.py), and a peer that announces or sends more than the
format's 1 GiB, or chunks out of order, is refused with nothing visible.

Real daemons on TCP (peer_support.PeerGroup), as tests/test_peer_replication.py.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc import StatusCode as Code
from peer_support import MIB, Node, PeerGroup, chunks, header_of, peer_group, wait_for

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.format.bounds import MAX_MANIFEST_BYTES
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.loading.load import load_from
from fastpersist.tensors import peer_manifest, peer_read

BIG = 65 * MIB  # just over the 64 MiB a Replicate header could carry


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerGroup]:
    yield from peer_group(tmp_path, monkeypatch)


def _big_checkpoint(node: Node, name: str, monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[Path, dict[str, object]]:
    """A save through the node's daemon whose manifest is over 64 MiB: a 65 MiB
    string in the state (the cheapest real way there, as in
    test_daemon_large_requests.py)."""
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(node.daemon.shm_dir))
    state: dict[str, object] = {"w": torch.arange(4096, dtype=torch.float32), "note": "r" * BIG}
    target = node.daemon.root / name
    fastpersist.save(state, target, daemon=node.daemon.address)
    assert (target / MANIFEST_NAME).stat().st_size > 64 * MIB
    return target, state


@pytest.mark.slow
def test_a_replica_whose_manifest_is_over_64_mib_arrives_whole(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = group.add("n1", "b", "--replica-bytes", "192M")  # its 68 MB manifest counts too
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    target, state = _big_checkpoint(sender, "step-1", monkeypatch)
    wait_for("step-1 replicated or given up", lambda: sender.daemon.events("replicated")
             or sender.daemon.events("replication-attempt-failed"), timeout=120)
    failed = sender.daemon.events("replication-attempt-failed")
    assert not failed, [(e["code"], e["error"]) for e in failed]
    manifest = (target / MANIFEST_NAME).read_bytes()
    (info,) = [r for r in holder.replicas() if r.complete]
    assert (info.node, info.path) == ("n0", "step-1")
    assert info.manifest_sha256 == hashlib.sha256(manifest).digest()
    (directory,) = holder.replica_dirs()
    for f in info.files:  # every data file arrived byte for byte (its CRCs were checked)
        assert (directory / f.name).read_bytes() == (target / f.name).read_bytes()
    # It loads from the peer, equal, with the sender's files gone.
    for p in target.iterdir():
        p.unlink()
    target.rmdir()
    source, why = peer_read.find([holder.address], "step-1", node="n0")
    assert source is not None, why
    loaded = load_from(source)
    assert loaded["note"] == state["note"]
    assert torch.equal(loaded["w"], state["w"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_lookup_reads_only_the_large_manifest_it_chooses(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer lists a manifest over 16 MiB by its SHA-256 only: listing the
    replicas a peer holds (every latest() on a node whose disk is gone)
    reads none of them, and finding one reads that one's, once."""
    holder = group.add("n1", "b", "--replica-bytes", "192M")
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(sender.daemon.shm_dir))
    for step in (1, 2):
        fastpersist.save({"w": torch.full((64,), float(step)), "note": str(step) * (17 * MIB)},
                         sender.daemon.root / f"step-{step}", daemon=sender.daemon.address)
    wait_for("both replicated", lambda: len(sender.daemon.events("replicated")) >= 2
             or sender.daemon.events("replication-attempt-failed"), timeout=120)
    assert not sender.daemon.events("replication-attempt-failed")
    read: list[str] = []
    real = peer_manifest.manifest_of

    def counting(*args: Any) -> bytes:
        read.append(args[2])  # the replica's path
        return real(*args)

    monkeypatch.setattr(peer_manifest, "manifest_of", counting)
    found, why = peer_read.held([holder.address])
    assert sorted(r.path for r in found) == ["step-1", "step-2"] and read == [], why
    source, why = peer_read.find([holder.address], "step-2", node="n0")
    assert source is not None, why
    loaded = load_from(source)
    assert loaded["w"][0] == 2.0 and len(loaded["note"]) == 17 * MIB
    assert read == ["step-2"]


def _replicate(node: Node, messages: Iterator[pb.ReplicaChunk]) -> grpc.RpcError:
    with node.channel() as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.FastPersistStub(ch).Replicate(messages, timeout=60)
    return info.value  # type: ignore[no-any-return]


def _streamed(header: pb.ReplicaHeader, parts: list[bytes], blobs: list[bytes],
              *, declared: int | None = None, data_first: bool = False
              ) -> Iterator[pb.ReplicaChunk]:
    """A Replicate whose manifest follows the header in `parts` (the new form)."""
    first = pb.ReplicaHeader()
    first.CopyFrom(header)
    first.manifest = b""
    first.manifest_bytes = sum(map(len, parts)) if declared is None else declared
    data = chunks(first, blobs)
    yield next(data)
    if data_first:
        yield from data
    yield from (pb.ReplicaChunk(manifest=p) for p in parts)
    yield from data


def test_a_manifest_sent_in_parts_arrives_and_a_hostile_sequence_is_refused(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new form with a small manifest is taken whole; an announced length
    over the format's 1 GiB (refused before a part is read), a part over 4 MiB,
    parts past the announced length, a data chunk before the manifest ends, a
    stream that ends in the manifest, a header with the manifest both in it and
    announced: each INVALID_ARGUMENT with its reason, and nothing left behind."""
    holder = group.add("n1", "b", "--replica-bytes", "192M")  # its 68 MB manifest counts too
    local = group.add("n0", "a")
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(local.daemon.shm_dir))
    ck = local.daemon.root / "step-1"
    fastpersist.save({"w": torch.arange(1000.0)}, ck, daemon=local.daemon.address)
    header, blobs = header_of(ck)
    manifest = header.manifest
    half = len(manifest) // 2
    both = pb.ReplicaHeader()
    both.CopyFrom(header)
    both.manifest_bytes = len(manifest)
    pad = manifest + b" " * (5 * MIB)  # JSON with trailing whitespace: a valid manifest
    cases = [
        (_streamed(header, [manifest], blobs, declared=MAX_MANIFEST_BYTES + 1),
         f"over the {MAX_MANIFEST_BYTES} this version reads"),
        (_streamed(header, [pad], blobs), "parts are 1 to 4194304 bytes"),
        (_streamed(header, [manifest[:half], manifest[half:] + b"  "], blobs,
                   declared=len(manifest) + 1), "end at the announced length"),
        (_streamed(header, [manifest[:half]], blobs, declared=len(manifest), data_first=True),
         "got another kind of chunk"),
        (iter([pb.ReplicaChunk(header=next(_streamed(header, [manifest], blobs)).header),
               pb.ReplicaChunk(manifest=manifest[:half])]),
         f"stream ended after {half} of the manifest's"),
        (chunks(both, blobs), "not both"),
    ]
    for messages, text in cases:
        error = _replicate(holder, messages)
        assert error.code() == Code.INVALID_ARGUMENT and text in (error.details() or ""), \
            (text, error.details())
        assert holder.replicas() == [] and holder.replica_dirs() == []

    # Well formed, in two parts: it arrives, and its manifest is the one sent.
    with holder.channel() as ch:
        pb_grpc.FastPersistStub(ch).Replicate(
            _streamed(header, [manifest[:half], manifest[half:]], blobs), timeout=60)
    (info,) = holder.replicas()
    assert info.complete and info.manifest == manifest
    assert info.manifest_sha256 == hashlib.sha256(manifest).digest()


@pytest.mark.slow
def test_a_peer_that_announces_a_manifest_and_stalls_gives_its_room_back(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Replicate announcing a 1 GiB manifest holds all the room for
    manifests sent in parts; when it sends nothing for --idle-timeout it is
    cancelled, and a replica waiting for room goes through."""
    holder = group.add("n1", "b", "--replica-bytes", "64M", "--idle-timeout", "2")
    local = group.add("n0", "a")
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(local.daemon.shm_dir))
    ck = local.daemon.root / "step-1"
    fastpersist.save({"w": torch.arange(1000.0)}, ck, daemon=local.daemon.address)
    header, blobs = header_of(ck)
    done = threading.Event()

    def stalling() -> Iterator[pb.ReplicaChunk]:
        yield next(_streamed(header, [header.manifest], blobs, declared=MAX_MANIFEST_BYTES))
        done.wait(120)

    errors: list[grpc.RpcError] = []
    stalled = threading.Thread(target=lambda: errors.append(_replicate(holder, stalling())))
    stalled.start()
    try:
        time.sleep(0.5)  # it holds the room
        half = len(header.manifest) // 2
        with holder.channel() as ch:
            pb_grpc.FastPersistStub(ch).Replicate(
                _streamed(header, [header.manifest[:half], header.manifest[half:]], blobs),
                timeout=30)
        assert holder.complete() == [("raw", "step-1")]
    finally:
        done.set()
        stalled.join(60)
    assert errors and errors[0].code() == Code.CANCELLED, errors
    assert holder.daemon.events("replica-manifest-stalled")
    assert not holder.daemon.events("commit-stream-stalled")  # a commit's event: not this
