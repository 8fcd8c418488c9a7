"""The I/O engines: write and read lists of (buffer, file offset) with CRC32C.

Two engines share one interface. `native` is the C extension (parallel
O_DIRECT, GIL released). `python` is the reference: plain buffered writes in
file order, checksums from the `crc32c` package. The reference is the oracle
of the differential tests and the fallback where the extension is missing.
FASTPERSIST_ENGINE picks one; `native` is the default.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import knobs

Segment = tuple[Any, int]  # (object with the buffer protocol, file offset)


@dataclass(frozen=True)
class IOResult:
    crcs: list[int] | None  # CRC32C of each segment, in the order given
    direct: bool  # whether O_DIRECT was used


class Engine(Protocol):
    name: str

    def write_file(
        self, path: str, segments: Sequence[Segment], size: int, *, fsync: bool = True,
        dir_fd: int | None = None,
    ) -> IOResult:
        """Write `size` bytes: each segment at its offset, zeros in gaps.

        Segments are sorted by offset and do not overlap. With fsync the file's
        data and size are durable on return (its directory entry is not).
        With dir_fd (an open directory), `path` is the plain name of a new file
        in it, created with O_EXCL | O_NOFOLLOW: nothing that exists there is
        written through (FileExistsError). Raises OSError, or ValueError for a
        malformed segment list.
        """
        ...

    def read_file(
        self, path: str, segments: Sequence[Segment], *, checksum: bool = True
    ) -> IOResult:
        """Fill each writable segment from the file. Raises EOFError when the
        file is shorter than a segment needs, OSError otherwise."""
        ...


_warned_fallback = False


def get_engine(name: str | None = None) -> Engine:
    """The engine `name` (default: FASTPERSIST_ENGINE), falling back to the
    reference engine with one warning when the C extension cannot be imported."""
    global _warned_fallback
    name = name or knobs.current().engine
    if name == "native":
        try:
            from .native import NativeEngine

            return NativeEngine()
        except ImportError as exc:
            if not _warned_fallback:
                warnings.warn(
                    f"fastpersist's C engine is unavailable ({exc}); using the slower "
                    "pure-Python reference engine",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _warned_fallback = True
    from .reference import ReferenceEngine

    return ReferenceEngine()


__all__ = ["Engine", "IOResult", "Segment", "get_engine"]
