"""Data files whose header is over 1 MiB (many tensors in one file) go through
fastpersistd with the header out of the request message: in a sealed
shared-memory segment (SubmitShm.header_ref) or in a stream's first chunks
(StreamHeader.header_length). The daemon's message bound stays at a few MiB,
so a client cannot make gRPC receive 32 MiB messages whole.

Real daemon processes (tests/daemon_support.py); hostile requests through raw
stubs (tests/daemon_raw.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import pytest
import torch
from daemon_raw import Raw, assert_serving, file_header, sent_at_once, staging_dirs_go
from daemon_support import Daemon
from grpc import StatusCode as Code

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.engine import get_engine
from fastpersist.protocol import chunked
from fastpersist.protocol.client import DaemonClient
from fastpersist.protocol.shm import Segment
from fastpersist.saving.registry import close_shared
from fastpersist.tensors import plan, state, verifying

MIB = 1 << 20
SERVICE = "/fastpersist.v1.FastPersist/"


def many_tensors(n: int) -> dict[str, torch.Tensor]:
    """n small tensors with long names: one data file's header of several MiB."""
    g = torch.Generator().manual_seed(n)
    return {f"model.blocks.{i:06d}.attention.rotary_embedding.inv_freq": torch.randn(
        4, generator=g) for i in range(n)}


def largest_header(directory: Path) -> int:
    sizes = []
    for f in sorted(directory.glob("data-*.safetensors")):
        with f.open("rb") as fh:
            sizes.append(8 + struct.unpack("<Q", fh.read(8))[0])
    return max(sizes)


def test_a_file_of_many_tensors_goes_through_the_daemon(daemon: Daemon) -> None:
    """60,000 tensors in a save: a data file's header is several MiB, over
    what a SubmitShm message may hold. The save goes through, its header in a
    segment of its own, and loads back bit-exact; no segment is left."""
    state_dict = many_tensors(60_000)
    target = daemon.root / "many"
    fastpersist.save(state_dict, target, daemon=daemon.address)
    assert largest_header(target) > chunked.INLINE_HEADER_BYTES + (64 << 10)
    back = fastpersist.load(target)
    assert back.keys() == state_dict.keys()
    assert all(torch.equal(back[k], v) for k, v in state_dict.items())
    assert verifying.verify(target, get_engine()).ok
    close_shared()  # the staging pool's own segments go; the header's went with its call
    assert [p.name for p in daemon.shm_dir.iterdir() if p.name.startswith("fastpersist-")] == []


def test_a_streamed_file_sends_its_large_header_in_chunks(daemon: Daemon) -> None:
    """DaemonClient.submit_stream with a header of several MiB: the header
    goes in data chunks after the first message, and the file is written."""
    tensors = many_tensors(40_000)
    tree, leaves = state.encode(tensors)
    stored = plan.plan_tensors(leaves)
    header, n = file_header([(s.name, 4) for s in stored])
    assert len(header) > 4 * MIB  # over what even a stream's first message may hold
    data = b"".join(tensors[s.name].numpy().tobytes() for s in stored)
    client = daemon.client()
    try:
        assert client.sends_header_apart(bytes(chunked.INLINE_HEADER_BYTES + 1))
        ident = client.begin("streamed", 0, 1)
        client.submit_stream(ident, 0, header, n, [data])
        client.commit(ident, json.dumps(tree), [s.name for s in stored])
        assert client.wait(ident, timeout=60).state == pb.CheckpointStatus.COMMITTED
    finally:
        client.close()
    back = fastpersist.load(daemon.root / "streamed")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_daemon_without_the_feature_gets_the_header_in_the_message() -> None:
    """An older daemon (no "large-headers") takes a header of up to 32 MiB in
    the message: the client sends it so."""
    header = bytes(2 * MIB)
    old = list(chunked.submit_messages("c", 0, header, 3, [b"abc"], header_in_parts=False))
    assert old[0].header.file.header == header and old[0].header.header_length == 0
    assert [m.data for m in old[1:]] == [b"abc"]
    new = list(chunked.submit_messages("c", 0, header, 3, [b"abc"], header_in_parts=True))
    assert new[0].header.file.header == b"" and new[0].header.header_length == 2 * MIB
    assert b"".join(m.data for m in new[1:]) == header + b"abc"
    assert all(len(m.data) <= chunked.CHUNK for m in new[1:])
    # The rule: apart only when large and the daemon says it takes that.
    client = DaemonClient("unix:///nonexistent.sock")
    try:
        client._info = pb.InfoResponse(features=[])  # what an older daemon answers
        assert not client.sends_header_apart(header)
        client._info = pb.InfoResponse(features=[chunked.LARGE_HEADERS])
        assert client.sends_header_apart(header)
        assert not client.sends_header_apart(bytes(chunked.INLINE_HEADER_BYTES))
    finally:
        client.close()


def _submit(raw: Raw, ident: str, n: int, data: Segment, header_ref: pb.ShmRef,
            inline: bytes = b"", why: list[str] | None = None) -> Code:
    data.seal(ident)
    try:
        raw.stub.SubmitShm(pb.SubmitShmRequest(
            checkpoint_id=ident, file=pb.DataFile(index=0, header=inline),
            data=pb.ShmRef(segment=data.name, offset=Segment.data_offset, length=n),
            header_ref=header_ref), timeout=30)
        return Code.OK
    except grpc.RpcError as exc:
        if why is not None:
            why.append(exc.details() or "")
        return exc.code()


def test_hostile_out_of_message_headers_are_refused(daemon: Daemon) -> None:
    """A header in another checkpoint's (unsealed) segment, in both places,
    over 32 MiB, past its segment's end, or an empty reference next to an
    inline header: refused with a specific code; nothing is written and the
    daemon serves on."""
    raw = Raw(daemon)
    try:
        header, n = file_header([(f"t{i:06d}", 4) for i in range(30_000)])
        data = raw.segment(bytes(n))
        ident = raw.begin("hostile", staging=data.size)
        why: list[str] = []
        small, small_n = file_header([("t", 4)])
        empty_ref = _submit(raw, ident, small_n, raw.segment(bytes(small_n)), pb.ShmRef(
            segment=data.name, offset=Segment.data_offset, length=0), inline=small, why=why)
        assert (empty_ref, why) == (Code.INVALID_ARGUMENT, [
            "header_ref names an empty header: leave it unset to send the header in the "
            "request"])
        codes = {
            "unsealed": _submit(raw, ident, n, data,
                                raw.header_ref(ident, header, seal=False)),
            "both": _submit(raw, ident, n, data, raw.header_ref(ident, header),
                            inline=header[:1000]),
            "over 32 MiB": _submit(raw, ident, n, data, pb.ShmRef(
                segment=data.name, offset=Segment.data_offset, length=(32 << 20) + 1)),
            "past the end": _submit(raw, ident, n, data, pb.ShmRef(
                segment=raw.header_ref(ident, header).segment,
                offset=Segment.data_offset, length=len(header) + 3 * 4096)),
            "not a header": _submit(raw, ident, n, data, raw.header_ref(
                ident, bytes(2 * MIB))),
        }
        assert codes == {"unsealed": Code.PERMISSION_DENIED, "both": Code.INVALID_ARGUMENT,
                         "over 32 MiB": Code.INVALID_ARGUMENT,
                         "past the end": Code.INVALID_ARGUMENT,
                         "not a header": Code.INVALID_ARGUMENT}
        # The same file, its header sealed in shared memory: taken.
        assert _submit(raw, ident, n, data, raw.header_ref(ident, header)) == Code.OK
        raw.abort(ident)
    finally:
        raw.close()
    assert staging_dirs_go(daemon.root) == []
    assert_serving(daemon)


def test_hostile_streamed_headers_are_refused(daemon: Daemon) -> None:
    """A stream whose header ends early, whose chunk runs past the header's
    end, or that names no receiving checkpoint: refused before the data."""
    raw = Raw(daemon)
    try:
        header, n = file_header([(f"t{i:06d}", 4) for i in range(30_000)])
        ident = raw.begin("streams", staging=0)

        def stream(head: pb.StreamHeader, chunks: list[bytes]) -> tuple[Code, str]:
            try:
                raw.stream([pb.StreamChunk(header=head)] + [pb.StreamChunk(data=c)
                                                            for c in chunks])
                return Code.OK, ""
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""

        def head(checkpoint: str, length: int = len(header)) -> pb.StreamHeader:
            return pb.StreamHeader(checkpoint_id=checkpoint, file=pb.DataFile(index=0),
                                   data_length=n, header_length=length)

        cut = header[:MIB]
        cases = {
            "ends early": stream(head(ident), [cut]),
            "runs past": stream(head(ident), [header[:-8], header[-8:] + bytes(8)]),
            "no checkpoint": stream(head("nope"), [cut]),
            "over 32 MiB": stream(head(ident, (32 << 20) + 1), [cut]),
        }
        assert {k: c for k, (c, _) in cases.items()} == {
            "ends early": Code.INVALID_ARGUMENT, "runs past": Code.INVALID_ARGUMENT,
            "no checkpoint": Code.NOT_FOUND, "over 32 MiB": Code.INVALID_ARGUMENT}
        assert "ended after 1048576 of its header's" in cases["ends early"][1]
        assert "past the header's end" in cases["runs past"][1]
        raw.abort(ident)
    finally:
        raw.close()
    assert_serving(daemon)


@pytest.mark.slow
def test_garbage_headers_of_32_mib_are_refused_without_the_daemon_holding_them(
        daemon: Daemon) -> None:
    """Sixteen SubmitShm calls at once, each with a 32 MiB header in the
    message: gRPC took each whole before (32 MiB was SubmitShm's bound). Now
    the bound is a few MiB, checked from the length prefix: the daemon's peak
    memory grows by less than one such message."""
    garbage = pb.SubmitShmRequest(checkpoint_id="x", file=pb.DataFile(
        header=bytes(32 * MIB))).SerializeToString()
    codes, grown = sent_at_once(daemon, "SubmitShm", garbage, 16)
    assert codes == [Code.RESOURCE_EXHAUSTED] * 16, codes
    assert grown < 32 * MIB, f"the daemon's peak RSS grew by {grown / MIB:.0f} MiB"
    assert_serving(daemon)
