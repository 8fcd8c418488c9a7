"""The daemon sink: the snapshot goes into shared memory, fastpersistd writes it.

Call sequence of one save (sink.py's steps; caller = the training thread,
writer = the pipeline's writer thread, daemon = fastpersistd):

    caller  2. begin: Open (Begin: the daemon checks the path and reserves
               staging; its reply is a stream of progress, and while it is
               open, the daemon's sign that we are alive). The files are cut
               for the least of FASTPERSIST_STAGING_BUDGET and the daemon's
               budgets (segments.staging_limit), and the reservation is at
               most that window: a save of any size goes through in windows.
               While other saves hold the daemon's budget, Open is refused
               and asked again (segments.open_when_room): the save waits
    caller  3. the pipeline copies each data file into a shared-memory buffer
               (the pool's buffers are segments), laid out as the file's data
    writer  4. SubmitShm per file; a tensor too large for the staging budget is
               streamed over gRPC instead (SubmitStream); with a budget, each
               buffer is taken back once the daemon wrote its file; then
               Commit: from its reply on, the checkpoint is the daemon's and is
               committed even if this process dies (owned() returns), and the
               writer follows the progress until the daemon reports it durable

Buffers (the rule in staging.py): a segment is lent to the daemon from its
SubmitShm on, and goes back to the pool only once the daemon reported its
file written or the checkpoint committed (handover.Handover); a segment whose
fate is unknown (a lost reply, a broken stream, a failed checkpoint whose
worker may still read it) is quarantined: unlinked and never reused, while the
daemon's mapping keeps its pages. What the caller is told is the daemon's
word: after a lost Commit reply or a broken Watch stream the writer asks the
daemon how the checkpoint ended (committed: success; failed: that failure; no
answer: DaemonMayStillCommitError).

The on-disk checkpoint is the same as an in-process save's: same header, same
layout, the manifest built by the daemon from the same pieces.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ..errors import CheckpointAbortedError
from ..knobs import current as current_knobs
from ..protocol.client import DaemonClient
from .files import StagedFiles
from .handover import Handover
from .local import Planned, cut, plan_state
from .segments import SegmentBuffers, open_when_room, socket_group, staging_limit
from .sink import SaveRequest
from .snapshot import FilePlan
from .staging import StagingPool


class DaemonJob:
    def __init__(self, handover: Handover, files: list[FilePlan], budget: int,
                 tree_json: str, tensor_order: list[str], request: SaveRequest) -> None:
        self.handover = handover
        self.files = files
        self.budget = budget
        self.tree_json = tree_json
        self.tensor_order = tensor_order
        self.request = request
        self.handed_over = threading.Event()
        self.error: BaseException | None = None  # set before handed_over if it failed

    def owned(self) -> None:
        """Until the daemon owns the checkpoint (Commit's reply), so that "the
        caller may change the state" and "the daemon owns it" are one moment."""
        self.handed_over.wait()
        if self.error is not None:
            raise self.error

    def write(self, files: StagedFiles, pool: StagingPool) -> None:
        handover = self.handover
        error: BaseException | None = None
        try:
            self._hand_over(files, pool)
        except BaseException as exc:
            error = exc
            if isinstance(exc, Exception):
                error = handover.outcome_after(exc, handed_over=self.handed_over.set)
        finally:
            handover.close()
        if error is not None:
            self.error = error
            self.handed_over.set()
            raise error
        self.handed_over.set()  # also when only the outcome query found it committed
        if self.request.on_commit is not None:
            self.request.on_commit(self.request.path)

    def _hand_over(self, files: StagedFiles, pool: StagingPool) -> None:
        handover = self.handover
        for index, staged in enumerate(files):
            if self.request.aborted():
                raise CheckpointAbortedError(f"save of {self.request.target} was aborted")
            handover.submit(index, staged)  # a file without a buffer is streamed
            handover.return_when_written(index, staged, files, pool)
        handover.commit(self.tree_json, self.tensor_order, self.request.after_commit)
        self.handed_over.set()
        handover.wait_end()


class DaemonSink:
    collective = False
    leader = True  # this process commits
    writes_in_process = False
    takes_urls = False

    def __init__(self, address: str) -> None:
        self.client = DaemonClient(address)
        self.segments = SegmentBuffers(socket_group(address))
        self.pool = StagingPool(self.segments.allocate, self.segments.free,
                                let_go=self.segments.free)

    def plan(self, obj: Any, request: SaveRequest) -> Planned:
        return plan_state(obj, request)

    def cut(self, planned: Planned, request: SaveRequest) -> list[FilePlan]:
        return cut(planned[1], request, staging_limit(self.client))[0]

    def staging_budget(self) -> int:
        """The window a save stages in (prepare_staging's budget)."""
        return staging_limit(self.client)

    def begin(self, planned: Planned, request: SaveRequest) -> DaemonJob:
        tree, stored = planned
        # First: it asks the daemon, whose root relative() then uses.
        limit = staging_limit(self.client)
        relative = self.client.relative(request.path)
        tree_json = json.dumps(tree, allow_nan=False)
        # Cut for the daemon's budgets too: a save larger than they allow goes
        # in windows of them instead of being refused at Open.
        files, budget = cut(stored, request, limit)
        staged_bytes = sum(f.nbytes for f in files if f.staged)
        # Unstaged files are streamed, and the daemon writes them to disk as they
        # arrive: they take none of its staging.
        reserve = min(staged_bytes, budget) if budget else staged_bytes
        compression = request.compression
        ident, stream = open_when_room(lambda: self.client.open(
            relative, reserve, len(files), compression=compression or "",
            frame_bytes=current_knobs().frame_bytes if compression else 0,
            durability="memory" if request.durability == "memory" else ""),
            f"cannot begin checkpoint {request.target}")
        handover = Handover(self.client, self.segments, ident, str(request.target), stream)
        return DaemonJob(handover, files, budget, tree_json, [t.name for t in stored], request)

    def close(self) -> None:
        self.client.close()


__all__ = ["DaemonJob", "DaemonSink"]
