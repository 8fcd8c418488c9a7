"""What a rank sends the coordinator after writing its pieces, and the job
manifest the coordinator makes of what every rank sent.

At thousands of ranks a job manifest holds hundreds of thousands of tensor
records. Sent as record objects, the coordinator spent about 6 us a record
unpickling them and 3 us more writing each as JSON, and about 2 us more
listing each as a chunk of its tensor: 1.7 s, 1 s and 0.6 s of rank 0's time
at a 70B model's 300,000 pieces over 16,384 ranks, while every other rank
waited. Each rank now renders its own records as the manifest's JSON
(format.manifest's file_json and tensor_json, so the text is what
Manifest.to_json writes), in parallel with the others, and checks them
against its pieces. Rank 0 joins the ranks' text and lists the job's
tensors without their chunks: in schema 3 a tensor's chunks are the records
named after it (format/chunks.py), which is how the pieces are named
(Piece.name). Nothing rank 0 does is per piece.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from .. import gcpause
from .._version import __version__
from ..errors import DistributedCheckpointError
from ..format.manifest import (
    IMPLIED_CHUNKS_SCHEMA_VERSION,
    file_json,
    global_json,
    joined,
    render,
    tensor_json,
)
from ..format.records import FileRecord, TensorRecord
from .boxes import DTYPE, GLOBAL_SHAPE, KEY
from .pair import paired, unpaired
from .plan import Box, Piece, Plan


class Written(NamedTuple):
    """A rank's data files and the tensors in them, as manifest JSON."""

    files: bytes | memoryview  # its file records, joined with ITEM_SEPARATOR (b"": none)
    tensors: bytes | memoryview  # its tensor records, likewise

    def sent(self) -> bytes:
        """As the rank sends it (Coordinator.gather_bytes): both, paired (pair.py)."""
        return paired(self.files, self.tensors)

    @staticmethod
    def received(data: bytes, rank: int) -> Written:
        """What rank `rank` sent (sent()), as views of `data`: the coordinator
        copies the ranks' records once, into the manifest (render)."""
        parts = unpaired(data)
        if parts is None:
            raise DistributedCheckpointError(
                f"rank {rank} sent its records in a form this fastpersist does not read "
                f"({len(data)} bytes): every rank of a job must run the same version")
        return Written(*parts)


def rendered(pieces: list[Piece], records: list[tuple[FileRecord, list[TensorRecord]]]
             ) -> Written:
    """What a rank that wrote `pieces` (its share) into files with these
    records sends the coordinator. Raises unless the records are its pieces,
    each once (in any order): the coordinator does not check them again."""
    tensors = [t for _, per_file in records for t in per_file]
    names, wanted = [t.name for t in tensors], [p.name for p in pieces]
    if names != wanted and sorted(names) != sorted(wanted):
        missing = sorted(set(wanted) - set(names))
        extra = sorted(set(names) - set(wanted))
        raise DistributedCheckpointError(
            f"this rank's files hold {len(tensors)} tensors for its {len(pieces)} pieces"
            + (f"; {missing[0]!r} is missing" if missing else "")
            + (f"; {extra[0]!r} is not one of them" if extra else ""))
    return Written(joined(file_json(f) for f, _ in records), joined(map(tensor_json, tensors)))


@gcpause.paused()  # a record per piece: many objects, no cycles (see gcpause)
def job_manifest(plan: Plan, tree: Any, gathered: list[Written]) -> bytes:
    """The job manifest (schema 3): the ranks' files and tensor records, in
    rank order, and the job's tensors (plan.keys), whose chunks are the
    records named after them."""
    if len(gathered) != len(plan.nodes):
        raise DistributedCheckpointError(
            f"the ranks' records do not fit the plan: {len(gathered)} ranks reported for a "
            f"plan of {len(plan.nodes)}")
    globals_ = plan.memo.get("globals")
    if globals_ is None:
        # A tensor's dtype and shape are the same in every layout that holds
        # it (the planner checks); with union=True, not every layout holds
        # every tensor. (Without it the first layout holds them all.)
        found: dict[str, Box] = {}
        for layout in plan.layouts.values():
            found.update((i[KEY], i) for i in layout.items if i[KEY] not in found)
            if len(found) == len(plan.keys):
                break
        globals_ = plan.memo["globals"] = [joined(
            global_json(k, found[k][DTYPE], found[k][GLOBAL_SHAPE], None) for k in plan.keys)]
    assert isinstance(globals_, list)
    return render(IMPLIED_CHUNKS_SCHEMA_VERSION, __version__, time.time(),
                  [w.files for w in gathered], [w.tensors for w in gathered], globals_, tree)


__all__ = ["Written", "job_manifest", "rendered"]
