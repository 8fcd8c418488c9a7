"""Staging buffers that fastpersistd can read: shared-memory segments, and
handing one data file's buffer over.

SegmentBuffers allocates and frees the buffers of a StagingPool as segments
(shm.Segment) that the daemon maps by name. submit_staged is the one place a
buffer is lent to the daemon: it records the loan on the staged file
(StagedFile.lend) before the daemon learns the segment's name, so that
StagingPool.give_back quarantines the buffer unless the daemon is later known
to have finished reading it (handover.Handover marks that).

staging_limit is the window every save through the daemon stages in (a
single save's, and a rank's part of a distributed one): a save larger than it
is cut into files that fit half of it, and each buffer is reused once the
daemon reported its file written. open_when_room is how such a save waits for
the daemon's budgets when other saves hold them, instead of being refused.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from .. import knobs
from ..errors import CheckpointError, DaemonError
from ..protocol import shm
from ..protocol.channels import grpc_target
from ..protocol.client import DaemonClient
from ..tensors.datafile import plan_file
from ..tensors.plan import StoredTensor, memory_of
from .snapshot import StagedFile

T = TypeVar("T")
# Polling the daemon for room: cheap (a refused Begin makes nothing), and the
# longest sleep is short beside any save that holds the budget.
ROOM_POLL_FIRST = 0.01
ROOM_POLL_MAX = 0.25
# A streamed device or non-contiguous tensor is copied to the host in pieces of
# at most this (the daemon's stream takes 1 MiB messages; more is no faster).
STREAM_COPY_BYTES = 16 << 20


class SegmentBuffers:
    """Staging buffers backed by shared-memory segments the daemon can map."""

    def __init__(self, group: int | None) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._by_ptr: dict[int, shm.Segment] = {}
        self._registered: dict[int, bool] = {}  # page-locked with cudaHostRegister

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        # At least a page, so that every buffer is a real mapping with a name.
        segment = shm.Segment(shm.shm_dir(), max(nbytes, 4096), self.group)
        assert segment.map is not None
        buffer = torch.frombuffer(segment.map, dtype=torch.uint8)[:nbytes]
        if pinned:
            # Page-lock the shared pages so device-to-host copies run async and
            # at full bandwidth, as into cudaHostAlloc'd staging.
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            rc = cudart.cudaHostRegister(buffer.data_ptr(), segment.size, 0)
            if int(rc) != 0:
                segment.close()
                raise CheckpointError(f"cudaHostRegister of {segment.size} bytes failed ({rc})")
        with self._lock:
            self._by_ptr[buffer.data_ptr()] = segment
            self._registered[buffer.data_ptr()] = pinned
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Unlink and unmap a buffer's segment. Safe while the daemon still
        reads it: its own mapping keeps the pages until it unmaps them (this is
        how a quarantined segment is let go, StagingPool's let_go)."""
        with self._lock:
            segment = self._by_ptr.pop(buffer.data_ptr(), None)
        if segment is None:
            return
        if self._registered.pop(buffer.data_ptr(), False):
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())  # type: ignore[no-untyped-call]
        segment.close()

    def segment_of(self, buffer: torch.Tensor) -> shm.Segment:
        with self._lock:
            return self._by_ptr[buffer.data_ptr()]


def socket_group(address: str) -> int | None:
    """The daemon socket's group: segments are made readable to it."""
    target, tls = grpc_target(address)
    if tls:
        return None
    try:
        return os.stat(target.removeprefix("unix:")).st_gid
    except OSError:
        return None


def submit_staged(client: DaemonClient, segments: SegmentBuffers, ident: str, index: int,
                  staged: StagedFile, *, stream: bool = False) -> None:
    """Hand one data file to the daemon: by reference to its shared-memory
    buffer (lent from here on), or streamed: from the tensors when it was not
    staged, or (stream=True) from its buffer, which is then never lent."""
    staged.wait_copied()
    # The entries' names, dtypes, shapes and sizes are what staging laid out (no
    # views of the buffer are needed: the daemon reads it whole).
    layout = plan_file(staged.entries)
    length = layout.data_bytes
    if staged.buffer is None:
        client.submit_stream(ident, index, layout.layout.header, length, _chunks(layout.order))
        return
    if stream:  # the buffer is laid out as the data section (sent in 1 MiB messages)
        client.submit_stream(ident, index, layout.layout.header, length,
                             [memory_of(staged.buffer)[:length]])
        return
    segment = segments.segment_of(staged.buffer)
    # Before the request leaves: if its reply is lost, the daemon may have
    # mapped the segment all the same.
    staged.lend()
    segment.seal(ident)  # the daemon takes only segments that carry the checkpoint's tag
    header = layout.layout.header
    if not client.sends_header_apart(header):
        client.submit_shm(ident, index, header, segment.name, segment.data_offset, length)
        return
    # Too large for the message: in a segment of its own, sealed as the data's.
    # The daemon copies it out during the call, so it goes when the call does
    # (a daemon still reading it after a lost reply keeps its own mapping).
    held = shm.Segment(shm.shm_dir(), len(header), segments.group)
    try:
        assert held.map is not None
        held.map[:] = header
        held.seal(ident)
        client.submit_shm(ident, index, header, segment.name, segment.data_offset, length,
                          header_at=(held.name, held.data_offset))
    finally:
        held.close()


def _chunks(order: list[StoredTensor]) -> Iterator[memoryview]:
    """Each tensor's bytes as the stream reaches it: a device or non-contiguous
    tensor is copied to the host then, at most STREAM_COPY_BYTES at a time (a
    tensor streamed because it is larger than the staging window must not be
    copied to the host whole)."""
    for t in order:
        src = t.source
        if src.is_cpu and src.is_contiguous():
            yield memoryview(memory_of(src)).cast("B")
            continue
        for piece in _host_pieces(src):
            yield memoryview(memory_of(piece)).cast("B")


def _host_pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """t's elements in C order as contiguous host tensors: slices of the first
    dimension (each one's elements are consecutive in C order), as many rows
    as fit STREAM_COPY_BYTES (at least one)."""
    if t.dim() == 0 or t.numel() == 0:
        yield t.to("cpu").contiguous()
        return
    row = t[0].numel() * t.element_size()
    rows = max(1, STREAM_COPY_BYTES // max(row, 1))
    for start in range(0, t.shape[0], rows):
        yield t[start:start + rows].to("cpu").contiguous()


def staging_limit(client: DaemonClient) -> int:
    """The shared memory one save through the daemon may hold at once (0: no
    limit): FASTPERSIST_STAGING_BUDGET and the daemon's budgets (all clients,
    one client), whichever is least. A reservation over the daemon's would be
    refused (RESOURCE_EXHAUSTED) however long the save waited. Asked of the
    daemon at each call, which also renews the client's cached Info (its root):
    a daemon restarted since may have other budgets, or another root."""
    info = client.info()
    limits = [b for b in (knobs.current().staging_budget, info.client_budget,
                          info.staging_budget) if b]
    return min(limits, default=0)


def no_room(exc: DaemonError) -> bool:
    """Whether the daemon refused a Begin for want of room that other
    checkpoints hold (its budgets.Ledger): room that comes back as they end.
    A full disk is RESOURCE_EXHAUSTED too, and is not waited for."""
    text = str(exc)
    return exc.code == "RESOURCE_EXHAUSTED" and ("budget" in text or "in flight" in text)


def open_when_room(open_: Callable[[], T], what: str) -> T:
    """open_() (a Begin or Open), repeated while the daemon has no room for it,
    for at most FASTPERSIST_DAEMON_ROOM_TIMEOUT seconds: backpressure from
    the other saves on the node, not a refusal."""
    timeout = knobs.current().daemon_room_timeout
    deadline = time.monotonic() + timeout
    delay = ROOM_POLL_FIRST
    while True:
        try:
            return open_()
        except DaemonError as exc:
            if not no_room(exc):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonError(
                    f"{what}: no room in fastpersistd's staging budget after waiting "
                    f"{timeout} s (FASTPERSIST_DAEMON_ROOM_TIMEOUT) for other saves to end: "
                    f"{exc}", exc.code) from exc
            time.sleep(min(delay, left))
            delay = min(delay * 2, ROOM_POLL_MAX)
