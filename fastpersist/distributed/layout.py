"""A distributed save's layout: the tensors stored once, the storage domain of
each rank, the pieces a rank holds, and a distributed manifest from records
(written.py makes a save's job manifest from what its ranks rendered). Pure
functions of their inputs."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from .._version import __version__
from ..errors import DistributedCheckpointError
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    Chunk,
    FileRecord,
    GlobalTensor,
    Manifest,
    TensorRecord,
)
from ..format.names import rank_of_part_file
from ..tensors.state import TensorLeaf
from .describe import Held
from .outcome import ProcessId
from .planner import Piece


class RankView(NamedTuple):
    """What each rank tells all the others in the describe phase."""

    node: str
    layout: str  # planner.layout_digest of its items
    target: str  # the checkpoint path it saves to
    values: str  # describe.values_digest of the values saved once for the job
    process: ProcessId  # so that ranks on its machine can tell if it died
    prepared: bool  # node-local: its target's directory holds prepared parts (settling.py)
    keys: str = ""  # union=True: plan.keys_digest of its items (ranks of one stage alike)


def unaliased(leaves: list[TensorLeaf]) -> list[TensorLeaf]:
    """Number the tree's tensors (node["e"]); a tensor that appears under several
    keys (tied weights) is stored once, under its first key, and every key
    refers to it, so load gives back one tensor. (Different views of one
    storage are stored separately, each its own bytes.)"""
    first: dict[tuple[Any, ...], int] = {}
    unique: list[TensorLeaf] = []
    for leaf in leaves:
        t = leaf.tensor
        same = None if leaf.node.get("sharded") or t.numel() == 0 else (
            str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if same is not None and same in first:
            leaf.node["e"] = first[same]
            continue
        leaf.node["e"] = len(unique)
        if same is not None:
            first[same] = len(unique)
        unique.append(leaf)
    return unique


def domains(everyone: list[RankView], node_local: bool) -> list[str]:
    """Storage domain of each rank: its node's disk, or the one shared filesystem."""
    return [v.node if node_local else "shared" for v in everyone]


def target_conflict(everyone: list[RankView], domain: list[str]
                    ) -> DistributedCheckpointError | None:
    """Ranks that share storage must name the same checkpoint directory."""
    first: dict[str, tuple[int, str]] = {}
    for r, target in enumerate(v.target for v in everyone):
        d = domain[r]
        if d in first and first[d][1] != target:
            other, path = first[d]
            msg = (f"rank {r} saves to {target} but rank {other}, which shares its storage "
                   f"({'node ' + d if d != 'shared' else 'shared filesystem'}), saves to {path}")
            return DistributedCheckpointError(f"distributed checkpoint failed: {msg}",
                                              {r: f"describe: {msg}"})
        first.setdefault(d, (r, target))
    return None


def within(piece: Piece, held: Held) -> bool:
    """Pieces are row ranges of the box a writer holds."""
    item = held.item
    if not piece.shape:
        return not item.shape
    return (item.offsets[0] <= piece.offsets[0]
            and piece.offsets[0] + piece.shape[0] <= item.offsets[0] + item.shape[0]
            and piece.offsets[1:] == item.offsets[1:] and piece.shape[1:] == item.shape[1:])


# A global tensor as global_manifest takes it: key, dtype, global shape, and
# its chunks as (tensor record's name, offsets).
Global = tuple[str, str, tuple[int, ...], list[tuple[str, tuple[int, ...]]]]


def global_manifest(files: list[FileRecord], records: list[TensorRecord],
                    globals_: list[Global], tree: Any, *, check: str | None = None) -> bytes:
    """A distributed manifest (schema 2): the files and tensor records the
    ranks wrote, and the global tensors whose chunks those records hold.
    check: validate it as every load will, errors naming `check` (a state
    whose chunks do not tile its tensors then fails here, not at load)."""
    index_of = {r.name: i for i, r in enumerate(records)}
    make = Chunk._make
    data = Manifest(
        files=tuple(files), tensors=tuple(records), tree=tree,
        fastpersist_version=__version__, created_unix=time.time(),
        schema_version=DISTRIBUTED_SCHEMA_VERSION,
        globals=tuple(GlobalTensor(key, dtype, shape,
                                   tuple([make((index_of[name], offsets))
                                          for name, offsets in chunks]))
                      for key, dtype, shape, chunks in globals_)).to_json()
    if check is not None:
        Manifest.from_json(data, check)
    return data


def tensor_bytes_by_rank(manifest: Manifest) -> dict[int, int]:
    """Tensor bytes each rank wrote into a distributed checkpoint, by rank."""
    out: dict[int, int] = {}
    for t in manifest.tensors:
        rank = rank_of_part_file(t.file)
        if rank is not None:
            out[rank] = out.get(rank, 0) + t.length
    return dict(sorted(out.items()))


__all__ = ["Global", "RankView", "domains", "global_manifest", "target_conflict",
           "tensor_bytes_by_rank", "unaliased", "within"]
