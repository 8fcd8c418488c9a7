"""A distributed checkpoint's global tensors, each stored as chunks that must
tile it exactly: every element in exactly one chunk, each record in at most
one chunk. Otherwise a load would return uninitialised memory where nothing
covers an element, or one record's bytes in two places.

Exact tiling is checked with corners. A box [lo, hi) is, as a function on the
integer grid, the prefix sum of its signed corners: +1 at each corner made of
lo's and hi's with an even number of hi's, -1 with an odd number. Summing is
linear and the prefix sum invertible, so the chunks cover every element of
the global box exactly once if and only if their signed corners add up to the
global box's own corners. That costs (chunks x 2**d) for d the dimensions the
chunks actually cut, with no assumption about their layout (grids, row pieces,
bricks); the cost is bounded up front, in proportion to the manifest's size.
Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import dtypes
from .bounds import is_int, malformed, numel, shape_problem, short
from .records import TensorRecord

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, shape

# Corners the tiling check may visit: this many, or 8 a chunk (three cut
# dimensions) if the manifest has more chunks, whichever is larger.
MIN_CORNER_BUDGET = 1 << 22


class Chunk(NamedTuple):
    """A named tuple: a job's manifest has one per piece (hundreds of
    thousands at scale), built at every save and every load."""

    tensor: int  # index into Manifest.tensors
    offsets: tuple[int, ...]  # where the chunk starts in the global tensor


@dataclass(frozen=True)
class GlobalTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def parse_globals(raw: Any, tensors: Sequence[TensorRecord], where: str
                  ) -> tuple[GlobalTensor, ...]:
    if not isinstance(raw, list):
        raise malformed(where, "'globals' must be a list")
    out: list[GlobalTensor] = []
    names: dict[str, int] = {}
    user: dict[int, tuple[int, int]] = {}  # record index -> (global, chunk) that uses it
    total_chunks = sum(len(g["chunks"]) for g in raw
                       if isinstance(g, dict) and isinstance(g.get("chunks"), list))
    budget = max(MIN_CORNER_BUDGET, 8 * total_chunks)
    for i, g in enumerate(raw):
        ctx = f"globals[{i}]"
        if not isinstance(g, dict):
            raise malformed(where, f"{ctx} is not an object")
        name = g.get("name")
        if not isinstance(name, str):
            raise malformed(where, f"{ctx}: 'name' must be a string, not {short(name)}")
        if name in names:
            # Loading with like= finds a global by its name.
            raise malformed(where, f"{ctx}: duplicate name {short(name)} (also "
                            f"globals[{names[name]}])")
        names[name] = i
        ctx = f"{ctx} ({short(name)})"
        dtype, shape, raw_chunks = g.get("dtype"), g.get("shape"), g.get("chunks")
        if not isinstance(dtype, str) or dtype not in dtypes.SUPPORTED_NAMES:
            raise malformed(where, f"{ctx}: unknown dtype {short(dtype)}")
        problem = shape_problem(shape)
        if problem is not None:
            raise malformed(where, f"{ctx}: shape {short(shape)} {problem}")
        if not isinstance(raw_chunks, list):
            raise malformed(where, f"{ctx}: 'chunks' must be a list")
        dims: tuple[int, ...] = tuple(shape)  # type: ignore[arg-type]  # checked above
        chunks = tuple(_chunk(c, (i, j), dims, dtype, tensors, user, where, ctx)
                       for j, c in enumerate(raw_chunks))
        budget -= _check_tiling(dims, [(c.offsets, tensors[c.tensor].shape) for c in chunks],
                                budget, where, ctx)
        out.append(GlobalTensor(name, dtype, dims, chunks))
    return tuple(out)


def _chunk(c: Any, at: tuple[int, int], shape: tuple[int, ...], dtype: str,
           tensors: Sequence[TensorRecord], user: dict[int, tuple[int, int]], where: str,
           ctx: str) -> Chunk:
    """Chunk at[1] of global at[0]; messages are made only when raised (a
    manifest may hold millions of chunks)."""
    j = at[1]
    if not isinstance(c, dict):
        raise malformed(where, f"{ctx}: chunk {j} is not an object")
    index, offsets = c.get("tensor"), c.get("offsets")
    if not is_int(index, 0, len(tensors) - 1):
        raise malformed(where, f"{ctx}: chunk {j} refers to tensor {short(index)}, not one "
                        f"of the {len(tensors)} tensors")
    t = tensors[index]
    if index in user:
        # Two chunks would show the same bytes in two places.
        raise malformed(where, f"{ctx}: chunk {j} ({short(t.name)}): tensors[{index}] "
                        f"({short(t.name)}) is used by two chunks (also globals"
                        f"[{user[index][0]}] chunk {user[index][1]})")
    user[index] = at
    if t.dtype != dtype:
        raise malformed(where, f"{ctx}: chunk {j} ({short(t.name)}) of dtype {t.dtype} does "
                        f"not fit a tensor of dtype {dtype}")
    if (not isinstance(offsets, list) or len(offsets) != len(shape) or len(t.shape) != len(shape)
            or not all(is_int(o, 0, d) and o + n <= d
                       for o, n, d in zip(offsets, t.shape, shape, strict=True))):
        raise malformed(where, f"{ctx}: chunk {j} ({short(t.name)}) at {short(offsets)} of "
                        f"shape {list(t.shape)} does not fit in {list(shape)}")
    return Chunk(index, tuple(offsets))


def _check_tiling(shape: tuple[int, ...], boxes: list[Box], budget: int, where: str,
                  ctx: str) -> int:
    """Raise unless the boxes (each within `shape`) tile it exactly; returns the
    corners visited, which must stay within `budget`."""
    held = sum(numel(s) for _, s in boxes)
    if held != numel(shape):
        raise malformed(where, f"{ctx}: chunks hold {held} elements of {numel(shape)}")
    # Empty chunks cover nothing; dimensions no chunk cuts change nothing.
    full = [(o, s) for o, s in boxes if numel(s)]
    cut = [d for d in range(len(shape))
           if any(o[d] != 0 or s[d] != shape[d] for o, s in full)]
    cost = len(full) << len(cut)
    if cost > budget:
        raise malformed(where, f"{ctx}: {len(full)} chunks cut {len(cut)} dimensions: too "
                        "many corners to check that they tile the tensor")
    counts: dict[tuple[int, ...], int] = {}
    for o, s in full:
        for corner, sign in _corners([o[d] for d in cut], [o[d] + s[d] for d in cut]):
            counts[corner] = counts.get(corner, 0) + sign
    expected = dict(_corners([0] * len(cut), [shape[d] for d in cut])) if full else {}
    if {k: v for k, v in counts.items() if v} != expected:
        raise malformed(where, f"{ctx}: chunks overlap or leave a gap")
    return cost


def _corners(lo: list[int], hi: list[int]) -> list[tuple[tuple[int, ...], int]]:
    """The 2**len(lo) corners of the box [lo, hi) with their signs."""
    out = []
    for pick in itertools.product((0, 1), repeat=len(lo)):
        corner = tuple(h if p else low for low, h, p in zip(lo, hi, pick, strict=True))
        out.append((corner, -1 if sum(pick) % 2 else 1))
    return out
