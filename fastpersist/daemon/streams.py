"""SubmitStream: a data file that comes over gRPC, written while it arrives.

A client streams a tensor that does not fit its staging budget. The daemon
writes the file into the checkpoint's staging directory as the chunks come
(stream_file.py), through one of a fixed number of slots (--max-streams), so
that what a stream costs the daemon does not depend on its length: a client
announcing 8 GiB and sending it slowly, or never, holds two blocks.

    1. register the file with its checkpoint (under the registry's lock): the
       index and the tensor names are taken, the staging directory's
       descriptor duplicated; an Abort of the checkpoint from here on cancels
       the stream
    2. wait for a slot (not reading the stream meanwhile: gRPC's flow control
       holds the client back)
    3. create the file relative to that descriptor, feed it the chunks,
       fsync it
    4. record it as written (its CRCs in the checkpoint's records), or, on any
       failure, remove the file and give the index and names back

A stream that breaks, or carries more or fewer bytes than it announced, is
refused and leaves nothing behind; its checkpoint stays open (its client may
send the file again, or abort). A disk error fails the checkpoint, as it does
in the write workers, and the stream is answered FAILED_PRECONDITION, as any
later call on that checkpoint is.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator

from .. import knobs
from ..errors import CheckpointIOError
from ..format import safetensors_file
from ..storage import dirs
from ..storage.commit import os_error
from . import logs
from .checkpoints import Checkpoint, StreamHandle
from .registry import Registry
from .requests import RequestError, invalid
from .stream_file import Slots, StreamFile


def _nothing() -> None:
    pass


class Streams:
    def __init__(self, registry: Registry, slots: Slots) -> None:
        self.registry = registry
        self.slots = slots

    def receive(self, ck: Checkpoint, index: int, header: bytes,
                entries: list[safetensors_file.ParsedEntry], length: int,
                chunks: Iterator[memoryview], cancel: Callable[[], None],
                alive: Callable[[], bool]) -> None:
        """Write data file `index` of `ck` from `chunks` (its data section,
        `length` bytes): steps 1-4 above. Returns once it is durable."""
        handle = StreamHandle(cancel)
        dir_fd = self._register(ck, index, entries, handle)
        slot, file, crcs = None, None, None
        try:
            slot = self.slots.acquire(lambda: alive() and not ck.terminal)
            if slot is None:
                raise RequestError("ABORTED", f"checkpoint {ck.id} ended, or its client went "
                                              "away, while the stream waited for a slot")
            handle.last_chunk = time.monotonic()
            file = StreamFile(slot, dir_fd, ck.file_name(index), header,
                              [e.end - e.begin for e in entries], knobs.current().direct)
            started = time.perf_counter()
            file.open()
            for data in chunks:
                if ck.terminal:  # aborted meanwhile (the cancel may not have reached us yet)
                    raise RequestError("FAILED_PRECONDITION",
                                       f"checkpoint {ck.id} is {ck.state.name.lower()}")
                if file.received + len(data) > length:
                    raise invalid(f"the stream carries more than the {length} bytes its "
                                  "header announced")
                file.feed(data)
                handle.last_chunk = time.monotonic()
            if file.received != length:
                raise invalid(f"the stream ended after {file.received} of {length} bytes")
            crcs = file.finish()
            seconds = time.perf_counter() - started
            self.registry.metrics.write_seconds.observe(seconds)
            self.registry.metrics.bytes_written.inc(file.size)
            logs.debug("file-streamed", checkpoint=ck.id, file=file.name, bytes=file.size,
                       seconds=round(seconds, 4), direct=file.direct)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise invalid(f"{ck.file_name(index)} already exists in checkpoint "
                              f"{ck.id}'s directory") from None
            error = os_error(exc, f"cannot save checkpoint {ck.relpath}")
            with self.registry.cond:
                handle.cancel = _nothing  # failing it cancels its streams, this one aside
                self.registry.fail(ck, error)
            # FAILED_PRECONDITION, as a later call on the failed checkpoint gets:
            # the client then reports the checkpoint's failure (DiskFullError...).
            raise RequestError("FAILED_PRECONDITION",
                               f"checkpoint {ck.id} failed: {error}") from None
        finally:
            if file is not None and crcs is None:
                file.discard()
            if slot is not None:
                self.slots.release(slot)
            os.close(dir_fd)
            self._end(ck, index, entries, header, crcs, 0 if file is None else file.size)

    def _register(self, ck: Checkpoint, index: int,
                  entries: list[safetensors_file.ParsedEntry], handle: StreamHandle) -> int:
        r = self.registry
        with r.cond:
            r.require_receiving(ck, "submit a file to")
            if index in ck.submitted or index in ck.streams:
                raise invalid(f"data file {index} was already submitted")
            dup = next((e.name for e in entries if e.name in ck.names), None)
            if dup is not None:
                raise invalid(f"tensor {dup!r} is already in another data file")
            assert ck.staging is not None and ck.staging.fds is not None  # made before the id
            # Duplicated under the lock: the Staging closes its own when the
            # checkpoint ends, and a closed number may be reused by any open.
            fds = ck.staging.fds
            dir_fd = os.dup(fds.staging)
            parent_fd = os.dup(fds.parent)
            name = ck.staging.path.name
            ck.streams[index] = handle
            ck.names.update(e.name for e in entries)
            ck.last_activity = time.monotonic()
            if ck.first_submit is None:
                ck.first_submit = time.monotonic()
        try:
            moved = not dirs.is_entry(name, parent_fd, dir_fd)
        finally:
            os.close(parent_fd)
        if moved:  # as the write workers check: an aborted job's, or replaced
            os.close(dir_fd)
            self._end(ck, index, entries, b"", None, 0)
            raise CheckpointIOError(errno.ESTALE, f"the staging directory of {ck.relpath} was "
                                                  "moved or removed")
        return dir_fd

    def _end(self, ck: Checkpoint, index: int, entries: list[safetensors_file.ParsedEntry],
             header: bytes, crcs: list[int] | None, size: int) -> None:
        r = self.registry
        with r.cond:
            del ck.streams[index]
            if crcs is None:
                ck.names.difference_update(e.name for e in entries)
            elif not ck.terminal:
                ck.submitted.add(index)
                ck.bytes_total += size
                ck.record_file(index, size, len(header), entries, crcs)
                ck.last_activity = time.monotonic()
            r.release(ck)
            r.cond.notify_all()

    def reap_stalled(self, now: float, timeout: float) -> None:
        """Cancel the streams that sent nothing for `timeout` seconds, so that
        a stalled client does not hold a slot for ever. Called with the
        registry's lock held."""
        for ck in self.registry.checkpoints.values():
            for index, handle in ck.streams.items():
                if handle.last_chunk is not None and now - handle.last_chunk > timeout:
                    logs.warning("stream-stalled", checkpoint=ck.id, file=index,
                                 seconds=round(now - handle.last_chunk))
                    handle.last_chunk = None  # cancelled once
                    handle.cancel()
