"""Where a save's bytes go: the seam between the one save pipeline
(pipeline.py) and its destinations, as DCP's StorageWriter is the seam
between its planner and its storage.

A Sink is one kind of destination, for the life of a pipeline: local files
(local.py), fastpersistd (remote.py), a torch.distributed job
(distributed/sink.py), an object store (store_sink.py). Each save is a
SinkJob. Call sequence (caller = the thread that calls save, writer = the
pipeline's writer thread):

    caller  1. planned = sink.plan(obj, request)    flatten and plan the state
                                                    (quick, raises early)
    caller  2. job = sink.begin(planned, request)   reserve the destination: a
                                                    staging directory, a daemon's
                                                    Open, a job's collectives
    caller  3. the pipeline copies job.files into buffers from sink.pool and
               hands them to the writer (StagedFiles)
    writer  4. job.write(files, pool)               everything else: the files
                                                    durable, the commit, the
                                                    request's after_commit and
                                                    on_commit; raises the failure
                                                    to report, having cleaned up
    any     5. job.owned()                          blocks until the destination
                                                    owns the snapshot (a daemon's
                                                    hand-over); wait_snapshot()
                                                    waits for it

A sink whose saves are `collective` (a distributed job) runs one save at a
time, in the same order on every rank; the pipeline waits for the previous
save before step 1 of the next, and a copy failure in step 3 is reported by
the job (on every rank), not raised at once. A sink that `writes_in_process`
can also write straight from the live tensors, in the caller's thread, for a
blocking save (no staging, no copy).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import StoreURLError
from ..storage.local_path import checkpoint_path
from ..storage.retention import AfterCommit
from ..tier.url import TierURL, is_tier_url
from .files import StagedFiles
from .snapshot import FilePlan
from .staging import StagingPool


@dataclass(frozen=True)
class SaveRequest:
    """One save's options, as the pipeline took them at the call."""

    # A local path; an s3:// URL only for a sink that takes_urls (store_sink.py).
    target: Path | TierURL
    allow_pickle: bool = False
    compression: str | None = None
    # Hand each file to the writer as soon as it is copied (a blocking save,
    # whose caller waits for the writes anyway), instead of after the whole copy.
    overlap_writes: bool = False
    # A Checkpointer's policy (the `latest` pointer, retention), applied by
    # whoever commits, right after the commit.
    after_commit: AfterCommit | None = None
    # Runs after the commit (a distributed job: on rank 0); its failure fails
    # the save, which is committed all the same.
    on_commit: Callable[[Path], None] | None = None
    # The pipeline gave the save up (close(abort=True)): stop before the commit.
    aborted: Callable[[], bool] = field(default=lambda: False)
    # Written from the live tensors in the caller's thread (save_blocking):
    # nothing staged, so the files are cut without a staging budget.
    inline: bool = False
    # "memory": kept in fastpersistd's memory tier only, not written to disk
    # (a daemon sink only; Checkpointer's memory_every).
    durability: str = "disk"

    @property
    def path(self) -> Path:
        """The local target, for a sink that takes no URLs (never given one)."""
        if not isinstance(self.target, Path):
            raise TypeError(f"{self.target} is not a local path")
        return self.target


def target_of(path: str | os.PathLike[str], takes_urls: bool) -> Path | TierURL:
    """A save's target: an s3:// URL, for a sink that takes them (StoreURLError
    if it names no bucket or has a bad key component), else an absolute path
    (storage/local_path.py, which refuses every URL with a hint)."""
    text = os.fspath(path)
    if takes_urls and isinstance(text, str) and is_tier_url(text):
        try:
            return TierURL.parse(text)
        except ValueError as exc:
            raise StoreURLError(str(exc)) from None
    return checkpoint_path(path)


class SinkJob(Protocol):
    @property
    def files(self) -> list[FilePlan]:
        """The data files this process stages, in order."""

    @property
    def budget(self) -> int:
        """Staging bytes the snapshot may take at once (0: no limit)."""

    def write(self, files: StagedFiles, pool: StagingPool) -> None: ...

    def owned(self) -> None: ...


class Sink(Protocol):
    @property
    def pool(self) -> StagingPool: ...

    @property
    def collective(self) -> bool: ...

    @property
    def writes_in_process(self) -> bool: ...

    @property
    def takes_urls(self) -> bool:
        """Whether its targets are s3:// URLs (store_sink.py) rather than paths."""

    @property
    def leader(self) -> bool:
        """Whether this process commits (a distributed job: rank 0)."""

    def plan(self, obj: Any, request: SaveRequest) -> Any: ...

    def cut(self, planned: Any, request: SaveRequest) -> list[FilePlan] | None:
        """The files a save of `planned` stages (for prepare_staging); None
        when only the save itself can tell (a distributed job's share)."""

    def staging_budget(self) -> int:
        """The staging a save may take at once (0: no limit): the budget that
        prepare_staging prepares for and cut() cuts for."""

    def begin(self, planned: Any, request: SaveRequest) -> SinkJob: ...

    def close(self) -> None: ...


__all__ = ["SaveRequest", "Sink", "SinkJob", "target_of"]
