"""Deciding the prepared parts of node-local distributed checkpoints.

Node-local, rank 0's node commits the job for all: the other nodes make
their part durable but hidden first (prepared.py) and publish
it only after rank 0's node has. If the job dies in between, or its
survivors cannot learn whether rank 0's node committed, a node keeps its
part prepared: in doubt. No node can decide that alone; the job's nodes
together do, here:

- a part whose job manifest (the same bytes) is committed under its name on
  some node is published: the job committed, and only rank 0's node
  commits before the others publish;
- a part whose committing node takes part but holds another checkpoint or
  none under that name is discarded: the job never committed there (or a
  later checkpoint of the name replaced it);
- a part whose committing node is not in the job stays in doubt.

A node-local save runs this for its target's directory before it stages
(when some node has prepared parts there). A job restarting after a crash
calls settle() on every rank before it picks the checkpoint to resume from,
so that every node shows the same ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DistributedCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..knobs import current as current_knobs
from ..storage.commit import find_leftovers
from ..storage.prepared import manifest_digest, read_prepared
from .phases import Coordinator, Failure, RanksLost, coordinator_for, failed, failure
from .storage import Storage, storage_for

PUBLISH, DISCARD, IN_DOUBT = "publish", "discard", "in doubt"
UNREADABLE = "?"


@dataclass
class Settled:
    """What settling did on this rank's node, by checkpoint name (the same
    on every rank of a node; empty on the node's other ranks too)."""

    promoted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    in_doubt: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Part:
    """A prepared part, as its node tells the others."""

    name: str  # the prepared directory's
    target: str  # the checkpoint's
    commit_node: str  # "" if its marker cannot be read: nothing decides it then
    digest: str


def settle(directory: str | os.PathLike[str], process_group: Any = None, *,
           daemon: str | None = None) -> Settled:
    """Publish or discard the prepared (in doubt) parts of node-local
    distributed checkpoints in `directory`, as the job's nodes together find
    that their job did or did not commit. Call it on every rank of the job
    (process_group, default the world), each passing its node's directory,
    as for the save. Through a daemon (`daemon` or FASTPERSIST_DAEMON) the
    node's fastpersistd publishes or discards them. Raises the same
    DistributedCheckpointError on every rank if a node could not."""
    address = current_knobs().daemon if daemon is None else daemon
    co = coordinator_for(None if process_group in (None, "world") else process_group)
    node = current_knobs().node
    storage = storage_for(address)
    try:
        nodes = _exchange(co, lambda: co.all_gather(node))
        return settle_with(co, Path(os.path.abspath(os.fspath(directory))), storage,
                           nodes.index(node) == co.rank, nodes)
    finally:
        storage.close()


def has_prepared(directory: Path) -> bool:
    """Whether `directory` holds prepared parts (cheap: names only)."""
    try:
        return any(lo.kind == "prep" for lo in find_leftovers(directory))
    except OSError:
        return False


def settle_with(co: Coordinator, directory: Path, storage: Storage, leader: bool,
                nodes: list[str]) -> Settled:
    """settle(), for a job whose ranks know their nodes; `leader`: this rank
    is the first of its node, and acts for it."""
    mine = _prepared_in(directory) if leader else []
    everyone = _exchange(co, lambda: co.all_gather(mine))
    names = sorted({p.target for per in everyone for p in per})
    if not names:
        return Settled()
    committed = _committed(directory, names) if leader else None
    digests = _exchange(co, lambda: co.all_gather(committed))
    by_node = {nodes[r]: d for r, d in enumerate(digests) if d is not None}
    settled, error = Settled(), None
    try:
        for part in mine:
            decision = decide(part, by_node, nodes[co.rank])
            if decision == IN_DOUBT:
                settled.in_doubt.append(part.target)
                continue
            storage.resolve(directory / part.target, str(directory / part.name),
                            publish=decision == PUBLISH)
            (settled.promoted if decision == PUBLISH else settled.removed).append(part.target)
    except Exception as exc:
        error = failure(co.rank, "settle", exc)
    results: list[tuple[Failure | None, Settled]] = _exchange(
        co, lambda: co.all_gather((error, settled)))
    errors = [e for e, _ in results if e]
    if errors:
        raise failed(errors, "settling prepared checkpoints failed")
    # Every rank of a node reports what its first rank did.
    return results[nodes.index(nodes[co.rank])][1]


def decide(part: Part, by_node: dict[str, dict[str, str]], here: str) -> str:
    """PUBLISH, DISCARD or IN_DOUBT (module docstring); by_node: for each
    node taking part, the digest of the manifest committed under each name
    there ("" for none, UNREADABLE if it cannot tell)."""
    if part.commit_node and any(d.get(part.target) == part.digest for d in by_node.values()):
        # Published here already (a crash after the rename): the part is a copy.
        return DISCARD if by_node.get(here, {}).get(part.target) == part.digest else PUBLISH
    if by_node.get(part.commit_node, {}).get(part.target, UNREADABLE) != UNREADABLE:
        return DISCARD
    return IN_DOUBT


def _prepared_in(directory: Path) -> list[Part]:
    try:
        leftovers = find_leftovers(directory)
    except OSError:
        return []
    out = []
    for lo in leftovers:
        if lo.kind == "prep":
            p = read_prepared(lo)
            out.append(Part(lo.path.name, lo.target_name, p.commit_node if p else "",
                             p.digest if p else ""))
    return out


def _committed(directory: Path, names: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = manifest_digest((directory / name / MANIFEST_NAME).read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            out[name] = ""
        except OSError:  # there may be one: this node cannot tell
            out[name] = UNREADABLE
    return out


def _exchange(co: Coordinator, fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        lost = RanksLost("settle", str(exc))
        raise DistributedCheckpointError(
            f"settling prepared checkpoints failed: {lost}; a rank died or hung") from exc


__all__ = ["Part", "Settled", "decide", "has_prepared", "settle", "settle_with"]
