"""A layout's boxes as a table: what a rank sends the coordinator, and what
the planner and the plan read.

A box is a tensor (key, dtype, global shape) and a place in it (offsets,
shape). Every layout of a job holds the same tensors in one order, and a
layout's places repeat (layer after layer, a parameter and its optimizer
states): so a rank sends its tensors once, pickled, with their fingerprint,
its distinct places, and per box the index of its place. Rank 0 unpickles
one list of tensors per fingerprint, not one per layout, and reads places
as columns of small integers. As a tuple per box, the 1.7 million boxes of
a Llama 405B at 16,384 ranks (512 layouts) cost rank 0 0.56 s to unpickle,
0.6 s to deduplicate and a collector pass over them all after the plan.

A BoxTable is also a sequence of its boxes (plain tuples, plan.Box), made
on first use: the plan's checks, tests and benchmarks read it so.
Torch-free; numpy only for the place index.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from .._version import __version__
from ..errors import DistributedCheckpointError
from .boxes import place_of, tensor_of
from .pair import paired, unpaired

Tensor = tuple[str, str, tuple[int, ...]]  # key, dtype, global shape
Place = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, shape
# An Item's fields as a plain tuple (plan.Item is a named tuple of them):
# what a table gives of its boxes and what a plan's shared boxes are.
# Python's cyclic collector never stops tracking a named tuple, where it
# stops tracking a plain tuple of numbers and strings; so a plan of Items,
# kept save after save, would add its boxes to every full pass of the
# trainer's collector. An Item is a Box (equal to and hashed as its fields);
# code that reads a Box by position takes either.
Box = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]

_INDEX = np.dtype("<u4")  # a box's place number, as sent


def tensors_digest_of(tensors: Sequence[Tensor]) -> str:
    """Fingerprint of a layout's tensors (keys, dtypes, global shapes), in
    its order: each rank works out its own (BoxTable.of), so that rank 0
    compares fingerprints, not tensors, and reads one list of tensors a
    fingerprint; values are compared only where fingerprints differ."""
    return hashlib.blake2b(repr(list(tensors)).encode(), digest_size=16).hexdigest()


class BoxTable(Sequence[Box]):
    """One layout's boxes (module docstring). `digest` fingerprints its
    tensors: tables with equal digests hold the same tensors, and the
    planner reads them once (tensors(known))."""

    __slots__ = ("_boxes", "_pickled", "_tensors", "digest", "place_numbers", "places")

    def __init__(self, digest: str, pickled: bytes | memoryview, places: tuple[Place, ...],
                 place_numbers: bytes) -> None:
        self.digest, self.places, self.place_numbers = digest, places, place_numbers
        self._pickled: bytes | memoryview | None = pickled
        self._tensors: tuple[Tensor, ...] | None = None
        self._boxes: tuple[Box, ...] | None = None

    @classmethod
    def of(cls, items: Sequence[Any]) -> BoxTable:
        """The table of a rank's items (plan.Item or plan.Box)."""
        tensors = tuple(map(tensor_of, items))
        at: dict[Place, int] = {}
        numbers = np.fromiter((at.setdefault(p, len(at)) for p in map(place_of, items)),
                              dtype=_INDEX, count=len(items))
        table = cls(tensors_digest_of(tensors), pickle.dumps(tensors, protocol=5),
                    tuple(at), numbers.tobytes())
        table._tensors = tensors  # and it keeps the bytes it sends
        return table

    @classmethod
    def received(cls, sent: object, rank: int) -> BoxTable:
        """The table rank `rank` sent (sent()), read without copying its
        pickled tensors (a view of `sent`, unpickled only where no table
        with its digest was: tensors()); a clear error where the rank sent
        something else (a rank of another fastpersist version)."""
        parts, head = unpaired(sent), None
        if parts is not None:
            try:
                head = pickle.loads(parts[0])
            except Exception:  # any unpickling error: not our form
                head = None
        if (parts is None or not isinstance(head, tuple) or len(head) != 3
                or not isinstance(head[0], str) or not isinstance(head[1], tuple)
                or not isinstance(head[2], bytes)):
            raise DistributedCheckpointError(
                f"rank {rank} described its tensors in a form this fastpersist "
                f"({__version__}) does not read: every rank of a job must run the same "
                "fastpersist version")
        digest, places, numbers = head
        return cls(digest, parts[1], places, numbers)

    @property
    def pickled(self) -> bytes | memoryview:
        """Its tensors, pickled: as sent, or again (tensors() lets the sent
        bytes go, so that a plan does not keep a copy of the tensors a layout)."""
        if self._pickled is None:
            self._pickled = pickle.dumps(self.tensors(), protocol=5)
        return self._pickled

    def sent(self) -> bytes:
        """What a rank sends of it (pair.paired): its digest, places and place
        numbers, pickled, then its tensors pickled, which rank 0 reads only
        once per digest (received)."""
        head = pickle.dumps((self.digest, self.places, self.place_numbers), protocol=5)
        return paired(head, self.pickled)

    def __reduce__(self) -> tuple[type[BoxTable], tuple[str, bytes, tuple[Place, ...], bytes]]:
        return BoxTable, (self.digest, bytes(self.pickled), self.places, self.place_numbers)

    def tensors(self, known: dict[str, tuple[Tensor, ...]] | None = None
                ) -> tuple[Tensor, ...]:
        """Its tensors: from `known` (by digest) where another table with its
        digest was read already, else unpickled (and added to `known`)."""
        if known is None or not self.digest:
            if self._tensors is None:
                self._tensors = tuple(pickle.loads(self.pickled))
                self._pickled = None
            return self._tensors
        found = known.get(self.digest)
        if found is None:
            found = known[self.digest] = self.tensors()
        self._tensors, self._pickled = found, None
        return found

    def where(self) -> np.ndarray:
        """Each box's place, as an index into `places`."""
        return np.frombuffer(self.place_numbers, dtype=_INDEX)

    def problem(self, tensors: int) -> str | None:
        """What makes it unreadable for a layout of `tensors` tensors; None if nothing."""
        if len(self.place_numbers) % _INDEX.itemsize:
            return f"its place numbers are {len(self.place_numbers)} bytes, not whole uint32s"
        where = self.where()
        if len(where) != tensors:
            return f"it sent {len(where)} boxes for {tensors} tensors"
        if len(where) and int(where.max()) >= len(self.places):
            return f"a box names place {int(where.max())} of {len(self.places)}"
        return None

    @property
    def boxes(self) -> tuple[Box, ...]:
        """Its boxes as plain tuples, made once."""
        if self._boxes is None:
            places = self.places
            self._boxes = tuple(map(operator.add, self.tensors(),
                                    map(places.__getitem__, self.where().tolist())))
        return self._boxes

    def __len__(self) -> int:
        return len(self.place_numbers) // _INDEX.itemsize

    @overload
    def __getitem__(self, i: int) -> Box: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Box, ...]: ...
    def __getitem__(self, i: int | slice) -> Box | tuple[Box, ...]:
        return self.boxes[i]

    def __iter__(self) -> Iterator[Box]:
        return iter(self.boxes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BoxTable):
            return self.boxes == other.boxes
        if isinstance(other, tuple):  # of plan.Box or plan.Item, which equal their fields
            return self.boxes == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BoxTable({len(self)} boxes, {len(self.places)} places)"


__all__ = ["Box", "BoxTable", "Place", "Tensor", "tensors_digest_of"]
