"""What lies below an s3:// URL, at any depth: checkpoints, runs, incomplete uploads.

The daemon uploads ROOT/REL to PREFIX/REL, so checkpoints sit at any depth
(PREFIX/run1/step-5). From one listing of the keys below the URL, each
directory is one of:

    checkpoint  it holds a manifest.json: everything below it is part of it
                (a "checkpoint" deeper inside one is not listed apart).
    run         it holds no manifest but has checkpoints below it. Objects
                lying directly in a run directory belong to nothing this
                module knows and are left alone, as are those directly at
                the listed URL.
    incomplete  it directly holds objects, no manifest and no checkpoint below
                it: an upload in progress or abandoned. Only the outermost
                such directory is listed (one inside it is part of it), with
                its keys: what gc may delete, and nothing else.

A key that names no valid path below the URL ("a//b", "..", a backslash:
put there by another tool) is "odd": it is reported by the listing, and
never classified, so never deleted.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.manifest import MANIFEST_NAME
from ..storage.retention import step_of
from .client import S3
from .url import TierURL

CHECKPOINT, RUN, INCOMPLETE = "checkpoint", "run", "incomplete"

Dir = tuple[str, ...]


@dataclass(frozen=True)
class RemoteEntry:
    """A directory below a URL: a checkpoint, a run or an incomplete upload."""

    name: str  # relative to the listed URL: "step-5", "run1/step-5"
    kind: str  # CHECKPOINT, RUN or INCOMPLETE
    bytes: int  # of its objects (a run: of the checkpoints below it)
    modified: float  # newest object's time (unix)
    checkpoints: int = 0  # a run: how many are below it
    keys: tuple[str, ...] = ()  # incomplete: its objects (what gc deletes)

    @property
    def committed(self) -> bool:
        """Whether it is a checkpoint (holds a manifest)."""
        return self.kind == CHECKPOINT

    @property
    def step(self) -> int | None:
        """N of a step-N directly below the listed URL (None deeper down)."""
        return step_of(self.name)


@dataclass(frozen=True)
class Listing:
    entries: tuple[RemoteEntry, ...]  # by name
    odd: tuple[str, ...]  # keys that name no valid path below the URL
    is_checkpoint: bool  # the URL itself holds a manifest


def _owner(d: Dir, committed: set[Dir]) -> Dir | None:
    """The outermost checkpoint that `d` is, or lies in."""
    for i in range(len(d) + 1):
        if d[:i] in committed:
            return d[:i]
    return None


def listing(s3: S3, url: TierURL) -> Listing:
    """Everything below `url`, classified (see the module docstring)."""
    objects: list[tuple[Dir, str, int, float]] = []
    odd: list[str] = []
    committed: set[Dir] = set()
    for key, size, modified in s3.objects(url):
        parts = url.split_key(key)
        if parts is None:
            odd.append(key)
            continue
        objects.append((parts[:-1], key, size, modified))
        if parts[-1] == MANIFEST_NAME:
            committed.add(parts[:-1])
    runs = {d[:i] for d in committed for i in range(1, len(d))}
    found: dict[Dir, list[float]] = {}  # checkpoint -> [bytes, newest]
    orphans: list[tuple[Dir, str, int, float]] = []
    for d, key, size, modified in objects:
        owner = _owner(d, committed)
        if owner is not None:
            acc = found.setdefault(owner, [0, 0.0])
            acc[0] += size
            acc[1] = max(acc[1], modified)
        elif d and d not in runs:
            orphans.append((d, key, size, modified))
    holding = {d for d, _, _, _ in orphans}
    partial: dict[Dir, tuple[list[float], list[str]]] = {}
    for d, key, size, modified in orphans:
        # The outermost directory holding objects of its own that no run encloses.
        unit = next(d[:i] for i in range(1, len(d) + 1)
                    if d[:i] in holding and d[:i] not in runs)
        acc, keys = partial.setdefault(unit, ([0, 0.0], []))
        acc[0] += size
        acc[1] = max(acc[1], modified)
        keys.append(key)
    out = [RemoteEntry("/".join(d), CHECKPOINT, int(v[0]), v[1])
           for d, v in found.items() if d]
    for run in runs:
        below = [v for d, v in found.items() if d[:len(run)] == run]
        out.append(RemoteEntry("/".join(run), RUN, int(sum(v[0] for v in below)),
                               max(v[1] for v in below), checkpoints=len(below)))
    out += [RemoteEntry("/".join(d), INCOMPLETE, int(acc[0]), acc[1], keys=tuple(keys))
            for d, (acc, keys) in partial.items()]
    return Listing(tuple(sorted(out, key=lambda e: e.name)), tuple(odd), () in committed)


def entries(s3: S3, url: TierURL) -> list[RemoteEntry]:
    """The directories directly below `url` that are checkpoints, runs or
    incomplete (listing() gives every depth)."""
    return [e for e in listing(s3, url).entries if "/" not in e.name]


__all__ = ["CHECKPOINT", "INCOMPLETE", "RUN", "Listing", "RemoteEntry", "entries", "listing"]
