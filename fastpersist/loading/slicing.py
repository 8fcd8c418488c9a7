"""The index of a handle's get_slice(name)[...], checked against the
tensor's shape before anything is read, and cut into what is read (a run
of whole rows of dim 0) and what is done in memory (the rest of the index).

Accepted: an int, a slice with a positive step, `...`, or a tuple of those,
at most one per dimension. Negative ints and bounds count from the end, as
in Python. Unlike Python's slicing, which clips, a bound beyond the
dimension is an error (TensorIndexError, an IndexError): a partial read of
a checkpoint that asks for rows it does not have is a bug in the caller,
not a request for fewer rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import TensorIndexError


@dataclass(frozen=True)
class Cut:
    """What one index needs: rows start..stop of dim 0 are read (None: the
    tensor has no dims), then `rest` is applied to those rows in memory."""

    rows: tuple[int, int] | None
    rest: tuple[Any, ...]


def cut(index: Any, shape: tuple[int, ...], name: str, where: str = "") -> Cut:
    """`index` of the tensor `name` of `shape`, checked (TensorIndexError
    naming the checkpoint `where`, the tensor and its shape; TypeError for
    what is not an index)."""
    tensor = f"{where}: tensor {name!r}" if where else f"tensor {name!r}"
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if not (item is Ellipsis or isinstance(item, slice) or _is_int(item)):
            raise TypeError(f"{tensor}: get_slice takes ints, slices and `...`, not "
                            f"{type(item).__name__}")
    if sum(item is Ellipsis for item in items) > 1:
        raise TensorIndexError(f"{tensor} of shape {list(shape)}: an index can have "
                               "only one `...`")
    dims = sum(item is not Ellipsis for item in items)
    if dims > len(shape):
        raise TensorIndexError(f"{tensor} of shape {list(shape)}: {dims} indices for "
                               f"{len(shape)} dimensions")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = (slice(None),) * (len(shape) - dims)
        items = items[:at] + fill + items[at + 1:]
    items = items + (slice(None),) * (len(shape) - len(items))
    checked = tuple(_check(item, n, d, shape, tensor) for d, (item, n) in
                    enumerate(zip(items, shape, strict=True)))
    if not shape:
        return Cut(None, ())
    first = checked[0]
    if isinstance(first, int):
        return Cut((first, first + 1), (0, *checked[1:]))
    start, stop, step = first.start, first.stop, first.step
    if stop <= start:
        return Cut((start, start), (slice(None), *checked[1:]))
    last = start + (stop - 1 - start) // step * step
    return Cut((start, last + 1), (slice(None, None, step), *checked[1:]))


def _is_int(item: Any) -> bool:
    return not isinstance(item, (bool, slice)) and hasattr(item, "__index__")


def _check(item: Any, n: int, dim: int, shape: tuple[int, ...], tensor: str) -> int | slice:
    """`item` for dimension `dim` (of size n) with its bounds made absolute."""
    where = f"{tensor} of shape {list(shape)}"
    if not isinstance(item, slice):
        i = int(item.__index__())
        if not -n <= i < n:
            raise TensorIndexError(f"{where}: index {i} is out of range for dimension {dim} "
                                   f"(size {n})")
        return i + n if i < 0 else i
    step = 1 if item.step is None else int(item.step.__index__())
    if step <= 0:
        raise TensorIndexError(f"{where}: slice step {step} along dimension {dim}: only "
                               "positive steps are supported")
    bounds = []
    for bound, default in ((item.start, 0), (item.stop, n)):
        if bound is None:
            bounds.append(default)
            continue
        b = int(bound.__index__())
        if not -n <= b <= n:
            raise TensorIndexError(f"{where}: slice {_text(item)} is out of range for "
                                   f"dimension {dim} (size {n})")
        bounds.append(b + n if b < 0 else b)
    return slice(bounds[0], bounds[1], step)


def _text(s: slice) -> str:
    parts = ["" if v is None else str(v) for v in (s.start, s.stop)]
    text = ":".join(parts)
    return text + (f":{s.step}" if s.step is not None else "")


__all__ = ["Cut", "cut"]
