"""The reference engine: the simplest code that writes the same bytes.

Buffered writes in file order, then fsync; buffered reads. It is the oracle
for the C engine's differential tests and the fallback where the extension
cannot be built. Checksums come from the `crc32c` package, which is
independent of the C engine's CRC code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

from .types import IOResult, Segment, Unkept

_ZEROS = bytes(1 << 20)


def _write_zeros(fd: int, offset: int, count: int) -> None:
    while count:
        n = os.pwrite(fd, _ZEROS[: min(count, len(_ZEROS))], offset)
        offset += n
        count -= n


def _check(segments: Sequence[tuple[memoryview, int]], size: int) -> None:
    prev_end = 0
    for i, (view, offset) in enumerate(segments):
        if offset < prev_end or offset + view.nbytes > size:
            raise ValueError(
                f"segment {i} (offset {offset}, length {view.nbytes}) overlaps its "
                f"predecessor or ends past the file size {size}"
            )
        prev_end = offset + view.nbytes


class ReferenceEngine:
    name = "python"

    def copy(self, dst: Any, src: Any) -> int:
        out = memoryview(dst).cast("B")
        out[:] = memoryview(src).cast("B")
        return int(_crc32c.crc32c(out))

    def write_file(
        self, path: str, segments: Sequence[Segment], size: int, *, fsync: bool = True,
        dir_fd: int | None = None, buffered: bool = False,
    ) -> IOResult:
        del buffered  # always buffered
        views = [(memoryview(buf).cast("B"), offset) for buf, offset in segments]
        _check(views, size)
        if dir_fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        elif "/" in path or path in ("", ".", ".."):
            raise ValueError(f"{path} is not a plain file name")
        else:  # a new file of ours in the directory, as the C engine does
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644, dir_fd=dir_fd)
        try:
            cursor = 0
            crcs = []
            for view, offset in views:
                _write_zeros(fd, cursor, offset - cursor)
                done = 0
                while done < view.nbytes:
                    done += os.pwrite(fd, view[done:], offset + done)
                crcs.append(_crc32c.crc32c(view))
                cursor = offset + view.nbytes
            _write_zeros(fd, cursor, size - cursor)
            os.ftruncate(fd, size)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return IOResult(crcs=crcs, direct=False)

    def read_file(
        self, path: str, segments: Sequence[Segment | Unkept], *, checksum: bool = True,
        region: Segment | None = None, bounce: bool = False,
    ) -> IOResult:
        del region, bounce  # hints for speed: buffered reads in place give the same bytes
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            crcs = []
            for buf, offset, *length in segments:
                # (An unkept segment is read into memory dropped after its CRC.)
                view = memoryview(bytearray(length[0]) if buf is None else buf).cast("B")
                done = 0
                while done < view.nbytes:
                    n = os.preadv(fd, [view[done:]], offset + done)
                    if n == 0:
                        raise EOFError(
                            f"{path}: file is truncated: it ends at byte {offset + done} but "
                            f"bytes {offset}..{offset + view.nbytes} are needed"
                        )
                    done += n
                if checksum:
                    crcs.append(_crc32c.crc32c(view))
        finally:
            os.close(fd)
        return IOResult(crcs=crcs if checksum else None, direct=False)
