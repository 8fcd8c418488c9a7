"""No request can stall fastpersistd for everyone, and its health says when it
cannot serve.

The daemon has one lock over its checkpoints; a request that does unbounded
work (big-number arithmetic on a hostile shape) or blocking I/O (reading a
FIFO planted as a job's marker) under it would stall every other client and
the health probe. Each test sends such a request and checks that another
client is still answered (generous timeouts: these are liveness checks).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from daemon_raw import Raw, assert_serving, code_of, details_of, entry, raw_header
from daemon_support import Daemon, is_lock_file
from grpc import StatusCode as Code

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.storage.commit import leftover_name

LIVENESS = 20.0  # seconds another client's call may take while a hostile one runs


@pytest.fixture
def raw(daemon: Daemon) -> Iterator[Raw]:
    r = Raw(daemon)
    try:
        yield r
    finally:
        r.close()


def _answered_meanwhile(daemon: Daemon, hostile: Callable[[], object]) -> tuple[Code, list[str]]:
    """Run `hostile` in a thread; meanwhile, Info and health on another channel
    must be answered. Returns hostile's code and the calls that were not."""
    result: list[Code] = []
    thread = threading.Thread(target=lambda: result.append(code_of(hostile)), daemon=True)
    thread.start()
    unanswered = []
    other = Raw(daemon)
    try:
        for i in range(3):
            time.sleep(0.5)
            code = code_of(lambda: other.stub.Info(pb.InfoRequest(), timeout=LIVENESS))
            if code != Code.OK:
                unanswered.append(f"Info {i}: {code.name}")
        thread.join(120)
    finally:
        other.close()
    assert result, "the hostile request did not end within two minutes"
    return result[0], unanswered


def test_a_shape_of_300000_dims_neither_freezes_the_daemon_nor_passes(daemon: Daemon,
                                                                     raw: Raw) -> None:
    seg = raw.segment(b"\0" * 4096)
    ident = raw.begin()
    header = raw_header({"w": entry("F32", [999_999_999] * 300_000, 0, 16)})
    code, unanswered = _answered_meanwhile(daemon, lambda: raw.submit(
        ident, 0, header, seg.name, 0, 16))
    assert unanswered == []
    assert code == Code.INVALID_ARGUMENT, code
    assert_serving(daemon)


@pytest.mark.parametrize("shape", [[999_999_999] * 600, [2**64] * 3, [10**4000], [1, -1],
                                   [0] + [2**62] * 63, [1] * 65])
def test_huge_or_odd_shapes_are_invalid_argument(daemon: Daemon, raw: Raw,
                                                 shape: list[int]) -> None:
    seg = raw.segment(b"\0" * 4096)
    ident = raw.begin()
    header = raw_header({"w": entry("F32", shape, 0, 16)})
    code, details = details_of(lambda: raw.submit(ident, 0, header, seg.name, 0, 16))
    assert code == Code.INVALID_ARGUMENT, (code, details[:300])
    assert len(details) < 2000, "an error message must be bounded"
    stream = [pb.StreamChunk(header=pb.StreamHeader(
        checkpoint_id=ident, file=pb.DataFile(index=0, header=header), data_length=16)),
        pb.StreamChunk(data=b"\0" * 16)]
    code, details = details_of(lambda: raw.stream(stream))
    assert code == Code.INVALID_ARGUMENT, (code, details[:300])
    assert_serving(daemon)


def test_a_fifo_as_a_jobs_marker_does_not_block_the_daemon(daemon: Daemon, raw: Raw) -> None:
    (daemon.root / "a").mkdir()
    job_dir = daemon.root / "a" / leftover_name("ck", "tmp")
    job_dir.mkdir()
    fifo = job_dir / ".fastpersist-job"
    os.mkfifo(fifo)
    try:
        code, unanswered = _answered_meanwhile(daemon, lambda: raw.stub.Begin(pb.BeginRequest(
            path="a/ck", client_id="t", staging_bytes=4096, file_count=1,
            job_id=f"{job_dir.name}:secret", rank=1), timeout=LIVENESS))
        assert unanswered == []
        assert code in (Code.INVALID_ARGUMENT, Code.NOT_FOUND), code
    finally:
        # Unblock a reader that is stuck on the FIFO, so that the daemon can stop.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert_serving(daemon)


def test_health_says_not_serving_when_the_root_is_gone(daemon: Daemon) -> None:
    client = daemon.client()
    try:
        assert client.health() == "SERVING"
        gone = daemon.root.with_name("root-gone")
        os.rename(daemon.root, gone)
        for lock in gone.iterdir():  # the daemon's lock file, all the root holds
            assert is_lock_file(lock.name), lock
            lock.unlink()
        os.rmdir(gone)
        deadline = time.monotonic() + LIVENESS
        while client.health() == "SERVING":
            assert time.monotonic() < deadline, "health still says SERVING without a root"
            time.sleep(0.1)
    finally:
        client.close()


def test_info_stays_consistent_while_checkpoints_come_and_go(daemon: Daemon,
                                                             raw: Raw) -> None:
    """Info reads the daemon's tables while Begins and Aborts change them."""
    stop = threading.Event()
    errors: list[str] = []

    def churn(k: int) -> None:
        r = Raw(daemon)
        try:
            i = 0
            while not stop.is_set():
                with contextlib.suppress(grpc.RpcError):
                    r.abort(r.begin(f"churn{k}/{i}", client=f"c{k}-{i}", staging=1))
                i += 1
        finally:
            r.close()

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            code, details = details_of(lambda: raw.stub.Info(pb.InfoRequest(), timeout=LIVENESS))
            if code != Code.OK:
                errors.append(f"{code.name}: {details}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert_serving(daemon)
