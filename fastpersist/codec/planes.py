"""Byte planes: each element's bytes regrouped so that like bytes sit together.

The bytes of a trained float tensor are far from alike: the exponent byte of
each element takes a few dozen values out of 256, the low mantissa bytes are
close to random. Compressed as they lie in memory, the two are mixed and the
entropy coder sees neither; split into planes (byte 0 of every element, then
byte 1, ...), the exponent plane compresses to about a third and the others
are stored as they are (ZipNN, arXiv 2411.05239).

For floats, each element is first rotated left by one bit, so the sign moves
to the lowest bit (among the random mantissa bits) and the highest byte holds
exactly the exponent (8 bits for bf16, fp32 and complex64's halves; the top 8
of fp64's 11). fp16's exponent is 5 bits, not a byte: its bytes are split
as they are, like the integers'. The transform is a bijection on each unit:
decoding rotates back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import dtypes


@dataclass(frozen=True)
class Grouping:
    """How a dtype's elements are cut into planes: `unit` bytes (one plane
    each), rotated first when `rotate`. `floats`: the planes are float bytes,
    which only an entropy coder compresses (frame.py codes them without
    looking for repeats); integers' planes may repeat, and are not."""

    unit: int
    rotate: bool
    floats: bool = False


# Multi-byte dtypes; every 1-byte dtype is one plane, unrotated.
_GROUPINGS = {
    "BF16": Grouping(2, True, True), "F32": Grouping(4, True, True),
    "F64": Grouping(8, True, True),
    "C64": Grouping(4, True, True),  # two float32s
    "F16": Grouping(2, False, True),
    "I16": Grouping(2, False), "U16": Grouping(2, False),
    "I32": Grouping(4, False), "U32": Grouping(4, False),
    "I64": Grouping(8, False), "U64": Grouping(8, False),
}
_FLOAT8 = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
_UINT: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def grouping_for(dtype: str) -> Grouping:
    """The grouping of a safetensors dtype name (KeyError if unknown)."""
    g = _GROUPINGS.get(dtype)
    if g is not None:
        return g
    if dtypes.itemsize(dtype) != 1:  # every dtype the format knows is listed above
        raise KeyError(dtype)
    return Grouping(1, False, dtype in _FLOAT8)


def split(raw: memoryview, g: Grouping) -> np.ndarray:
    """(numpy; frame.py uses the C extension's split where it is built.)
    The planes of `raw` (whose length is a multiple of g.unit) as a
    (unit, n) array: row j holds byte j (little-endian) of every unit."""
    n = len(raw) // g.unit
    a = np.frombuffer(raw, dtype=_UINT[g.unit], count=n)
    if g.unit == 1:
        return a.reshape(1, n).view(np.uint8)
    if g.rotate:
        bits = 8 * g.unit
        r = np.left_shift(a, 1)
        tmp = np.right_shift(a, bits - 1)
        np.bitwise_or(r, tmp, out=r)
        a = r
    planes = np.empty((g.unit, n), dtype=np.uint8)
    np.copyto(planes, a.view(np.uint8).reshape(n, g.unit).T)
    return planes


def merge(planes: Sequence[np.ndarray], g: Grouping, out: memoryview) -> None:
    """(numpy, as split.) Write the units that `planes` (split's rows, each n
    bytes) hold into `out`."""
    n = len(planes[0])
    target = np.frombuffer(out, dtype=np.uint8, count=n * g.unit).reshape(n, g.unit)
    for j, plane in enumerate(planes):  # plane by plane: long inner loops
        np.copyto(target[:, j], plane)
    if g.rotate:
        bits = 8 * g.unit
        a = target.view(_UINT[g.unit])
        tmp = np.right_shift(a, 1)
        np.left_shift(a, bits - 1, out=a)
        np.bitwise_or(a, tmp, out=a)
