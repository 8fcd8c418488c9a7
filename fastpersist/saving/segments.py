"""Staging buffers that fastpersistd can read: shared-memory segments, and
handing one data file's buffer over.

SegmentBuffers allocates and frees the buffers of a StagingPool as segments
(shm.Segment) that the daemon maps by name. submit_staged is the one place a
buffer is lent to the daemon: it records the loan on the staged file
(StagedFile.lend) before the daemon learns the segment's name, so that
StagingPool.give_back quarantines the buffer unless the daemon is later known
to have finished reading it (handover.Handover marks that).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import torch

from ..errors import CheckpointError
from ..protocol import shm
from ..protocol.channels import grpc_target
from ..protocol.client import DaemonClient
from ..tensors.datafile import plan_file
from ..tensors.plan import StoredTensor, memory_of
from .snapshot import StagedFile


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
    client.submit_shm(ident, index, layout.layout.header, segment.name, segment.data_offset,
                      length)


def _chunks(order: list[StoredTensor]) -> Iterator[memoryview]:
    """Each tensor's bytes as the stream reaches it: a device or non-contiguous
    tensor is copied to the host then, one at a time, not all up front."""
    for t in order:
        yield memoryview(memory_of(_host(t.source))).cast("B")


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_cpu and t.is_contiguous() else t.to("cpu").contiguous()
