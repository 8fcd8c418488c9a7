"""One checkpoint's way through fastpersistd, as its client sees it, and which
lent buffers the daemon is known to be done with.

    handover = Handover(client, segments, ident, what)  # opens the Watch stream
    handover.submit(index, staged)           # lends staged's buffer to the daemon
    handover.wait_written(n)                 # files 0..n-1 durable: their buffers returned
    handover.commit(tree_json, tensor_order) # from its reply on, the daemon's
    handover.wait_end()                      # COMMITTED: every buffer returned
    ... on an exception exc:
    error = handover.outcome_after(exc)      # None: the daemon committed it all the same
    ... finally:
    handover.close(); pool.give_back(staged) for each staged file (the pool decides)

Only what the daemon reports returns a lent buffer: a file is done once the
daemon counts it written (files are written in the order submitted, one at a
time per checkpoint), all of them once the checkpoint is committed. A failed
or aborted checkpoint returns only the files it had written: a worker may
still be reading the next one when the status changes. Everything else is
quarantined by StagingPool.give_back.

What the caller is told is the daemon's word too. Before Commit was sent the
daemon cannot commit the checkpoint, so an error then is the outcome (and the
checkpoint is aborted). After Commit was sent, a lost reply or a broken stream
says nothing about the checkpoint: the client asks the daemon
(DaemonClient.outcome) and reports what it says, or DaemonMayStillCommitError.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import grpc

from .._proto import fastpersist_pb2 as pb
from ..errors import (
    CheckpointError,
    DaemonError,
    DaemonMayStillCommitError,
    DaemonUnavailableError,
    PostCommitError,
)
from ..protocol.client import COMMITTED, TERMINAL, DaemonClient, failure
from ..storage.retention import AfterCommit
from .files import StagedFiles
from .segments import SegmentBuffers, submit_staged
from .snapshot import StagedFile
from .staging import StagingPool


class Progress:
    """Follows a checkpoint's progress stream on a thread of its own: Open's
    (DaemonClient.open), or a Watch. The open stream is also the daemon's sign
    that this client is alive: if it closes before Commit (this process died),
    the daemon aborts the checkpoint."""

    def __init__(self, client: DaemonClient, ident: str, call: Any = None) -> None:
        self._cond = threading.Condition()
        self._status: pb.CheckpointStatus | None = None
        self._error: BaseException | None = None
        self._ended = False
        self._client = client
        self._call = call if call is not None else client.stub.Watch(
            pb.WaitRequest(checkpoint_id=ident))
        self._thread = threading.Thread(target=self._follow, name="fastpersist-watch",
                                        daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for status in self._call:
                with self._cond:
                    self._status = status
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self._error = self._client.error(exc, "lost the checkpoint's progress stream")
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def wait(self, files_written: int | None = None) -> pb.CheckpointStatus:
        """The status once `files_written` files are durable (None: at the
        end), or at the end if that comes first (COMMITTED, FAILED, ABORTED).
        Raises DaemonUnavailableError if the stream breaks first."""
        with self._cond:
            while True:
                s = self._status
                if s is not None and (s.state in TERMINAL or (
                        files_written is not None and s.files_written >= files_written)):
                    return s
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise DaemonUnavailableError(
                        "fastpersistd closed the progress stream before the checkpoint finished")
                self._cond.wait()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)


SUBMITTING, COMMITTING, HANDED_OVER = "submitting", "committing", "handed over"


class Handover:
    """See the module docstring. `what` names the checkpoint in errors."""

    def __init__(self, client: DaemonClient, segments: SegmentBuffers, ident: str,
                 what: str, stream: Any = None) -> None:
        self.client = client
        self.segments = segments
        self.ident = ident
        self.what = what
        self.stage = SUBMITTING
        self.status: pb.CheckpointStatus | None = None  # the latest the daemon reported
        self._lent: list[tuple[int, StagedFile]] = []
        self._commit: tuple[str, list[str], AfterCommit | None] | None = None
        self.progress = Progress(client, ident, stream)

    def submit(self, index: int, staged: StagedFile, *, stream: bool = False) -> None:
        """stream=True: send the file's bytes instead of lending its buffer."""
        self._lent.append((index, staged))  # lent (or not) by submit_staged
        submit_staged(self.client, self.segments, self.ident, index, staged, stream=stream)

    def wait_written(self, files: int) -> None:
        """Until the first `files` files are durable (their buffers are returned)."""
        self._seen(self.progress.wait(files_written=files))

    def return_when_written(self, index: int, staged: StagedFile, files: StagedFiles,
                            pool: StagingPool) -> None:
        """After submit(index, staged): if `files` are larger than their window
        and more follow, the caller may be waiting for this buffer: wait until
        the daemon has written the file, then give the buffer back. (Files that
        fit are submitted whole: the daemon goes from one file to the next
        without waiting for us.)"""
        if files.windowed and index < files.count - 1:
            self.wait_written(index + 1)
            pool.give_back(staged)

    def commit(self, tree_json: str, tensor_order: list[str],
               after_commit: AfterCommit | None = None) -> None:
        """Hand the checkpoint over; from the reply on it is the daemon's.
        after_commit: a Checkpointer's policy, which the daemon applies."""
        self.stage = COMMITTING
        self._commit = (tree_json, tensor_order, after_commit)
        self.client.commit(self.ident, tree_json, tensor_order, after_commit=after_commit)
        self.stage = HANDED_OVER

    def wait_end(self) -> pb.CheckpointStatus:
        """Until the daemon committed the checkpoint; raises its failure otherwise."""
        status = self.progress.wait()
        self._seen(status)
        return status

    def _seen(self, status: pb.CheckpointStatus) -> None:
        """Take the daemon's report: return the buffers it finished reading;
        raise its failure if the checkpoint ended without a commit."""
        self.status = status
        for index, staged in self._lent:
            if status.state == COMMITTED or index < status.files_written:
                staged.returned()
        if status.state in TERMINAL and status.state != COMMITTED:
            raise failure(status)
        if status.state == COMMITTED and status.after_commit_error:
            raise PostCommitError(status.after_commit_error)

    def outcome_after(self, exc: Exception, handed_over: Callable[[], None] = lambda: None
                      ) -> BaseException | None:
        """What to report after `exc` interrupted the hand-over: None when the
        daemon committed the checkpoint all the same, otherwise the error.
        handed_over() runs if a lost Commit reply turns out to have been, or
        now is, accepted (then the outcome follows later)."""
        if self.status is not None and self.status.state in TERMINAL:
            return exc  # the daemon's own report
        if self.stage == SUBMITTING or (self.stage == COMMITTING
                                        and not isinstance(exc, DaemonUnavailableError)):
            # The daemon holds no Commit (none was sent, or it refused it), so
            # it will not commit the checkpoint; abort it now rather than when
            # it notices that the stream is gone. Refused once it has ended.
            error = self._cause(exc)
            with contextlib.suppress(CheckpointError):
                self.client.abort(self.ident)
            return error
        # Commit was sent: only the daemon knows what became of it.
        try:
            status = self.client.outcome(
                self.ident, self._commit if self.stage == COMMITTING else None,
                handed_over=handed_over)
        except DaemonMayStillCommitError as unknown:
            error = DaemonMayStillCommitError(f"{self.what}: {exc}; {unknown}", unknown.code)
            error.__cause__ = exc
            return error
        except CheckpointError as refused:  # a re-sent Commit, refused: not the daemon's
            return refused
        try:
            self._seen(status)
        except CheckpointError as failed:
            return failed
        return None

    def _cause(self, exc: Exception) -> BaseException:
        """A call refused because the checkpoint already failed in the daemon
        (a full disk while the first files were written, say) reports that
        failure, not the refusal."""
        if not isinstance(exc, DaemonError) or exc.code != "FAILED_PRECONDITION":
            return exc
        try:
            status = self.client.wait(self.ident, timeout=5.0)
        except CheckpointError:
            return exc
        try:
            self._seen(status)
        except CheckpointError as failed:
            return failed
        return exc

    def close(self) -> None:
        self.progress.close()
