"""Items as bytes: their record names, their CRC32C blocks, and which blocks a
box of a stored chunk touches.

Every item (a tensor chunk or a bytes value) is one tensor record of a data
file, with the CRC32C of all its bytes in the manifest. An item larger than
CRC_BLOCK also has the CRC32C of each CRC_BLOCK-sized block of it (the last one
shorter), kept in the DCP metadata: a load that needs only part of an item
(resharding) reads the blocks that hold that part and checks each block's
CRC32C, so every byte it uses is verified without reading the whole item.
Torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

# A multiple of 4096 and of every element size, so a block boundary is an
# element boundary and O_DIRECT-friendly within the item.
CRC_BLOCK = 4 << 20


def record_name(fqn: str, offsets: Sequence[int] | None) -> str:
    """The tensor record (and safetensors key) of an item: unique per
    (fqn, offsets), and never "__metadata__". '@' in the fqn is doubled, so
    the text after the last single '@' is the chunk's offsets (or "bytes")."""
    where = "bytes" if offsets is None else ",".join(str(o) for o in offsets)
    return f"{fqn.replace('@', '@@')}@{where}"


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return list(reversed(strides))


def is_whole(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> bool:
    return all(o == 0 and n == d for o, n, d in zip(offsets, lengths, shape, strict=True))


def touched_blocks(shape: Sequence[int], itemsize: int, offsets: Sequence[int],
                   lengths: Sequence[int], block: int = CRC_BLOCK) -> set[int]:
    """The CRC blocks of a row-major item of `shape` that hold a byte of the
    box [offsets, offsets + lengths)."""
    if any(n == 0 for n in lengths):
        return set()
    strides = contiguous_strides(shape)
    # k: the last dimension the box does not span whole; below it the box is
    # one run of bytes per index of the dimensions above it.
    partial = [j for j in range(len(shape)) if (offsets[j], lengths[j]) != (0, shape[j])]
    if not partial:
        return set(range(math.ceil(numel(shape) * itemsize / block)))
    k = partial[-1]
    run = lengths[k] * strides[k] * itemsize
    base = sum(o * s for o, s in zip(offsets, strides, strict=True)) * itemsize

    def extent(dims: range) -> int:
        """Bytes from a run's start to the end of the last run below it in `dims`."""
        return sum((lengths[m] - 1) * strides[m] for m in dims) * itemsize + run

    # The box's runs, in order, are grouped by the dimensions above k; a step
    # in dimension j jumps over a gap that only grows as j gets shallower. The
    # runs under one index of dimensions 0..J, J the deepest whose gap is at
    # least a block, touch every block from their first byte to their last;
    # those groups lie a block or more apart, so there are fewer of them than
    # the item has blocks.
    deep = -1
    for j in range(k):
        gap = strides[j] * itemsize - extent(range(j + 1, k))
        if lengths[j] > 1 and gap >= block:
            deep = j
    size = extent(range(deep + 1, k))
    out: set[int] = set()
    for index in itertools.product(*(range(n) for n in lengths[:deep + 1])):
        start = base + sum(i * s for i, s in zip(index, strides, strict=False)) * itemsize
        out.update(range(start // block, -(-(start + size) // block)))
    return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
