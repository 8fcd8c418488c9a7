"""fastpersistd's security contract, against real daemon processes.

The socket's mode and group; paths confined to --root; malformed requests
answered with the documented status code (and the daemon serving on); clients
isolated from each other; staging budgets; TCP only with TLS and a bearer
token; checkpoints of clients that went away aborted (Watch, --idle-timeout).

Requests are sent with the raw gRPC stubs, so that they can be as wrong as a
hostile or buggy client makes them.
"""

from __future__ import annotations

import contextlib
import grp
import json
import mmap
import os
import secrets
import shutil
import socket
import stat
import struct
import subprocess
import sys
import time
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
    details_of,
    entry,
    file_header,
    mismatches,
    raw_header,
    staging_dirs,
    staging_dirs_go,
    tree_of,
    valid_tree,
)
from daemon_support import Daemon, root_entries
from grpc import StatusCode as Code

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.errors import DaemonError, DaemonUnavailableError
from fastpersist.protocol.client import DaemonClient
from fastpersist.tensors.checkpoint import read_manifest

OK = Code.OK
INVALID = Code.INVALID_ARGUMENT
NOT_FOUND = Code.NOT_FOUND
PRECONDITION = Code.FAILED_PRECONDITION
EXHAUSTED = Code.RESOURCE_EXHAUSTED
Status = pb.CheckpointStatus
ALIGN = 4096
PAGE = mmap.PAGESIZE


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    r = Raw(daemon)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def start_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[Callable[..., Daemon]]:
    """Start daemons with extra arguments; this process's clients use the last
    one's shared-memory directory."""
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        d = Daemon(tmp_path / f"d{len(started)}", *args)
        started.append(d)
        d.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        return d

    try:
        yield start
    finally:
        close_remote_savers()
        for d in started:
            d.cleanup()


# -- 1. the socket -------------------------------------------------------------------


def test_socket_is_created_0660(daemon: Daemon) -> None:
    st = os.lstat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


@pytest.mark.parametrize("by", ["name", "number"])  # a number needs no /etc/group entry
def test_socket_group_is_applied(by: str, start_daemon: Callable[..., Daemon]) -> None:
    mine = os.getgid()
    group = next((g for g in grp.getgrall() if g.gr_gid != mine), None)
    if group is None:
        pytest.skip("no group other than this user's primary group")
    if os.geteuid() != 0 and group.gr_gid not in os.getgroups():
        group = next((grp.getgrgid(g) for g in os.getgroups() if g != mine), None)
        if group is None:
            pytest.skip("not root and in no supplementary group: cannot chown the socket")
    d = start_daemon("--socket-group", group.gr_name if by == "name" else str(group.gr_gid))
    st = os.lstat(d.socket)
    assert st.st_gid == group.gr_gid
    assert stat.S_IMODE(st.st_mode) == 0o660


# -- 2. paths confined to the root ----------------------------------------------------


@pytest.fixture
def escape(daemon: Daemon, tmp_path: Path) -> Path:
    """A directory outside the root, holding a checkpoint, that root/link and
    root/a/sym point to."""
    outside = tmp_path / "outside"
    fastpersist.save({"w": torch.ones(2)}, outside / "ck", daemon="")  # in-process
    (daemon.root / "link").symlink_to(outside, target_is_directory=True)
    (daemon.root / "a").mkdir()
    (daemon.root / "a" / "sym").symlink_to(outside, target_is_directory=True)
    return outside


BAD_PATHS = {
    "dotdot": "../x",
    "absolute": "/abs/path",
    "dotdot-inside": "a/../../x",
    "empty": "",
    "dot": ".",
    "hidden": ".hidden",
    "staging-name": "a/.fp-tmp",
    "nul": "a/b\x00c",
    "5000-chars": "p" * 5000,
    "long-component": "a/" + "c" * 300,
    "through-symlink": "link/x",
    "symlink-to-ck": "link/ck",
    "symlink-last": "link",
    "symlink-last-nested": "a/sym",
}


def test_begin_list_delete_refuse_paths_outside_root(daemon: Daemon, raw: Raw, escape: Path,
                                                     tmp_path: Path) -> None:
    before_outside = tree_of(escape)
    before_root = tree_of(daemon.root)
    before_tmp = sorted(p.name for p in tmp_path.iterdir())
    cases: dict[str, tuple[Code, Callable[[], object]]] = {}
    for name, path in BAD_PATHS.items():
        cases[f"Begin {name}"] = (INVALID, lambda p=path: raw.begin(p))
        if path:  # List of "" lists the root itself
            cases[f"List {name}"] = (INVALID, lambda p=path: raw.list(p))
        cases[f"Delete {name}"] = (INVALID, lambda p=path: raw.delete(p))
    assert mismatches(cases) == {}
    assert tree_of(escape) == before_outside
    assert tree_of(daemon.root) == before_root
    assert sorted(p.name for p in tmp_path.iterdir()) == before_tmp
    assert not Path("/abs").exists()
    # The root itself lists fine and shows nothing from outside.
    assert [e.name for e in raw.list("").entries] == []
    assert_serving(daemon)


def test_client_library_refuses_paths_outside_root(daemon: Daemon, escape: Path,
                                                   tmp_path: Path) -> None:
    before = tree_of(escape)
    for target in (tmp_path / "outside-save", daemon.root / "link" / "x", daemon.root):
        with pytest.raises(DaemonError):
            fastpersist.save({"w": torch.zeros(2)}, target, daemon=daemon.address)
    assert not (tmp_path / "outside-save").exists()
    assert tree_of(escape) == before
    assert_serving(daemon)


# -- 3. malformed requests -------------------------------------------------------------


def test_malformed_data_file_headers(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(bytes(range(16)) * 4)
    ident = raw.begin(files=2)

    def submit(h: bytes, length: int = n, index: int = 0) -> Callable[[], object]:
        return lambda: raw.submit(ident, index, h, seg.name, 0, length)

    ok_json = {"w": entry("F32", [4], 0, 16)}
    unpadded = raw_header(ok_json, pad=False)
    assert len(unpadded) % ALIGN
    cases = {
        "empty": (INVALID, submit(b"")),
        "short garbage": (INVALID, submit(b"abc")),
        "garbage": (INVALID, submit(secrets.token_bytes(ALIGN))),
        "garbage, length prefix 1 GiB": (INVALID, submit(struct.pack("<Q", 1 << 30) + b"x" * 8)),
        "length prefix beyond the bytes": (INVALID, submit(raw_header(ok_json,
                                                                       declared=ALIGN * 2))),
        "length prefix short of the bytes": (INVALID, submit(raw_header(ok_json, declared=100))),
        "not UTF-8": (INVALID, submit(raw_header(b"\xff\xfe{}"))),
        "not JSON": (INVALID, submit(raw_header(b"{not json"))),
        "JSON list": (INVALID, submit(raw_header([1, 2, 3]))),
        "JSON string": (INVALID, submit(raw_header("w"))),
        "entry not an object": (INVALID, submit(raw_header({"w": 5}))),
        "entry without dtype": (INVALID, submit(raw_header(
            {"w": {"shape": [4], "data_offsets": [0, 16]}}))),
        "gap between tensors": (INVALID, submit(raw_header(
            {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}), 20)),
        "overlapping tensors": (INVALID, submit(raw_header(
            {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}), 12)),
        "tensors short of the data": (INVALID, submit(raw_header(ok_json), 32)),
        "tensors beyond the data": (INVALID, submit(raw_header(ok_json), 8)),
        "offsets reversed": (INVALID, submit(raw_header({"w": entry("F32", [0], 16, 0)}), 0)),
        "negative offset": (INVALID, submit(raw_header({"w": entry("F32", [4], -16, 0)}), 0)),
        "unknown dtype": (INVALID, submit(raw_header({"w": entry("F33", [4], 0, 16)}))),
        "shape/length mismatch": (INVALID, submit(raw_header({"w": entry("F32", [3], 0, 16)}))),
        "data_start not 4096-aligned": (INVALID, submit(unpadded)),
        "index == file_count": (INVALID, submit(header, index=2)),
        "index huge": (INVALID, submit(header, index=2**32 - 1)),
    }
    assert mismatches(cases) == {}

    # A valid file 0, then the same index again, then its tensor in file 1.
    raw.submit(ident, 0, header, seg.name, 0, n)
    code, details = details_of(submit(header))
    assert code == INVALID and "already submitted" in details, details
    code, details = details_of(submit(header, index=1))
    assert code == INVALID and "already in another data file" in details, details
    header_v, n_v = file_header([("v", 4)])
    raw.submit(ident, 1, header_v, seg.name, 0, n_v)
    raw.watch(ident)
    raw.commit(ident, json.dumps({"t": "dict", "k": ["w", "v"],
                                  "v": [{"t": "tensor", "e": 0}, {"t": "tensor", "e": 1}]}),
               ["w", "v"])
    assert raw.wait(ident).state == Status.COMMITTED
    loaded = fastpersist.load(daemon.root / "a" / "ck")
    expect = torch.frombuffer(bytearray(bytes(range(16))), dtype=torch.float32)
    assert torch.equal(loaded["w"], expect) and torch.equal(loaded["v"], expect)
    assert_serving(daemon)


def test_malformed_segment_references(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x01" * n, size=PAGE)
    ident = raw.begin()
    (daemon.shm_dir / "fastpersist-link").symlink_to(seg.path)
    (daemon.shm_dir / "fastpersist-dir").mkdir()
    outside = daemon.root.parent / "fastpersist-outside"
    outside.write_bytes(b"\x02" * PAGE)

    def submit(name: str, offset: int = 0, length: int = n) -> Callable[[], object]:
        return lambda: raw.submit(ident, 0, header, name, offset, length)

    cases = {
        "../etc/passwd": (INVALID, submit("../etc/passwd")),
        "/dev/shm/x": (INVALID, submit("/dev/shm/x")),
        "absolute, our prefix": (INVALID, submit(str(seg.path))),
        "relative path out": (INVALID, submit("fastpersist-x/../../" + outside.name)),
        "empty": (INVALID, submit("")),
        "fastpersist-nonexistent": (INVALID, submit("fastpersist-nonexistent")),
        "symlink in shm_dir": (INVALID, submit("fastpersist-link")),
        "directory": (INVALID, submit("fastpersist-dir")),
        "offset not page-aligned": (INVALID, submit(seg.name, offset=100)),
        "offset+length beyond the segment": (INVALID, submit(seg.name, offset=PAGE)),
        "length beyond the segment": (INVALID, submit(seg.name, length=PAGE + 16)),
        "offset overflowing u64": (INVALID, submit(seg.name, offset=2**64 - PAGE)),
    }
    assert mismatches(cases) == {}
    # The refusals left the checkpoint as it was: the right segment still goes in.
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    raw.commit(ident, valid_tree(), ["w"])
    assert raw.wait(ident).state == Status.COMMITTED
    assert fastpersist.load(daemon.root / "a" / "ck")["w"].numpy().tobytes() == b"\x01" * n
    assert_serving(daemon)


def test_out_of_sequence_calls_and_unknown_ids(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x00" * n)
    unknown = secrets.token_hex(12)
    tree = valid_tree()

    cases: dict[str, tuple[Code, Callable[[], object]]] = {
        "SubmitShm unknown id": (NOT_FOUND, lambda: raw.submit(unknown, 0, header, seg.name, 0,
                                                               n)),
        "SubmitStream unknown id": (NOT_FOUND, lambda: raw.stream([pb.StreamChunk(
            header=pb.StreamHeader(checkpoint_id=unknown, file=pb.DataFile(index=0,
                                                                           header=header),
                                   data_length=n)), pb.StreamChunk(data=b"\x00" * n)])),
        "Commit unknown id": (NOT_FOUND, lambda: raw.commit(unknown, tree, ["w"])),
        "Abort unknown id": (NOT_FOUND, lambda: raw.abort(unknown)),
        "Wait unknown id": (NOT_FOUND, lambda: raw.wait(unknown)),
        "Watch unknown id": (NOT_FOUND, lambda: next(raw.stub.Watch(
            pb.WaitRequest(checkpoint_id=unknown), timeout=10))),
        "Abort empty id": (NOT_FOUND, lambda: raw.abort("")),
    }
    assert mismatches(cases) == {}

    # Commit before every file is in.
    ident = raw.begin(files=2)
    raw.submit(ident, 0, header, seg.name, 0, n)
    assert code_of(lambda: raw.commit(ident, tree, ["w"])) == PRECONDITION
    raw.abort(ident)
    assert raw.wait(ident).state == Status.ABORTED
    assert code_of(lambda: raw.submit(ident, 1, header, seg.name, 0, n)) == PRECONDITION
    assert code_of(lambda: raw.commit(ident, tree, ["w"])) == PRECONDITION

    # After Commit: no more files, no second Commit.
    ident = raw.begin("b/ck")
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    raw.commit(ident, tree, ["w"])
    after = {
        "SubmitShm after Commit": (PRECONDITION, lambda: raw.submit(ident, 0, header, seg.name,
                                                                    0, n)),
        "Commit after Commit": (PRECONDITION, lambda: raw.commit(ident, tree, ["w"])),
    }
    assert mismatches(after) == {}
    assert raw.wait(ident).state == Status.COMMITTED
    assert_serving(daemon)


def test_abort_after_commit_is_refused(daemon: Daemon, raw: Raw) -> None:
    """Abort after Commit is out of sequence (the checkpoint is the daemon's):
    FAILED_PRECONDITION, whether the daemon is still writing it or is done. An
    OK would tell the client its checkpoint was dropped when it is on disk."""
    status = raw.save("a/ck", torch.ones(4))
    assert status.state == Status.COMMITTED
    code = code_of(lambda: raw.abort(status.checkpoint_id))
    assert code == PRECONDITION, f"Abort of a committed checkpoint answered {code.name}"
    assert raw.wait(status.checkpoint_id).state == Status.COMMITTED
    assert_serving(daemon)


def test_commit_validation(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x00" * n)
    ident = raw.begin()
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    tree = valid_tree()
    cases: dict[str, tuple[Code, Callable[[], object]]] = {
        "tensor_order missing a name": (INVALID, lambda: raw.commit(ident, tree, [])),
        "tensor_order with an extra name": (INVALID, lambda: raw.commit(ident, tree,
                                                                         ["w", "v"])),
        "tensor_order with another name": (INVALID, lambda: raw.commit(ident, tree, ["v"])),
        "tensor_order with a name twice": (INVALID, lambda: raw.commit(ident, tree, ["w", "w"])),
        "tree_json not JSON": (INVALID, lambda: raw.commit(ident, "{not json", ["w"])),
        "tree_json empty": (INVALID, lambda: raw.commit(ident, "", ["w"])),
        "tree_json nested 100000 deep": (INVALID, lambda: raw.commit(ident, "[" * 100_000,
                                                                      ["w"])),
    }
    assert mismatches(cases) == {}
    # None of that changed the checkpoint.
    assert [c.state for c in raw.list("").in_flight] == [Status.RECEIVING]
    raw.commit(ident, tree, ["w"])
    assert raw.wait(ident).state == Status.COMMITTED
    assert_serving(daemon)


def test_tree_json_with_nan_is_refused_at_commit(daemon: Daemon, raw: Raw) -> None:
    """NaN/Infinity are not JSON. Commit must refuse them (INVALID_ARGUMENT)
    rather than accept the hand-over and fail the checkpoint afterwards."""
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x00" * n)
    ident = raw.begin()
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    tree = '{"t": "dict", "k": ["w", "x"], "v": [{"t": "tensor", "e": 0}, NaN]}'
    code = code_of(lambda: raw.commit(ident, tree, ["w"]))
    assert code == INVALID, f"Commit answered {code.name}"
    # Refused, not failed: the client may still commit a valid tree.
    raw.commit(ident, valid_tree(), ["w"])
    assert raw.wait(ident).state == Status.COMMITTED
    assert_serving(daemon)


def test_submit_stream_malformed(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    ident = raw.begin()

    def head(length: int = n, index: int = 0, h: bytes = header) -> pb.StreamChunk:
        return pb.StreamChunk(header=pb.StreamHeader(
            checkpoint_id=ident, file=pb.DataFile(index=index, header=h), data_length=length))

    def data(k: int) -> pb.StreamChunk:
        return pb.StreamChunk(data=b"\x03" * k)

    cases: dict[str, tuple[Code, Callable[[], object]]] = {
        "no chunks": (INVALID, lambda: raw.stream([])),
        "data chunk first": (INVALID, lambda: raw.stream([data(n), head()])),
        "only data": (INVALID, lambda: raw.stream([data(n)])),
        "more bytes than data_length": (INVALID, lambda: raw.stream([head(), data(n), data(1)])),
        "fewer bytes than data_length": (INVALID, lambda: raw.stream([head(), data(n - 1)])),
        "no data at all": (INVALID, lambda: raw.stream([head()])),
        "second header chunk": (INVALID, lambda: raw.stream([head(), data(8), head(),
                                                            data(8)])),
        "garbage header": (INVALID, lambda: raw.stream([head(h=b"junk"), data(n)])),
        "index out of range": (INVALID, lambda: raw.stream([head(index=1), data(n)])),
        "data_length disagrees with header": (INVALID, lambda: raw.stream([head(length=8),
                                                                          data(8)])),
    }
    assert mismatches(cases) == {}
    raw.stream([head(), data(8), data(n - 8)])
    raw.watch(ident)
    raw.commit(ident, valid_tree(), ["w"])
    assert raw.wait(ident).state == Status.COMMITTED
    assert fastpersist.load(daemon.root / "a" / "ck")["w"].numpy().tobytes() == b"\x03" * n
    assert_serving(daemon)


def test_message_over_the_limit(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x00" * n)
    ident = raw.begin()
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    big = '"' + "x" * (70 << 20) + '"'
    assert code_of(lambda: raw.commit(ident, big, ["w"])) == EXHAUSTED
    assert code_of(lambda: raw.submit(ident, 0, b"\x00" * (70 << 20), seg.name, 0, n,
                                      in_message=True)) == EXHAUSTED
    raw.commit(ident, valid_tree(), ["w"])
    assert raw.wait(ident).state == Status.COMMITTED
    assert_serving(daemon)


def test_begin_limits(daemon: Daemon, raw: Raw) -> None:
    cases: dict[str, tuple[Code, Callable[[], object]]] = {
        "file_count over 100000": (INVALID, lambda: raw.begin(files=100_001)),
        "file_count 2**32-1": (INVALID, lambda: raw.begin(files=2**32 - 1)),
        "client_id empty": (INVALID, lambda: raw.begin(client="")),
        "client_id 300 chars": (INVALID, lambda: raw.begin(client="c" * 300)),
    }
    assert mismatches(cases) == {}
    assert root_entries(daemon.root) == []  # nothing was made for them
    assert_serving(daemon)


# Headers that slip past the daemon's checks: the first five make its parsing
# raise something other than the errors it expects (the call ends UNKNOWN), the
# last is accepted. The contract (and server.py's docstring) wants
# INVALID_ARGUMENT for malformed input.
WEIRD_HEADERS = {
    "dtype is a list": {"w": entry(["F32"], [4], 0, 16)},
    "dtype is an object": {"w": entry({"F32": 1}, [4], 0, 16)},
    "shape holds Infinity": b'{"w": {"dtype": "F32", "shape": [Infinity], '
                            b'"data_offsets": [0, 16]}}',
    "data_offsets hold 1e999": b'{"w": {"dtype": "F32", "shape": [4], '
                               b'"data_offsets": [0, 1e999]}}',
    "nested 100000 deep": b'{"w": ' + b"[" * 100_000 + b"}",
    # (-4) * (-1) * 4 bytes: the length matches, but no tensor has that shape.
    "negative dimensions": {"w": entry("F32", [-4, -1], 0, 16)},
}


@pytest.mark.parametrize("doc", list(WEIRD_HEADERS.values()), ids=list(WEIRD_HEADERS))
def test_header_edge_values_are_invalid_argument(daemon: Daemon, raw: Raw, doc: object) -> None:
    seg = raw.segment(b"\x00" * 16)
    ident = raw.begin()
    code, details = details_of(lambda: raw.submit(ident, 0, raw_header(doc), seg.name, 0, 16))
    assert code == INVALID, f"{code.name}: {details}"
    assert_serving(daemon)


def test_huge_stream_length_is_refused_cleanly(daemon: Daemon, raw: Raw) -> None:
    """A streamed file needs no staging (it is written as it arrives); a
    SubmitStream that announces an absurd data_length and sends none of it
    must be refused with a documented code (RESOURCE_EXHAUSTED or
    INVALID_ARGUMENT), not UNKNOWN."""
    length = 1 << 62
    ident = raw.begin()
    header = raw_header({"w": entry("U8", [length], 0, length)})
    chunks = [pb.StreamChunk(header=pb.StreamHeader(
        checkpoint_id=ident, file=pb.DataFile(index=0, header=header), data_length=length))]
    code, details = details_of(lambda: raw.stream(chunks))
    assert code in (EXHAUSTED, INVALID), f"{code.name}: {details}"
    assert_serving(daemon)


def test_fifo_segment_does_not_hang_the_daemon(daemon: Daemon, raw: Raw) -> None:
    """A client can make any file in the shm directory; a FIFO named like a
    segment must be refused, not block the handler (and a worker thread) in
    open() until someone writes to it."""
    header, n = file_header([("w", 4)])
    fifo = daemon.shm_dir / "fastpersist-fifo"
    os.mkfifo(fifo)
    ident = raw.begin()
    try:
        code, details = details_of(lambda: raw.stub.SubmitShm(pb.SubmitShmRequest(
            checkpoint_id=ident, file=pb.DataFile(index=0, header=header),
            data=pb.ShmRef(segment=fifo.name, offset=0, length=n)), timeout=1.5))
    finally:
        # Release a handler stuck in open(): a writer appearing unblocks it.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert code == INVALID, f"{code.name}: {details}"
    assert_serving(daemon)


def test_truncated_segment_does_not_kill_the_daemon(daemon: Daemon, raw: Raw) -> None:
    """A client shrinks a segment after SubmitShm (before the daemon writes
    it): the daemon's mapping then faults (SIGBUS). That must fail the
    checkpoint, not the daemon and every other client's checkpoints."""
    big = 64 << 20
    header0, n0 = file_header([("a", big // 4)])
    header1, n1 = file_header([("b", 1024)])
    seg0 = raw.segment(b"", size=big)
    seg1 = raw.segment(b"\x05" * n1)
    ident = raw.begin(staging=big + seg1.size, files=2)
    raw.watch(ident)
    # File 1 is written after file 0 (one file per checkpoint at a time).
    raw.submit(ident, 0, header0, seg0.name, 0, n0)
    raw.submit(ident, 1, header1, seg1.name, 0, n1)
    os.truncate(seg1.path, 0)
    status = None
    with contextlib.suppress(grpc.RpcError):
        raw.commit(ident, json.dumps({"t": "dict", "k": ["a", "b"], "v": [
            {"t": "tensor", "e": 0}, {"t": "tensor", "e": 1}]}), ["a", "b"])
        status = raw.wait(ident)
    assert daemon.proc is not None
    if status is None:  # the connection broke: give a dying daemon time to be reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.proc.wait(2)
    assert daemon.proc.poll() is None, (
        f"fastpersistd died with status {daemon.proc.returncode} after a client truncated a "
        "submitted segment")
    assert status is not None and status.state in (Status.FAILED, Status.COMMITTED), status
    assert_serving(daemon)


def test_truncated_segment_of_a_compressed_checkpoint_does_not_kill_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Begin's compression: the daemon reads a client's segment to encode it
    (byte planes, CRC32Cs, zstd) before the engine writes the packed file. A
    client that truncates its segment after SubmitShm makes those reads
    SIGBUS: that checkpoint fails with a specific error, the daemon lives, and
    another client's checkpoint in flight commits. The gate holds the
    daemon's reads of segments until both are handed over and one truncated."""
    gate = tmp_path / "gate"
    d = Daemon(tmp_path, gate=gate)
    victim, other = Raw(d), Raw(d)
    try:
        d.start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        n_elems = 512 << 10  # 2 MiB of F32: two 1 MiB frames, encoded in parallel
        header, n = file_header([("w", n_elems)])
        values = torch.linspace(-1, 1, n_elems).numpy().tobytes()

        def begin(raw: Raw, path: str, client: str, seg_size: int) -> str:
            return str(raw.stub.Begin(pb.BeginRequest(
                path=path, client_id=client, staging_bytes=seg_size, file_count=1,
                compression="zstd", frame_bytes=1 << 20), timeout=10).checkpoint_id)

        tree = json.dumps({"t": "dict", "k": ["w"], "v": [{"t": "tensor", "e": 0}]})
        seg_v, seg_o = victim.segment(values), other.segment(values)
        ident_v = begin(victim, "a/victim", "victim", seg_v.size)
        ident_o = begin(other, "b/other", "other", seg_o.size)
        for raw, ident, seg in ((victim, ident_v, seg_v), (other, ident_o, seg_o)):
            raw.submit(ident, 0, header, seg.name, 0, n)
            raw.watch(ident)
        os.truncate(seg_v.path, PAGE)  # its tag page stays, its data goes
        for raw, ident in ((victim, ident_v), (other, ident_o)):
            raw.commit(ident, tree, ["w"])
        d.open_gate()
        statuses = {}
        for raw, ident in ((victim, ident_v), (other, ident_o)):
            with contextlib.suppress(grpc.RpcError):  # (a daemon that died: below)
                statuses[ident] = raw.wait(ident, timeout=60)
        assert d.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(0 if len(statuses) == 2 else 5)
        assert d.proc.poll() is None, (
            f"fastpersistd died (status {d.proc.returncode}) compressing a truncated "
            f"segment:\n{d.log[-2000:]}")
        status_v, status_o = statuses[ident_v], statuses[ident_o]
        assert status_v.state == Status.FAILED, status_v
        assert status_v.error_code == "CheckpointIOError", status_v
        assert "compress" in status_v.error and "SIGBUS" in status_v.error, status_v.error
        assert "truncated" in status_v.error, status_v.error
        assert status_o.state == Status.COMMITTED, status_o
        loaded = fastpersist.load(d.root / "b" / "other")["w"]
        assert loaded.numpy().tobytes() == values
        assert read_manifest(d.root / "b" / "other").tensors[0].frames is not None
        assert not (d.root / "a" / "victim").exists() and staging_dirs_go(d.root / "a") == []
        assert_serving(d)
    finally:
        victim.close()
        other.close()
        close_remote_savers()
        d.cleanup()


# -- 4. isolation between clients ---------------------------------------------------------


def test_in_flight_path_and_ids_are_protected(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x07" * n)
    ident = raw.begin("a/ck", client="alice")
    ids = {ident, *(raw.begin(f"ids/{i}", client=f"c{i}") for i in range(8))}
    assert len(ids) == 9
    for i in ids:
        assert len(i) == 24 and all(c in "0123456789abcdef" for c in i), i

    evil = Raw(daemon)
    try:
        for path in ("a/ck", "a//ck/", "a/ck/"):
            assert code_of(lambda p=path: evil.begin(p, client="mallory")) == PRECONDITION
        assert code_of(lambda: evil.begin("a/ck", client="alice")) == PRECONDITION
        guesses = [secrets.token_hex(12), ident[:-1] + ("0" if ident[-1] != "0" else "1"),
                   ident.upper(), ident[:12], ident + "0", " " + ident]
        for guess in guesses:
            cases: dict[str, tuple[Code, Callable[[], object]]] = {
                "Abort": (NOT_FOUND, lambda g=guess: evil.abort(g)),
                "Commit": (NOT_FOUND,
                           lambda g=guess: evil.commit(g, "{}", [])),
                "Submit": (NOT_FOUND, lambda g=guess: evil.submit(
                    g, 0, header, seg.name, 0, n)),
            }
            assert mismatches(cases) == {}, guess
        # Alice's checkpoint is untouched and goes through.
        raw.submit(ident, 0, header, seg.name, 0, n)
        raw.watch(ident)
        raw.commit(ident, valid_tree(), ["w"])
        assert raw.wait(ident).state == Status.COMMITTED
        # Whoever knows an id may act on it: the id is the capability.
        other = raw.begin("b/ck", client="bob")
        evil.abort(other)
        assert raw.wait(other).state == Status.ABORTED
    finally:
        evil.close()
    assert fastpersist.load(daemon.root / "a" / "ck")["w"].numpy().tobytes() == b"\x07" * n
    assert_serving(daemon)


def test_hostile_client_cannot_touch_a_committed_checkpoint(daemon: Daemon, raw: Raw) -> None:
    target = daemon.root / "a" / "ck"
    value = torch.arange(32, dtype=torch.float32)
    fastpersist.save({"w": value, "step": 7}, target, daemon=daemon.address)
    manifest = (target / "manifest.json").read_bytes()
    files = sorted((p.name, p.read_bytes()) for p in target.iterdir())

    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\xee" * n)
    ident = raw.begin("a/ck", client="mallory", files=2)
    junk = [
        lambda: raw.submit(ident, 0, b"junk" * 100, seg.name, 0, n),
        lambda: raw.submit(ident, 0, header, "../" + target.name, 0, n),
        lambda: raw.submit(ident, 0, header, "fastpersist-nope", 0, n),
        lambda: raw.submit(ident, 5, header, seg.name, 0, n),
        lambda: raw.commit(ident, valid_tree(), ["w"]),
        lambda: raw.commit(ident, "]", ["w"]),
        lambda: raw.delete("a/ck/manifest.json"),
        lambda: raw.delete("a/./ck"),
        lambda: raw.delete("a/ck/../ck"),
        lambda: raw.begin("a/ck/../ck", client="mallory"),
    ]
    for fn in junk:
        assert code_of(fn) != OK
    raw.submit(ident, 0, header, seg.name, 0, n)  # half a checkpoint, then gone
    watch = raw.watch(ident)
    watch.cancel()
    assert raw.wait(ident).state == Status.ABORTED
    second = raw.begin("a/ck", client="mallory")
    raw.abort(second)
    third = raw.begin("a/ck", client="mallory")  # never finished, never watched

    assert (target / "manifest.json").read_bytes() == manifest
    assert sorted((p.name, p.read_bytes()) for p in target.iterdir()) == files
    loaded = fastpersist.load(target)
    assert torch.equal(loaded["w"], value) and loaded["step"] == 7
    raw.abort(third)
    assert staging_dirs_go(target.parent) == []
    assert_serving(daemon)


def test_nested_begin_cannot_break_an_in_flight_checkpoint(daemon: Daemon, raw: Raw) -> None:
    """Mallory begins a checkpoint inside the directory Alice's in-flight
    checkpoint will be renamed to. Either that Begin is refused or Alice's
    checkpoint still commits; Mallory must not make it fail."""
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x09" * n)
    ident = raw.begin("a/ck", client="alice")
    raw.submit(ident, 0, header, seg.name, 0, n)
    raw.watch(ident)
    code = code_of(lambda: raw.begin("a/ck/inner", client="mallory"))
    raw.commit(ident, valid_tree(), ["w"])
    status = raw.wait(ident)
    assert status.state == Status.COMMITTED, (
        f"Begin of a/ck/inner by another client answered {code.name}, and then "
        f"a/ck ended {Status.State.Name(status.state)}: {status.error}")
    assert_serving(daemon)


# -- 5. budgets -----------------------------------------------------------------------------


def test_staging_budgets(start_daemon: Callable[..., Daemon]) -> None:
    d = start_daemon("--staging-budget", "1M", "--client-budget", "512K")
    r = Raw(d)
    try:
        code, details = details_of(lambda: r.begin("x/over", client="c1", staging=600 << 10))
        assert code == EXHAUSTED
        assert "budget" in details and str(512 << 10) in details, details
        assert not (d.root / "x").exists()

        k400 = 400 << 10
        first = r.begin("x/1", client="c1", staging=k400)
        assert code_of(lambda: r.begin("x/1b", client="c1", staging=k400)) == EXHAUSTED
        second = r.begin("x/2", client="c2", staging=k400)
        code, details = details_of(lambda: r.begin("x/3", client="c3", staging=k400))
        assert code == EXHAUSTED
        assert "budget" in details and str(1 << 20) in details, details
        info = d.client().info()
        assert info.staging_budget == 1 << 20 and info.staging_in_use == 2 * k400

        r.abort(first)  # an abort frees c1's share
        third = r.begin("x/3", client="c3", staging=k400)

        # A commit frees it too: c2 finishes, then c4 fits.
        header, n = file_header([("w", 4)])
        seg = r.segment(b"\x01" * n)
        r.submit(second, 0, header, seg.name, 0, n)
        r.watch(second)
        assert code_of(lambda: r.begin("x/4", client="c4", staging=k400)) == EXHAUSTED
        r.commit(second, valid_tree(), ["w"])
        assert r.wait(second).state == Status.COMMITTED
        fourth = r.begin("x/4", client="c4", staging=k400)

        # Data beyond what Begin reserved.
        small = r.begin("x/5", client="c5", staging=PAGE)
        header_big, n_big = file_header([("w", 2 * PAGE // 4)])
        seg_big = r.segment(b"\x00" * n_big)
        code, details = details_of(lambda: r.submit(small, 0, header_big, seg_big.name, 0, n_big))
        assert code == EXHAUSTED, details
        # A streamed file takes no staging: the daemon writes it as it arrives.
        stream = [pb.StreamChunk(header=pb.StreamHeader(
            checkpoint_id=small, file=pb.DataFile(index=0, header=header_big),
            data_length=n_big)), pb.StreamChunk(data=b"\x00" * n_big)]
        assert code_of(lambda: r.stream(stream)) == OK
        for ident in (third, fourth, small):
            r.abort(ident)
        assert d.client().info().staging_in_use == 0
    finally:
        r.close()
    assert_serving(d)


# -- 6. TCP -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_listen_without_tls_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    base = [sys.executable, "-m", "fastpersist.daemon", "--root", str(root),
            "--socket", str(tmp_path / "s.sock"), "--shm-dir", str(tmp_path),
            "--listen", f"127.0.0.1:{_free_port()}"]
    (tmp_path / "cert.pem").write_text("x")
    for extra in ([], ["--tls-cert", str(tmp_path / "cert.pem"),
                       "--tls-key", str(tmp_path / "cert.pem")]):
        proc = subprocess.run(base + extra, capture_output=True, text=True, timeout=30)
        assert proc.returncode != 0
        assert "TLS" in proc.stderr, proc.stderr
        assert not (tmp_path / "s.sock").exists()


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16) + "\n")
    wrong = tmp_path / "wrong-token"
    wrong.write_text(secrets.token_hex(16) + "\n")
    return {"cert": cert, "key": key, "token": token, "wrong": wrong}


def test_tcp_needs_tls_and_the_token(start_daemon: Callable[..., Daemon],
                                     tls_files: dict[str, Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    port = _free_port()
    start_daemon("--listen", f"127.0.0.1:{port}", "--tls-cert", str(tls_files["cert"]),
                 "--tls-key", str(tls_files["key"]), "--token-file", str(tls_files["token"]))
    address = f"https://127.0.0.1:{port}"
    monkeypatch.setenv("FASTPERSIST_DAEMON_CA_FILE", str(tls_files["cert"]))
    monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(tls_files["token"]))

    client = DaemonClient(address)
    try:
        deadline = time.monotonic() + 10
        while True:  # the TCP server starts just after the Unix one
            try:
                info = client.info()
                break
            except DaemonUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert info.version
    finally:
        client.close()

    monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(tls_files["wrong"]))
    wrong = DaemonClient(address)
    try:
        with pytest.raises(DaemonError) as exc_info:
            wrong.info()
        assert exc_info.value.code == "UNAUTHENTICATED"
        with pytest.raises(DaemonError) as exc_info:
            wrong.begin("a/ck", 1, 1)
        assert exc_info.value.code == "UNAUTHENTICATED"
        assert code_of(lambda: next(wrong.stub.Watch(pb.WaitRequest(checkpoint_id="x"),
                                                   timeout=5))) == Code.UNAUTHENTICATED
    finally:
        wrong.close()

    # TLS but no token at all.
    creds = grpc.ssl_channel_credentials(tls_files["cert"].read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        stub = pb_grpc.FastPersistStub(channel)
        assert code_of(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == Code.UNAUTHENTICATED
        assert code_of(lambda: stub.List(pb.ListRequest(path=""), timeout=5)) \
            == Code.UNAUTHENTICATED

    # Plaintext to the TLS port gets nowhere.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.FastPersistStub(channel)
        code = code_of(lambda: stub.Info(pb.InfoRequest(), timeout=3))
        assert code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED), code


# -- 7. liveness ----------------------------------------------------------------------------


def test_cancelled_watch_aborts_the_checkpoint(daemon: Daemon, raw: Raw) -> None:
    header, n = file_header([("w", 4)])
    seg = raw.segment(b"\x00" * n)
    ident = raw.begin()
    raw.submit(ident, 0, header, seg.name, 0, n)
    assert staging_dirs(daemon.root / "a")  # the file is being written into it
    watch = raw.watch(ident)
    watch.cancel()
    status = raw.wait(ident)
    assert status.state == Status.ABORTED
    assert status.error_code == "CheckpointAbortedError"
    assert staging_dirs_go(daemon.root / "a") == []
    assert not (daemon.root / "a" / "ck").exists()
    assert code_of(lambda: raw.commit(ident, valid_tree(), ["w"])) == PRECONDITION
    assert d_info(daemon).staging_in_use == 0
    assert_serving(daemon)


def d_info(daemon: Daemon) -> pb.InfoResponse:
    client = daemon.client()
    try:
        return client.info()
    finally:
        client.close()


def test_idle_timeout_aborts_unwatched_checkpoints(start_daemon: Callable[..., Daemon]) -> None:
    d = start_daemon("--idle-timeout", "1")
    r = Raw(d)
    try:
        # Begun first and watched: older than the unwatched one, yet kept.
        watched = r.begin("w/ck", client="alive")
        r.watch(watched)
        started = time.monotonic()
        idle = r.begin("i/ck", client="gone")
        status = r.wait(idle, timeout=8)
        elapsed = time.monotonic() - started
        assert status.state == Status.ABORTED
        assert 0.9 <= elapsed <= 4.5, elapsed
        assert staging_dirs_go(d.root / "i") == []
        # List names the checkpoints in flight by path, never by id (the id is
        # the capability to act on a checkpoint).
        assert [(c.checkpoint_id, c.path, c.state) for c in r.list("").in_flight] == [
            ("", "w/ck", Status.RECEIVING)]
        r.abort(watched)
    finally:
        r.close()
    assert_serving(d)

