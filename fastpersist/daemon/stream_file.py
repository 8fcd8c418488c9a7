"""One streamed data file, written to disk while its bytes arrive.

A StreamFile is fed the data section of a data file in order, in pieces of
any size (gRPC chunks). It copies them into one of its slot's two page-aligned
blocks; a full block is written by the slot's I/O thread while the other block
fills, and the feeder waits for a block's write before filling it again, so a
stream is never read faster than its file is written and never holds more
than two blocks. Each tensor's CRC32C is carried across pieces as they pass.
The result is the file, and the CRCs, that the engine's write_file makes of
the same header and bytes (tests/test_stream_file.py checks, byte for byte).

I/O as the engine does it: O_DIRECT where the file system takes it (the block
addresses, lengths and offsets are aligned; the last block is padded and the
file truncated back), buffered otherwise (FASTPERSIST_DIRECT=auto falls back,
=on fails), and fsync before the file counts as written. Buffered writes are
flushed every SYNC_BYTES, so that the page cache charged to the daemon does
not grow with the file.

Why Python rather than the C engine: the bytes arrive one gRPC message at a
time through Python anyway; what the writer adds per chunk is one copy
(memcpy, under the GIL) and one CRC32C (the engine's, GIL released), and its
writes are the large aligned pwrites the engine makes, on a thread that
releases the GIL. Measured here (benchmarks/daemon_stream.py, 1 GiB, medians
of 5, a loaded 2-core VM): copy + CRC 2.6 GB/s; the writer 0.98 GB/s, the
engine's write_file with one thread (one write in flight, as here) 0.81, with
its default 8 threads 1.39; a whole stream through the daemon 0.44..0.60. The
stream is bounded by gRPC, not by this writer, and a C writer object would be
the same I/O with a cheaper copy: more code in the extension for no gain.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import knobs
from ..storage import dirs

# Buffered writes (no O_DIRECT) are made durable and dropped from the page
# cache every this many bytes.
SYNC_BYTES = 64 << 20


def _crc_function() -> Callable[[Any, int], int]:
    """The engine's CRC32C (hardware, GIL released); the `crc32c` package where
    the extension is missing, as the reference engine uses. Same values."""
    try:
        from .. import _engine

        return _engine.crc32c
    except ImportError:
        import crc32c

        return lambda data, value: int(crc32c.crc32c(data, value))


crc32c = _crc_function()


class Slot:
    """Two aligned blocks and the thread that writes them: the memory of one
    stream in progress. Made once and reused by the streams that follow."""

    def __init__(self, block: int) -> None:
        if block <= 0 or block % knobs.ALIGNMENT:
            raise ValueError(f"a stream block of {block} bytes is not a positive multiple of "
                             f"{knobs.ALIGNMENT}")
        self.block = block
        # Anonymous mappings are page-aligned, as O_DIRECT needs.
        self.views = [memoryview(mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
                      for _ in range(2)]
        self.io = ThreadPoolExecutor(1, thread_name_prefix="fpd-stream-io")

    @property
    def nbytes(self) -> int:
        return 2 * self.block


class Slots:
    """At most `count` slots, handed out one per stream; a stream that finds
    them all in use waits for one."""

    def __init__(self, count: int, block: int) -> None:
        if count < 1:
            raise ValueError("at least one stream slot is needed")
        self.count = count
        self.block = block
        self._free: list[Slot] = []
        self._made = 0
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """The most memory the slots hold: what the streams' buffers cost."""
        return self.count * 2 * self.block

    def acquire(self, waiting: Callable[[], bool]) -> Slot | None:
        """A free slot; None once `waiting()` says to stop waiting (polled each second)."""
        with self._cond:
            while not self._free and self._made >= self.count:
                if not waiting():
                    return None
                self._cond.wait(1.0)
            if self._free:
                return self._free.pop()  # the most recently used: its pages are resident
            self._made += 1
        try:
            return Slot(self.block)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def release(self, slot: Slot) -> None:
        """Give a slot back; its blocks must have no write in flight."""
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


class StreamFile:
    """The data file `name` in the directory `dir_fd`: `header`, then data
    sections of the given lengths (the tensors, in file order), fed in order."""

    def __init__(self, slot: Slot, dir_fd: int, name: str, header: bytes,
                 lengths: Sequence[int], direct: str = "auto") -> None:
        self.name = name
        self.size = len(header) + sum(lengths)
        self.received = 0  # data bytes fed so far
        self.crcs = [crc32c(header, 0)] + [0] * len(lengths)  # header, then each tensor
        self.direct = False
        self._slot = slot
        self._dir_fd = dir_fd
        self._header = header
        self._lengths = list(lengths)
        self._mode = direct
        self._fd = -1
        self._entry = -1  # the tensor the next data byte belongs to
        self._left = 0  # its bytes still to come
        self._next_entry()
        self._cur = 0  # the block being filled
        self._fill = 0  # bytes in it
        self._offset = 0  # the file offset of its first byte
        self._writes: list[Future[None] | None] = [None, None]
        self._unsynced = 0

    # -- the feeder's side ----------------------------------------------------------

    def open(self) -> None:
        """Create the file (a new one: O_EXCL, never through a link) and put
        the header in the first block."""
        self._fd, self.direct = _create(self._dir_fd, self.name, self._mode)
        self._put(memoryview(self._header))

    def feed(self, data: memoryview) -> None:
        """The next bytes of the data section. Blocks while both blocks wait
        for the disk."""
        if self.received + len(data) > self.size - len(self._header):
            raise ValueError(f"{self.name}: more data than the header's tensors hold")
        pos = 0
        while pos < len(data):  # the CRC of each tensor the piece spans
            take = min(self._left, len(data) - pos)
            i = self._entry + 1
            self.crcs[i] = crc32c(data[pos:pos + take], self.crcs[i])
            pos += take
            self._left -= take
            if self._left == 0:
                self._next_entry()
        self._put(data)
        self.received += len(data)

    def finish(self) -> list[int]:
        """Write what is left, truncate to size, fsync, close. On return the
        file's data and size are durable (its directory entry is not). Returns
        the CRC32C of the header, then of each tensor."""
        if self._fill:
            self._flush()
        self._wait(0)
        self._wait(1)
        os.ftruncate(self._fd, self.size)  # the last block's padding goes
        os.fsync(self._fd)
        fd, self._fd = self._fd, -1
        os.close(fd)
        return self.crcs

    def discard(self) -> None:
        """After a failure: wait for the writes in flight (the slot's blocks
        are reused only when no write reads them), then remove the file."""
        for i in (0, 1):
            with contextlib.suppress(OSError):
                self._wait(i)
        if self._fd < 0:
            return
        try:
            if dirs.is_entry(self.name, self._dir_fd, self._fd):
                os.unlink(self.name, dir_fd=self._dir_fd)
        except OSError:
            pass  # the directory went with its checkpoint
        finally:
            os.close(self._fd)
            self._fd = -1

    def _next_entry(self) -> None:
        self._entry += 1
        while self._entry < len(self._lengths) and self._lengths[self._entry] == 0:
            self._entry += 1
        self._left = self._lengths[self._entry] if self._entry < len(self._lengths) else 0

    def _put(self, data: memoryview) -> None:
        pos = 0
        block = self._slot.block
        while pos < len(data):
            take = min(block - self._fill, len(data) - pos)
            self._slot.views[self._cur][self._fill:self._fill + take] = data[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == block:
                self._flush()

    def _flush(self) -> None:
        """Hand the current block to the I/O thread; go on with the other one
        once its previous write is done."""
        length = _round_up(self._fill, knobs.ALIGNMENT)  # only the last block is short
        view = self._slot.views[self._cur]
        if length > self._fill:
            view[self._fill:length] = bytes(length - self._fill)
        self._writes[self._cur] = self._slot.io.submit(self._write, self._cur, length,
                                                       self._offset)
        self._offset += length
        self._cur ^= 1
        self._fill = 0
        self._wait(self._cur)

    def _wait(self, i: int) -> None:
        write, self._writes[i] = self._writes[i], None
        if write is not None:
            write.result()

    # -- the I/O thread's side --------------------------------------------------------

    def _write(self, i: int, length: int, offset: int) -> None:
        view = self._slot.views[i]
        done = 0
        while done < length:
            try:
                done += os.pwrite(self._fd, view[done:length], offset + done)
            except OSError as exc:
                # Some file systems accept O_DIRECT at open and refuse the I/O
                # (as the engine finds too): go on buffered, on the same file.
                if exc.errno != errno.EINVAL or not self.direct or self._mode != "auto":
                    raise
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                self.direct = False
        if not self.direct:
            self._unsynced += length
            if self._unsynced >= SYNC_BYTES:
                os.fdatasync(self._fd)
                os.posix_fadvise(self._fd, 0, offset + length, os.POSIX_FADV_DONTNEED)
                self._unsynced = 0


def _create(dir_fd: int, name: str, mode: str) -> tuple[int, bool]:
    """A new file `name` in `dir_fd` (O_EXCL, O_NOFOLLOW), with O_DIRECT as
    `mode` asks ("auto": where the file system takes it). Returns (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if mode != "off":
        try:
            return os.open(name, flags | os.O_DIRECT, 0o644, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL or mode == "on":
                raise
            # Refused after the file was made (older tmpfs): it is ours, empty.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
    return os.open(name, flags, 0o644, dir_fd=dir_fd), False
