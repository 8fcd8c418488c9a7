"""What every engine is: the Engine interface, its segments and its result.

A module of its own so that the engines (native.py, reference.py) and the
package that picks one (__init__.py) import it, and not each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Segment = tuple[Any, int]  # (object with the buffer protocol, file offset)
# A read's segment whose bytes are checksummed and not kept: (None, offset, length).
Unkept = tuple[None, int, int]


@dataclass(frozen=True)
class IOResult:
    crcs: list[int] | None  # CRC32C of each segment, in the order given
    direct: bool  # whether O_DIRECT was used


class Engine(Protocol):
    name: str

    def write_file(
        self, path: str, segments: Sequence[Segment], size: int, *, fsync: bool = True,
        dir_fd: int | None = None, buffered: bool = False,
    ) -> IOResult:
        """Write `size` bytes: each segment at its offset, zeros in gaps.

        buffered: through the page cache, without trying O_DIRECT (a file on
        a memory file system, such as the daemon's memory tier).

        Segments are sorted by offset and do not overlap. With fsync the file's
        data and size are durable on return (its directory entry is not).
        With dir_fd (an open directory), `path` is the plain name of a new file
        in it, created with O_EXCL | O_NOFOLLOW: nothing that exists there is
        written through (FileExistsError). Raises OSError, or ValueError for a
        malformed segment list.
        """
        ...

    def read_file(
        self, path: str, segments: Sequence[Segment | Unkept], *, checksum: bool = True,
        region: Segment | None = None, bounce: bool = False,
    ) -> IOResult:
        """Fill each writable segment from the file; an Unkept one is only read
        for its CRC32C (a verify needs no memory for the bytes it checks).
        Raises EOFError when the file is shorter than a segment needs, OSError
        otherwise.

        region, a hint: a writable buffer laid out as the file from its offset,
        of which (some) segments are views at their own offsets; an engine may
        then read the whole span into it with large I/Os (the bytes between
        those segments included) instead of segment by segment.

        bounce, a hint: read nothing straight into the segments' memory with
        O_DIRECT (the region included); every block lands in the engine's
        bounce buffers and is copied into place as it is checksummed."""
        ...

    def copy(self, dst: Any, src: Any) -> int:
        """dst[:] = src (same length); returns the CRC32C of the bytes. src is
        memory that may fault as write_file's segments may: a client's shared
        memory that it truncated under fastpersistd. The native engine turns
        the SIGBUS into OSError(EFAULT), as it does for its writes, and
        checksums as it copies; the reference engine, which guards neither,
        lets it kill the process."""
        ...
