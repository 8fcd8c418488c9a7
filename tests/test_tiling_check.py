"""A distributed manifest's chunks must tile each global tensor exactly
(format/chunks.py: intervals when one dimension is cut, corners otherwise):
random tilings and damaged ones, in one to three dimensions, checked against
counting every element."""

from __future__ import annotations

import itertools
import math
import random
from typing import NamedTuple

import pytest

from fastpersist.errors import ManifestError
from fastpersist.format.chunks import parse_globals


class Record(NamedTuple):  # what parse_globals reads of a TensorRecord
    name: str
    dtype: str
    shape: tuple[int, ...]


def split(rng: random.Random, offsets: list[int], shape: list[int], cuts: list[int],
          depth: int = 0) -> list[tuple[list[int], list[int]]]:
    """A random exact tiling of the box by recursive cuts along `cuts`."""
    d = rng.choice(cuts)
    if depth > 4 or shape[d] < 2 or rng.random() < 0.25:
        return [(offsets, shape)]
    at = rng.randint(1, shape[d] - 1)
    left, right = list(shape), list(shape)
    left[d], right[d] = at, shape[d] - at
    moved = list(offsets)
    moved[d] += at
    return (split(rng, list(offsets), left, cuts, depth + 1)
            + split(rng, moved, right, cuts, depth + 1))


def exactly_once(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    seen: dict[tuple[int, ...], int] = {}
    for o, s in boxes:
        for cell in itertools.product(*(range(a, a + n) for a, n in zip(o, s, strict=True))):
            seen[cell] = seen.get(cell, 0) + 1
    return len(seen) == math.prod(shape) and set(seen.values()) <= {1}


def accepted(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    records = [Record(f"g@{n}", "F32", tuple(s)) for n, (_, s) in enumerate(boxes)]
    raw = [{"name": "g", "dtype": "F32", "shape": shape,
            "chunks": [{"tensor": n, "offsets": o} for n, (o, _) in enumerate(boxes)]}]
    try:
        parse_globals(raw, records, "m", 2)  # type: ignore[arg-type]
    except ManifestError as exc:
        assert "overlap or leave a gap" in str(exc) or "elements of" in str(exc) or \
            "does not fit" in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("seed", range(60))
def test_tilings_are_accepted_and_damaged_ones_refused_as_counting_says(seed: int) -> None:
    rng = random.Random(seed)
    dims = rng.choice([1, 2, 3])
    shape = [rng.randint(1, 7) for _ in range(dims)]
    cuts = rng.sample(range(dims), rng.randint(1, dims))
    boxes = split(rng, [0] * dims, shape, cuts)
    assert accepted(shape, boxes)
    for _ in range(5):  # move or resize one box: refused exactly when not a tiling
        damaged = [(list(o), list(s)) for o, s in boxes]
        o, s = rng.choice(damaged)
        d = rng.randrange(dims)
        if rng.random() < 0.5:
            o[d] = max(0, o[d] + rng.choice([-1, 1]))
        else:
            s[d] = max(0, s[d] + rng.choice([-1, 1]))
        if all(a + n <= g for a, n, g in zip(o, s, shape, strict=True)):
            assert accepted(shape, damaged) == exactly_once(shape, damaged), (shape, damaged)
