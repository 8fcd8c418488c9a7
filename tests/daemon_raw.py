"""Raw gRPC requests to a fastpersistd (tests/daemon_support.py): stubs, valid
and hand-made data-file headers, and checks shared by the daemon's security,
hardening and fuzz tests.

Requests go through the raw stubs, so that they can be as wrong as a hostile or
buggy client makes them.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import torch
from daemon_support import Daemon
from grpc import StatusCode as Code

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.format.safetensors_file import HeaderEntry, layout
from fastpersist.protocol.chunked import INLINE_HEADER_BYTES
from fastpersist.protocol.shm import Segment
from fastpersist.tensors import plan, state

OK = Code.OK
ALIGN = 4096
PAGE = mmap.PAGESIZE


def code_of(fn: Callable[[], object]) -> Code:
    """The status code a call ends with (OK when it returns)."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return OK


def details_of(fn: Callable[[], object]) -> tuple[Code, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def mismatches(cases: dict[str, tuple[Code, Callable[[], object]]]) -> dict[str, str]:
    """Run each case; the ones whose code differs from the expected one."""
    out = {}
    for name, (want, fn) in cases.items():
        got, details = details_of(fn)
        if got != want:
            out[name] = f"expected {want.name}, got {got.name}: {details[:200]}"
    return out


def file_header(tensors: Iterable[tuple[str, int]]) -> tuple[bytes, int]:
    """A valid data-file header for F32 tensors of the given element counts, and
    the length of its data section."""
    lay = layout([HeaderEntry(name, "F32", (n,), 4 * n) for name, n in tensors],
                 {"format": "pt"})
    return lay.header, lay.size - lay.data_start


def raw_header(doc: object, *, pad: bool = True, declared: int | None = None) -> bytes:
    """A header from arbitrary JSON (or bytes): 8-byte length, text, padding."""
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    n = len(text)
    if pad:
        n = -(-(8 + n) // ALIGN) * ALIGN - 8
    return struct.pack("<Q", n if declared is None else declared) + text + b" " * (n - len(text))


def entry(dtype: Any, shape: Any, begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


class Raw:
    """Raw stubs on a daemon's Unix socket, and the segments and Watch streams a
    test made through them (closed at the end)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.channel = grpc.insecure_channel("unix:" + str(daemon.socket))
        self.stub = pb_grpc.FastPersistStub(self.channel)
        self._segments: list[Segment] = []
        self._watches: list[Any] = []

    def close(self) -> None:
        for call in self._watches:
            call.cancel()
        self.channel.close()
        for seg in self._segments:
            with contextlib.suppress(Exception):
                seg.close()

    def segment(self, data: bytes, size: int | None = None) -> Segment:
        seg = Segment(self.daemon.shm_dir, max(size or len(data), PAGE))
        assert seg.map is not None
        seg.map[:len(data)] = data
        self._segments.append(seg)
        return seg

    def header_ref(self, ident: str, header: bytes, *, seal: bool = True) -> pb.ShmRef:
        """A data file's header in a segment of its own (SubmitShmRequest.header_ref),
        sealed as the checkpoint's unless `seal` is false."""
        seg = self.segment(header)
        if seal:
            seg.seal(ident)
        return pb.ShmRef(segment=seg.name, offset=Segment.data_offset, length=len(header))

    def begin(self, path: str = "a/ck", client: str = "t", staging: int = 1 << 20,
              files: int = 1) -> str:
        reply = self.stub.Begin(pb.BeginRequest(path=path, client_id=client,
                                                staging_bytes=staging, file_count=files),
                                timeout=10)
        return str(reply.checkpoint_id)

    def submit(self, ident: str, index: int, header: bytes, segment: str, offset: int = 0,
               length: int = 0, *, seal: bool = True, in_message: bool = False
               ) -> pb.SubmitResponse:
        """SubmitShm of `length` bytes at `offset` in the data of `segment`. With
        `seal`, a segment of this Raw's is first marked as the checkpoint's, as its
        owner does (shm.Segment.seal); without, it is named as another client would.
        A header over 1 MiB goes in a sealed segment of its own, as the client sends it,
        unless `in_message` (as an older client sends it)."""
        mine = next((s for s in self._segments if s.name == segment), None)
        if mine is not None and seal:
            mine.seal(ident)
        request = pb.SubmitShmRequest(
            checkpoint_id=ident, file=pb.DataFile(index=index, header=header),
            data=pb.ShmRef(segment=segment, offset=min(offset + Segment.data_offset, 2**64 - 1),
                           length=length))
        if len(header) > INLINE_HEADER_BYTES and not in_message:
            request.file.header = b""
            request.header_ref.CopyFrom(self.header_ref(ident, header))
        return self.stub.SubmitShm(request, timeout=10)

    def stream(self, chunks: Iterable[pb.StreamChunk]) -> pb.SubmitResponse:
        return self.stub.SubmitStream(iter(list(chunks)), timeout=10)

    def watch(self, ident: str) -> Any:
        """Open a Watch stream and read its first status, so that the daemon
        counts it before this returns."""
        call = self.stub.Watch(pb.WaitRequest(checkpoint_id=ident))
        self._watches.append(call)
        next(call)
        return call

    def commit(self, ident: str, tree_json: str, order: list[str]) -> pb.CommitResponse:
        return self.stub.Commit(pb.CommitRequest(checkpoint_id=ident, tree_json=tree_json,
                                                 tensor_order=order), timeout=10)

    def abort(self, ident: str) -> pb.AbortResponse:
        return self.stub.Abort(pb.AbortRequest(checkpoint_id=ident), timeout=10)

    def wait(self, ident: str, timeout: float = 10) -> pb.CheckpointStatus:
        return self.stub.Wait(pb.WaitRequest(checkpoint_id=ident), timeout=timeout)

    def list(self, path: str) -> pb.ListResponse:
        return self.stub.List(pb.ListRequest(path=path), timeout=10)

    def delete(self, path: str) -> pb.DeleteResponse:
        return self.stub.Delete(pb.DeleteRequest(path=path), timeout=10)

    def save(self, path: str, value: torch.Tensor, client: str = "t") -> pb.CheckpointStatus:
        """A complete, valid checkpoint {"w": value} through SubmitShm."""
        tree, leaves = state.encode({"w": value})
        stored = plan.plan_tensors(leaves)
        assert [s.name for s in stored] == ["w"]
        header, n = file_header([("w", value.numel())])
        seg = self.segment(value.numpy().tobytes())
        ident = self.begin(path, client=client, staging=seg.size)
        self.submit(ident, 0, header, seg.name, 0, n)
        self.watch(ident)
        self.commit(ident, json.dumps(tree), [s.name for s in stored])
        return self.wait(ident)


def valid_tree() -> str:
    """The tree of {"w": <a tensor>}; plan_tensors fills in its entry index."""
    tree, leaves = state.encode({"w": torch.zeros(4)})
    assert [s.name for s in plan.plan_tensors(leaves)] == ["w"]
    return json.dumps(tree)


def staging_dirs(directory: Path) -> list[str]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        # (Also while we look: an aborted save's daemon removes the parent
        # directories it made for it, right after its staging directory.)
        return []
    return sorted(name for name in names if ".fp-tmp" in name)


def staging_dirs_go(directory: Path, timeout: float = 3.0) -> list[str]:
    """The staging directories left after `timeout`. A worker still writing a
    file when its checkpoint was aborted removes the directory once that write
    (fsync included) ends, which can be just after the status says ABORTED."""
    deadline = time.monotonic() + timeout
    while (left := staging_dirs(directory)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def tree_of(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def close_remote_savers() -> None:
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)


def assert_serving(daemon: Daemon, name: str = "final") -> None:
    """The daemon is alive, healthy, and a normal save through it works."""
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, f"fastpersistd died ({daemon.proc.returncode}):\n" \
                                       f"{daemon.log[-3000:]}"
    client = daemon.client()
    try:
        assert client.health() == "SERVING"
    finally:
        client.close()
    target = daemon.root / "serving" / name
    value = torch.arange(16, dtype=torch.float32)
    fastpersist.save({"w": value}, target, daemon=daemon.address)
    assert torch.equal(fastpersist.load(target)["w"], value)


def peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc")


def sent_at_once(daemon: Daemon, method: str, message: bytes, callers: int
                 ) -> tuple[list[Code], int]:
    """`callers` unary calls of `method` holding `message` (raw bytes), at once,
    each on a connection of its own: their status codes, and how much the
    daemon's peak RSS grew meanwhile."""
    assert daemon.proc is not None
    codes: list[Code] = []

    def send() -> None:
        with grpc.insecure_channel(f"unix:{daemon.socket}",
                                   [("grpc.max_send_message_length", -1)]) as channel:
            try:
                channel.unary_unary(f"/fastpersist.v1.FastPersist/{method}")(message, timeout=60)
                codes.append(Code.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())

    before = peak_rss(daemon.proc.pid)
    threads = [threading.Thread(target=send) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, peak_rss(daemon.proc.pid) - before
