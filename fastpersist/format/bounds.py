"""Limits on what a manifest may describe, and the checks that apply them.

A checkpoint on disk is untrusted input: every number in its manifest is
checked against these bounds before any arithmetic, allocation or recursion
uses it, so that no manifest can make one explode (a 300,000-dimension shape,
a stride calculation that overflows int64, a tree nested past the interpreter's
recursion limit). Writers refuse to produce what readers refuse to read.
Torch-free: the daemon validates job manifests with these.
"""

from __future__ import annotations

import reprlib
from typing import Any, TypeGuard

from ..errors import ManifestError
from ..knobs import MAX_FRAME_BYTES

# Compressed tensors (format/frames.py): raw bytes per frame are at most
# MAX_FRAME_BYTES (what one decode allocates) and, counted over a tensor, at
# least MIN_FRAME_BYTES on average, which bounds how many frames a tensor may
# claim; a frame's stored bytes exceed its raw bytes by at most
# MAX_FRAME_OVERHEAD (a frame that does not shrink is stored as it is).
MIN_FRAME_BYTES = 4096
MAX_FRAME_OVERHEAD = 64

# Tensors of more dimensions are refused (torch's own kernels stop well short).
MAX_DIMS = 64
# The product of a shape's dimensions, each 0 counted as 1: that bounds the
# element count and every contiguous stride, so that they and the byte counts
# (at most 8 bytes an element) stay within int64 in torch and in the engine.
MAX_ELEMENTS = 1 << 60
__all__ = ["MAX_FRAME_BYTES"]  # re-exported: the knob's limit is the format's

# A CRC32C.
CRC_MAX = (1 << 32) - 1
# Any file offset or size in a manifest.
MAX_FILE_BYTES = 1 << 62
# The manifest file itself: a million tensors take about 300 MB.
MAX_MANIFEST_BYTES = 1 << 30
# Levels of the saved object (the root is level 1; a dict's keys and values,
# a list's items are one level below it). A state dict uses fewer than ten;
# the reader's recursion stays far from Python's limit.
MAX_TREE_DEPTH = 100

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlevel = 2
_repr.maxlist = _repr.maxdict = 6


def short(value: Any) -> str:
    """A bounded repr for error messages (nesting, long strings and lists cut)."""
    return _repr.repr(value)


def malformed(where: str, msg: str) -> ManifestError:
    return ManifestError(f"{where}: malformed manifest: {msg}")


def is_int(value: Any, lo: int = 0, hi: int | None = MAX_FILE_BYTES) -> TypeGuard[int]:
    """A JSON integer (not a bool) with lo <= value <= hi (hi None: unbounded)."""
    return (isinstance(value, int) and not isinstance(value, bool) and lo <= value
            and (hi is None or value <= hi))


def shape_problem(shape: Any) -> str | None:
    """What is wrong with `shape` as a tensor shape, or None: it must be a list
    of at most MAX_DIMS integers >= 0 whose product (0 counted as 1) is at most
    MAX_ELEMENTS. The cost is bounded by MAX_DIMS whatever the input."""
    if not isinstance(shape, list | tuple):
        return "must be a list of integers >= 0"
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions, more than {MAX_DIMS}"
    span = 1
    for d in shape:
        if not is_int(d, 0, None):
            return "must be a list of integers >= 0"
        span *= min(max(d, 1), MAX_ELEMENTS + 1)  # capped: no big-number arithmetic
        if span > MAX_ELEMENTS:
            return "is too large (more than 2**60 elements, counting each 0 as 1)"
    return None


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a shape that passed shape_problem."""
    n = 1
    for d in shape:
        n *= d
    return n
