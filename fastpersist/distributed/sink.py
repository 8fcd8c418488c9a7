"""The distributed sink: a save over a process group, each unique byte written
by one rank, rank 0 committing the job (coordinator.Save), through the save
pipeline (saving/pipeline.py) like every other save.

In sink.py's steps: plan takes the state as it is (the job's describe and
plan phases need every rank, so they run in begin); begin runs the quick
half of the job in the caller (describe, plan, stage: a few small
collectives) and knows this rank's pieces, the only tensors it stages;
write runs the other half on the writer thread (write, commit) and the
policies after the commit. The pipeline runs one save at a time (collective):
every rank must run the job's collectives in the same order, and the writer
thread's and the caller's share one gloo group. That group is not the
training group, so the background exchanges never block training collectives.

Where a rank's files go is the job's Storage: written in-process (a blocking
save then writes straight from the live tensors), or copied into shared
memory and handed to the rank's node's fastpersistd as one part of the job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointAbortedError, DistributedCheckpointError
from ..knobs import current as current_knobs
from ..saving.files import StagedFiles
from ..saving.local import cut
from ..saving.sink import SaveRequest
from ..saving.snapshot import FilePlan
from ..saving.staging import StagingPool
from .coordinator import Save, coordinator_for
from .phases import Coordinator
from .storage import Storage, ThroughDaemon, storage_for

# Through a daemon a rank's part is cut into files of at most this much (or
# FASTPERSIST_FILE_BYTES, if less): a blocking save hands each file over as
# soon as it is copied, and files this small let the daemon begin writing
# early and leave a short last copy (with 256 MiB files a rank's quarter of a
# 1 GiB state was written only once all of it was copied). Async saves through
# the daemon are cut the same way, so that both kinds reuse one set of
# shared-memory buffers (a different cut would map new segments at each switch).
DAEMON_FILE_BYTES = 64 << 20


class DistributedJob:
    """One save of the job; the files are this rank's pieces, cut for the
    staging budget like any save's (saving/local.cut): a share larger than
    the budget is copied in windows, each buffer back in the pool once its
    file is written (Storage.write). If this rank could not work out its
    files, it has none: the error is reported in the write phase, so that
    every rank fails the save together."""

    def __init__(self, job: Save, rank: int, request: SaveRequest,
                 budget: Callable[[], int | None], file_bytes: int | None) -> None:
        self.job = job
        self.rank = rank
        self.request = request
        self.error: BaseException | None = None
        self.files: list[FilePlan] = []
        self.budget = 0
        try:
            files, self.budget = cut(job.my_pieces(), request, budget(), file_bytes)
            self.files = [f for f in files if f.tensors]
        except Exception as exc:
            self.error = exc

    def owned(self) -> None:
        """The copies are all there is: the write phase needs every rank."""

    def write(self, files: StagedFiles, pool: StagingPool) -> None:
        job, request = self.job, self.request
        try:
            job.finish(files if self.error is None else self.error)
            if request.on_commit is not None or job.after_commit_policy is not None:
                # `latest` and retention are done; every rank returns after.
                job.after_commit(request.on_commit)
        except DistributedCheckpointError as exc:
            if request.aborted() and set(exc.failures) == {self.rank}:
                # Failed only because we gave it up: to us, that is an abort.
                aborted = CheckpointAbortedError(f"save of {request.target} was aborted")
                raise aborted from exc
            raise


class DistributedSink:
    collective = True
    takes_urls = False

    def __init__(self, group: dist.ProcessGroup | None, *, node_local: bool = False,
                 daemon: str = "", union: bool = False) -> None:
        self.co: Coordinator = coordinator_for(group)
        self.node_local = node_local
        self.union = union  # ranks may hold different tensors (api.save)
        self.storage: Storage = storage_for(daemon)
        self.pool = self.storage.pool
        # In-process, a blocking save writes from the live tensors in the caller.
        self.writes_in_process = not isinstance(self.storage, ThroughDaemon)
        self.leader = self.co.rank == 0  # rank 0 commits the job

    def plan(self, obj: Any, request: SaveRequest) -> Any:
        return obj  # planned with the other ranks, in begin

    def cut(self, planned: Any, request: SaveRequest) -> list[FilePlan] | None:
        return None  # a rank learns its share at each save

    def staging_budget(self) -> int:
        budget = self._budget()
        return current_knobs().staging_budget if budget is None else budget

    def _budget(self) -> int | None:
        """The window a rank's share is staged in: None for
        FASTPERSIST_STAGING_BUDGET; through the daemon, the least of that and
        the daemon's budgets (its Open would refuse more)."""
        if isinstance(self.storage, ThroughDaemon):
            from ..saving.segments import staging_limit  # grpc: only with a daemon

            return staging_limit(self.storage.client)
        return None

    def begin(self, planned: Any, request: SaveRequest) -> DistributedJob:
        if request.durability != "disk":
            raise ValueError("a distributed save cannot be memory-only")
        job = Save(self.co, planned, request.path, self.storage, node_local=self.node_local,
                   allow_pickle=request.allow_pickle, aborted=request.aborted,
                   after_commit=request.after_commit, compression=request.compression,
                   union=self.union)
        job.prepare()  # raises the same error on every rank
        # From here on an error is this rank's alone: DistributedJob keeps it
        # for the write phase (the daemon's budgets are asked there too).
        cap = DAEMON_FILE_BYTES if isinstance(self.storage, ThroughDaemon) else None
        return DistributedJob(job, self.co.rank, request, self._budget, cap)

    def close(self) -> None:
        self.storage.close()


__all__ = ["DAEMON_FILE_BYTES", "DistributedJob", "DistributedSink"]
