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

From schema version 3 a global may leave out "chunks": its chunks are then
implied by the tensor records' names, `<global name>@<offsets>` (the names a
distributed save gives its pieces), so that a large job's coordinator need not
list hundreds of thousands of them. Implied chunks are derived in one pass
over the records and then checked exactly as listed ones are.
Torch-free.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
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

# The first schema version in which a global may leave out "chunks".
IMPLIED_CHUNKS_SCHEMA_VERSION = 3

# The offsets in a chunk record's name, canonical: one spelling per offsets, so
# that no two names can mean one chunk and a name's text is its offsets. Empty
# for a 0-dim global.
_OFFSETS = re.compile(r"(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*|")
# An offset of more digits exceeds every dimension (at most 2**60): it is kept
# as text, never converted (int() of a 5,000-digit string raises), and the
# chunk then fails the same "does not fit" check as any offset out of range.
_MAX_OFFSET_DIGITS = 19


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
    # The manifest leaves out "chunks": they are the records named
    # `<name>@<offsets>` (schema version 3). `chunks` holds them all the same,
    # so that readers need not tell; the writer needs it to write the global back
    # as it was read (and then writes no chunks: whoever sets it must have named
    # the records so).
    implied: bool = False


def parse_globals(raw: Any, tensors: Sequence[TensorRecord], where: str, version: int
                  ) -> tuple[GlobalTensor, ...]:
    if not isinstance(raw, list):
        raise malformed(where, "'globals' must be a list")
    out: list[GlobalTensor] = []
    names: dict[str, int] = {}
    user: dict[int, tuple[int, int]] = {}  # record index -> (global, chunk) that uses it
    implied = implied_chunks(raw, tensors) if version >= IMPLIED_CHUNKS_SCHEMA_VERSION else {}
    total_chunks = sum(len(g["chunks"]) for g in raw
                       if isinstance(g, dict) and isinstance(g.get("chunks"), list))
    total_chunks += sum(len(c) for c in implied.values())
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
        dtype, shape = g.get("dtype"), g.get("shape")
        if not isinstance(dtype, str) or dtype not in dtypes.SUPPORTED_NAMES:
            raise malformed(where, f"{ctx}: unknown dtype {short(dtype)}")
        problem = shape_problem(shape)
        if problem is not None:
            raise malformed(where, f"{ctx}: shape {short(shape)} {problem}")
        dims: tuple[int, ...] = tuple(shape)  # type: ignore[arg-type]  # checked above
        is_implied = "chunks" not in g and version >= IMPLIED_CHUNKS_SCHEMA_VERSION
        if is_implied:
            chunks = tuple(_chunk(index, offsets, (i, j), dims, dtype, tensors, user, where,
                                  ctx) for j, (index, offsets) in enumerate(implied[name]))
        else:
            raw_chunks = g.get("chunks")
            if not isinstance(raw_chunks, list):
                raise malformed(where, f"{ctx}: 'chunks' must be a list" + (
                    "" if "chunks" in g else f" (a global may leave it out only from schema "
                    f"version {IMPLIED_CHUNKS_SCHEMA_VERSION}; this manifest is {version})"))
            chunks = tuple(_listed_chunk(c, (i, j), dims, dtype, tensors, user, where, ctx)
                           for j, c in enumerate(raw_chunks))
        budget -= _check_tiling(dims, [(c.offsets, tensors[c.tensor].shape) for c in chunks],
                                budget, where, ctx)
        out.append(GlobalTensor(name, dtype, dims, chunks, is_implied))
    return tuple(out)


def implied_chunks(raw: list[Any], tensors: Sequence[TensorRecord]
                   ) -> dict[str, list[tuple[int, tuple[Any, ...]]]]:
    """For each global of `raw` that leaves out "chunks" (by name), its chunks
    as (record index, offsets), in the records' order: every record named
    `<name>@<offsets>`, split at the last "@", with offsets in canonical form.
    Unchecked (parse_globals checks them). One pass over the records: a
    manifest holds hundreds of thousands."""
    out: dict[str, list[tuple[int, tuple[Any, ...]]]] = {
        g["name"]: [] for g in raw
        if isinstance(g, dict) and "chunks" not in g and isinstance(g.get("name"), str)}
    if not out:
        return out
    # The offsets of each spelling, None where it is not canonical: a job's
    # layers are cut alike, so most spellings recur, and the lookup halves the
    # time of a pass (the lists are shared; nothing changes them).
    seen: dict[str, tuple[Any, ...] | None] = {}
    for index, t in enumerate(tensors):
        name = t.name
        at = name.rfind("@")
        if at < 0:
            continue
        chunks = out.get(name[:at])
        if chunks is None:
            continue
        text = name[at + 1:]
        offsets = seen.get(text, _UNSEEN)
        if offsets is _UNSEEN:
            offsets = seen[text] = _offsets(text)
        if offsets is not None:  # else no chunk's name (one meant as one leaves a gap)
            chunks.append((index, offsets))
    return out


_UNSEEN: Any = object()


def _offsets(text: str) -> tuple[Any, ...] | None:
    """The offsets a chunk's name spells after its last "@", or None. A tuple,
    shared by every chunk of that spelling (its Chunk's own)."""
    if _OFFSETS.fullmatch(text) is None:
        return None
    return tuple(int(o) if len(o) <= _MAX_OFFSET_DIGITS else o
                 for o in text.split(",")) if text else ()


def _listed_chunk(c: Any, at: tuple[int, int], shape: tuple[int, ...], dtype: str,
                  tensors: Sequence[TensorRecord], user: dict[int, tuple[int, int]],
                  where: str, ctx: str) -> Chunk:
    """Chunk at[1] of global at[0], as "chunks" lists it."""
    if not isinstance(c, dict):
        raise malformed(where, f"{ctx}: chunk {at[1]} is not an object")
    index = c.get("tensor")
    if not is_int(index, 0, len(tensors) - 1):
        raise malformed(where, f"{ctx}: chunk {at[1]} refers to tensor {short(index)}, not "
                        f"one of the {len(tensors)} tensors")
    return _chunk(index, c.get("offsets"), at, shape, dtype, tensors, user, where, ctx)


def _chunk(index: int, offsets: Any, at: tuple[int, int], shape: tuple[int, ...], dtype: str,
           tensors: Sequence[TensorRecord], user: dict[int, tuple[int, int]], where: str,
           ctx: str) -> Chunk:
    """Chunk at[1] of global at[0], record `index` (in range) at `offsets`
    (unchecked), listed or implied; messages are made only when raised (a
    manifest may hold millions of chunks)."""
    j = at[1]
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
    # A list as "chunks" lists them (JSON), a tuple as implied_chunks spells them.
    kind = type(offsets)
    if ((kind is not list and kind is not tuple) or len(offsets) != len(shape)
            or len(t.shape) != len(shape) or not _fits(offsets, t.shape, shape)):
        raise malformed(where, f"{ctx}: chunk {j} ({short(t.name)}) at "
                        f"{short(list(offsets) if kind is tuple else offsets)} of "
                        f"shape {list(t.shape)} does not fit in {list(shape)}")
    return _make_chunk((index, offsets if kind is tuple else tuple(offsets)))


# Chunk._make's way, without its checks; and _fits inlines is_int: a
# manifest's chunks are checked at every load (300,000 at 16,384 ranks).
_make_chunk = functools.partial(tuple.__new__, Chunk)


def _fits(offsets: Sequence[Any], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Each offset a JSON integer (bool is not: type, not isinstance) with the
    chunk's extent from it within the global's."""
    for o, n, d in zip(offsets, sizes, shape, strict=True):  # (lengths checked first)
        if type(o) is not int or o < 0 or o + n > d:
            return False
    return True


def _check_tiling(shape: tuple[int, ...], boxes: list[Box], budget: int, where: str,
                  ctx: str) -> int:
    """Raise unless the boxes (each within `shape`) tile it exactly; returns the
    corners visited, which must stay within `budget`."""
    sizes = [math.prod(s) for _, s in boxes]
    held = sum(sizes)
    if held != numel(shape):
        raise malformed(where, f"{ctx}: chunks hold {held} elements of {numel(shape)}")
    # Empty chunks cover nothing; dimensions no chunk cuts change nothing.
    full = [box for box, n in zip(boxes, sizes, strict=True) if n]
    cut = [d for d in range(len(shape))
           if any(o[d] != 0 or s[d] != shape[d] for o, s in full)]
    cost = len(full) << len(cut)
    if cost > budget:
        raise malformed(where, f"{ctx}: {len(full)} chunks cut {len(cut)} dimensions: too "
                        "many corners to check that they tile the tensor")
    if not (_tile_a_line(full, cut[0], shape[cut[0]]) if len(cut) == 1 else
            _corners_add_up(full, cut, shape)):
        raise malformed(where, f"{ctx}: chunks overlap or leave a gap")
    return cost


def _tile_a_line(boxes: list[Box], d: int, length: int) -> bool:
    """Boxes that cut dimension d only (row pieces, the usual case) tile it
    exactly if, in order, each starts where the one before ends, from 0 to
    `length`: the corners' rule in one dimension, without their dict."""
    reach = 0
    for start, end in sorted((o[d], o[d] + s[d]) for o, s in boxes):
        if start != reach:
            return False
        reach = end
    return reach == length


def _corners_add_up(boxes: list[Box], cut: list[int], shape: tuple[int, ...]) -> bool:
    """The boxes' signed corners, over the dimensions in `cut`, add up to the
    global box's own (module docstring)."""
    counts: dict[tuple[int, ...], int] = {}
    get = counts.get
    if len(cut) == 2:  # (TP x FSDP shards: the four corners written out)
        a, b = cut
        for o, s in boxes:
            lo0, lo1, hi0, hi1 = o[a], o[b], o[a] + s[a], o[b] + s[b]
            counts[lo0, lo1] = get((lo0, lo1), 0) + 1
            counts[lo0, hi1] = get((lo0, hi1), 0) - 1
            counts[hi0, lo1] = get((hi0, lo1), 0) - 1
            counts[hi0, hi1] = get((hi0, hi1), 0) + 1
    else:
        for o, s in boxes:
            for corner, sign in _corners([o[d] for d in cut], [o[d] + s[d] for d in cut]):
                counts[corner] = get(corner, 0) + sign
    expected = dict(_corners([0] * len(cut), [shape[d] for d in cut])) if boxes else {}
    return {k: v for k, v in counts.items() if v} == expected


def _corners(lo: list[int], hi: list[int]) -> list[tuple[tuple[int, ...], int]]:
    """The 2**len(lo) corners of the box [lo, hi) with their signs."""
    out = []
    for pick in itertools.product((0, 1), repeat=len(lo)):
        corner = tuple(h if p else low for low, h, p in zip(lo, hi, pick, strict=True))
        out.append((corner, -1 if sum(pick) % 2 else 1))
    return out
