"""CRC32C and the CRC32C of consecutive pieces from theirs: the C engine's,
or the `crc32c` package's where the extension is missing (slower, the same
values). Torch- and numpy-free."""

from __future__ import annotations

from collections.abc import Sequence

try:
    from ._engine import crc32c, crc32c_combine
except ImportError:  # no C extension (the reference engine's case)
    from crc32c import crc32c

    def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
        # CRC32C is affine: crc(A+B) = crc(zeros, from crc(A)) ^ crc(zeros) ^ crc(B).
        zeros = bytes(len2)
        return int(crc32c(zeros, crc1) ^ crc32c(zeros) ^ crc2)


def combine(crcs: Sequence[tuple[int, int]]) -> int:
    """The CRC32C of consecutive pieces from (crc, length) of each (0: none)."""
    crc = 0
    for i, (c, n) in enumerate(crcs):
        crc = crc32c_combine(crc, c, n) if i else c
    return crc


def block_spans(nbytes: int, block: int) -> list[tuple[int, int]]:
    """(start, length) of each `block`-sized piece of nbytes (the last one
    shorter), each under a CRC32C of its own; one span (the whole) when block
    is 0 or not smaller."""
    if not block or nbytes <= block:
        return [(0, nbytes)]
    return [(s, min(block, nbytes - s)) for s in range(0, nbytes, block)]


__all__ = ["block_spans", "combine", "crc32c", "crc32c_combine"]
