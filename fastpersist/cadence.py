"""A Checkpointer's cadences: where the checkpoint of each step goes.

    ckpt = Checkpointer(root, daemon=ADDRESS, memory_every=1, disk_every=100)

memory_every=K: the steps that are multiples of K are memory-only: kept by
    fastpersistd's memory tier and not written to disk (the daemon must run
    with --memory-tier-count and --memory-tier-bytes). Such a checkpoint
    survives the trainer (the daemon holds it) but not the daemon or the
    node; the tier's count and budget evict it like any copy.
disk_every=N: the multiples of N are written to disk, as every save is
    without cadences (the daemon also keeps a copy in memory if its tier is
    on). A step on both cadences goes to disk.
tier_every=M: of the disk checkpoints, the multiples of M also go to the
    object store (Checkpointer tier=, or the daemon's --tier); the others
    stay local. M must be a multiple of N.

save_every=S (without memory_every and disk_every): the interval of
    Checkpointer.should_save(step); save() itself takes any step. With the
    cadences, should_save(step) is true on either of them instead.

Without memory_every and disk_every every save() goes to disk. With them,
save() of a step on neither cadence raises ValueError, unless it says where
(durability="disk" or "memory"; say, the last step of a run). A memory-only
save moves no `latest` pointer and applies no retention: those are the
disk's, so keep_last counts disk checkpoints only and never drops the
newest one for a memory save.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MemoryTierError
from .format.manifest import MANIFEST_NAME
from .tensors.factory import MapLocation

DISK, MEMORY = "disk", "memory"


@dataclass(frozen=True)
class Cadence:
    memory_every: int | None = None
    disk_every: int | None = None
    tier_every: int | None = None
    save_every: int | None = None  # should_save's interval where the cadences are unset

    def check(self, *, daemon: bool, distributed: bool, tier: bool) -> None:
        """ValueError for settings that cannot work. daemon: saves go through
        fastpersistd; tier: an object store is configured here (tier=)."""
        for name in ("memory_every", "disk_every", "tier_every", "save_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a whole number of steps >= 1 (or None), "
                                 f"not {value!r}")
        if self.save_every is not None and self.set:
            raise ValueError("save_every= is the interval of should_save() where memory_every "
                             "and disk_every are unset; with them, they are (should_save is "
                             "true on either)")
        if self.memory_every is not None:
            if not daemon:
                raise ValueError("memory_every= keeps checkpoints in fastpersistd's memory "
                                 "tier: pass daemon= (a daemon started with "
                                 "--memory-tier-count N), or leave memory_every unset")
            if distributed:
                raise ValueError("memory_every= is for one process per daemon; a distributed "
                                 "job (process_group=) saves to disk only")
        if self.tier_every is not None:
            if not tier and not daemon:
                raise ValueError("tier_every= says which disk checkpoints go to the object "
                                 "store: pass tier= (or save through a fastpersistd "
                                 "started with --tier)")
            if self.disk_every is not None and self.tier_every % self.disk_every:
                raise ValueError(f"tier_every ({self.tier_every}) must be a multiple of "
                                 f"disk_every ({self.disk_every}): only disk checkpoints go "
                                 "to the object store")

    @property
    def set(self) -> bool:
        return self.memory_every is not None or self.disk_every is not None

    def durability(self, step: int, asked: str | None = None) -> str:
        """Where step's checkpoint goes: DISK or MEMORY (asked, if given)."""
        if asked is not None:
            if asked not in (DISK, MEMORY):
                raise ValueError(f"durability must be {DISK!r} or {MEMORY!r}, not {asked!r}")
            if asked == MEMORY and self.memory_every is None:
                raise ValueError("durability='memory' needs memory_every= on the Checkpointer "
                                 "(and a fastpersistd with its memory tier on)")
            return asked
        if not self.set or (self.disk_every is not None and step % self.disk_every == 0):
            return DISK
        if self.memory_every is not None and step % self.memory_every == 0:
            return MEMORY
        raise ValueError(
            f"step {step} is on neither cadence (memory_every={self.memory_every}, "
            f"disk_every={self.disk_every}); pass durability='disk' or 'memory' to save it "
            "anyway")

    def due(self, step: int) -> bool:
        """Whether `step` is on the interval: save_every's, or either cadence
        (the steps save() takes without durability=); every step without any."""
        if self.save_every is not None:
            return step % self.save_every == 0
        return not self.set or any(every is not None and step % every == 0
                                   for every in (self.disk_every, self.memory_every))

    def uploads(self, step: int) -> bool:
        """Whether the disk checkpoint of `step` goes to the object store."""
        return self.tier_every is None or step % self.tier_every == 0


def memory_steps(address: str, root: Path) -> list[int]:
    """Steps of the memory-only checkpoints the daemon holds in `root` now
    ([] if it cannot say: down, slow, not serving that root)."""
    if not address:
        return []
    from .tensors import memory_only

    return memory_only.steps(address, root)[0]


def load_memory_only(address: str, path: Path, map_location: MapLocation,
                     options: dict[str, Any]) -> Any:
    """fastpersist.load of the memory-only checkpoint at `path` (options:
    load's); MemoryTierError if the daemon does not hold it (any more)."""
    from .loading.load import load_from
    from .tensors import memory_only

    source, why = (None, "it is on disk") if (path / MANIFEST_NAME).exists() else \
        memory_only.find(address, path)
    if source is None:
        raise MemoryTierError(f"memory-only checkpoint {path} cannot be read from "
                              f"fastpersistd's memory: {why}")
    options.pop("daemon", None)
    return load_from(source, map_location, **options)


__all__ = ["DISK", "MEMORY", "Cadence", "load_memory_only", "memory_steps"]
