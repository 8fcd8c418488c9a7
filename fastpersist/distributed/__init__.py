"""Distributed checkpoints: one writer per unique byte across the job's ranks.

planner.py      who writes what (pure, deterministic, cached)
describe.py     a rank's tensors as boxes of global tensors (plain and DTensor)
layout.py       storage domains, the pieces a rank holds, the job manifest
coordinator.py  the save protocol over a gloo group of its own
sink.py         the save pipeline's sink for a job (saving/pipeline.py)
phases.py       that group, and every rank's agreement on each phase
commit_point.py the commit, and one outcome on every rank when ranks are lost
outcome.py      deciding that outcome, and naming the lost ranks, in the job's store
settling.py     node-local parts left in doubt, decided by the job's nodes together
storage.py      where the bytes go: in-process, or through each node's fastpersistd
external.py     a save another framework planned (DCP's): the ranks' files, the commit
restore.py      loading in any job size or layout (resharding)

settle() is the one public name here; torch is imported on its first use.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "settle":
        from .settling import settle

        return settle
    raise AttributeError(f"module 'fastpersist.distributed' has no attribute {name!r}")


__all__ = ["settle"]
