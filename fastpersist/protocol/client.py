"""Talking to fastpersistd: calls, and errors as CheckpointErrors.

Addresses (FASTPERSIST_DAEMON or a `daemon=` argument) are channels.py's:
unix:///run/fastpersist/fastpersistd.sock, the node's daemon (the usual case),
or https://HOST:PORT (TCP with TLS and a token).

Torch-free (fpctl daemon status uses it).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from .. import errors
from .._proto import fastpersist_pb2 as pb
from .._proto import fastpersist_pb2_grpc as pb_grpc
from ..errors import CheckpointError, DaemonError, DaemonMayStillCommitError, DaemonUnavailableError
from ..storage.retention import AfterCommit
from .channels import open_channel
from .chunked import INLINE_HEADER_BYTES, LARGE_HEADERS, send_large, submit_messages

# Unary calls are quick (no I/O waits in them); a daemon that does not answer
# in this long is treated as gone rather than hung on.
CALL_TIMEOUT = 60.0
# Asking for a checkpoint's outcome after a lost reply (DaemonClient.outcome):
# how long a daemon that answers but finishes no file is waited for, how long
# one that cannot be reached is retried (a restarted daemon no longer knows the
# checkpoint, so waiting out a restart tells nothing), and one Wait's deadline.
OUTCOME_PATIENCE = 120.0
RECONNECT_WINDOW = 5.0
ASK_EVERY = 10.0
T = TypeVar("T")

# One id per client process: the daemon accounts staging and fairness by it.
CLIENT_ID = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


_CODE_ERRORS: dict[str, type[CheckpointError]] = {
    "ALREADY_EXISTS": errors.CheckpointExistsError,
    "PERMISSION_DENIED": errors.CheckpointPermissionError,
    "NOT_FOUND": errors.CheckpointNotFoundError,
}


def _error(exc: grpc.RpcError, address: str, what: str) -> CheckpointError:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    details = exc.details() or ""
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
        return DaemonUnavailableError(
            f"{what}: fastpersistd at {address} is not answering ({code}: {details})", code)
    cls = _CODE_ERRORS.get(code)
    if cls is not None:
        return cls(f"{what}: {details}")
    return DaemonError(f"{what}: fastpersistd refused ({code}): {details}", code)


COMMITTED = pb.CheckpointStatus.COMMITTED
TERMINAL = (pb.CheckpointStatus.COMMITTED, pb.CheckpointStatus.FAILED,
            pb.CheckpointStatus.ABORTED)


def failure(status: pb.CheckpointStatus) -> CheckpointError:
    """The error for a FAILED or ABORTED status, of the class the daemon named."""
    cls = getattr(errors, status.error_code, None)
    message = f"fastpersistd could not save {status.path}: {status.error}"
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        try:
            return cls(message)
        except TypeError:
            pass  # a class with required keyword arguments
    return CheckpointError(message)


class DaemonClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = pb_grpc.FastPersistStub(self.channel)  # type: ignore[no-untyped-call]
        self._info: pb.InfoResponse | None = None

    def close(self) -> None:
        self.channel.close()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise self.error(exc, what) from None

    def error(self, exc: grpc.RpcError, what: str) -> CheckpointError:
        """The CheckpointError for a failed call."""
        return _error(exc, self.address, what)

    # -- calls -------------------------------------------------------------

    def info(self, *, cached: bool = False, timeout: float = CALL_TIMEOUT) -> pb.InfoResponse:
        """The daemon's Info; cached: asked once (root, version, features do not change)."""
        info = self._info
        if not cached or info is None:
            info = self._info = self._call("daemon info", lambda: self.stub.Info(
                pb.InfoRequest(), timeout=timeout))
        return info

    def health(self, timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ...: the standard health service's answer."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self._call("health check", lambda: stub.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    @property
    def root(self) -> Path:
        return Path(self.info(cached=True).root)

    def relative(self, target: Path) -> str:
        """`target` relative to the daemon's root; refused if it lies outside."""
        real = Path(os.path.realpath(target))
        root = Path(os.path.realpath(self.root))
        try:
            rel = real.relative_to(root)
        except ValueError:
            raise DaemonError(
                f"{target} is outside fastpersistd's root {root}: checkpoints saved through "
                "the daemon must live under its --root", "INVALID_ARGUMENT") from None
        if not rel.parts:
            raise DaemonError(f"{target} is the daemon's root itself, not a checkpoint path",
                              "INVALID_ARGUMENT")
        return rel.as_posix()

    def begin(self, relative: str, staging_bytes: int, file_count: int, *, job_id: str = "",
              rank: int = 0) -> str:
        part = f"the part of rank {rank} of " if job_id else ""
        what = f"cannot begin {part}checkpoint {relative}"
        reply = self._call(what, lambda: self.stub.Begin(
            pb.BeginRequest(path=relative, client_id=CLIENT_ID, staging_bytes=staging_bytes,
                            file_count=file_count, job_id=job_id, rank=rank),
            timeout=CALL_TIMEOUT))
        return str(reply.checkpoint_id)

    def open(self, relative: str, staging_bytes: int, file_count: int, *, job_id: str = "",
             rank: int = 0, compression: str = "", frame_bytes: int = 0,
             durability: str = "") -> tuple[str, Any]:
        """Begin a checkpoint with Open: (its id, the stream of its statuses that
        follow). The open stream is this process's lease on the checkpoint: if
        it ends before Commit (this process died, or cancelled it), the daemon
        aborts the checkpoint at once. compression="zstd": the daemon packs the
        files in frames of frame_bytes (0: its default); one that would not
        (too old: it ignores the field) is refused here; so is one that would
        not keep a durability="memory" checkpoint in memory only."""
        part = f"the part of rank {rank} of " if job_id else ""
        what = f"cannot begin {part}checkpoint {relative}"
        call = self.stub.Open(pb.BeginRequest(
            path=relative, client_id=CLIENT_ID, staging_bytes=staging_bytes,
            file_count=file_count, job_id=job_id, rank=rank, compression=compression,
            frame_bytes=frame_bytes, durability=durability))
        # The first message is Begin's answer and gets its time limit; the rest
        # of the stream lasts as long as the checkpoint.
        timer = threading.Timer(CALL_TIMEOUT, call.cancel)
        timer.daemon = True
        timer.start()
        try:
            first = next(call)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise self.error(exc, what) from None
            # A daemon older than Open (and than compression): Begin, and Watch.
            self._check_compresses(what, compression, "")
            self._check_durability(what, durability, "")
            ident = self.begin(relative, staging_bytes, file_count, job_id=job_id, rank=rank)
            return ident, self.stub.Watch(pb.WaitRequest(checkpoint_id=ident))
        except StopIteration:
            raise DaemonError(f"{what}: fastpersistd ended the stream without an answer",
                              "INTERNAL") from None
        finally:
            timer.cancel()
        if first.compression != compression:
            call.cancel()  # (ends the lease: the daemon aborts the checkpoint)
            self._check_compresses(what, compression, first.compression)
        if first.durability != durability:
            call.cancel()
            self._check_durability(what, durability, first.durability)
        return str(first.checkpoint_id), call

    def _check_durability(self, what: str, asked: str, answered: str) -> None:
        if asked != answered:
            raise DaemonError(f"{what}: fastpersistd at {self.address} does not keep "
                              f"memory-only checkpoints (asked for durability {asked!r}, it "
                              f"answered {answered!r}): upgrade it or save to disk",
                              "FAILED_PRECONDITION")

    def _check_compresses(self, what: str, asked: str, answered: str) -> None:
        if asked != answered:
            raise DaemonError(f"{what}: fastpersistd at {self.address} does not compress "
                              f"(asked for {asked!r}, it answered {answered!r}): upgrade it "
                              "or save without compression", "FAILED_PRECONDITION")

    def begin_job(self, relative: str) -> str:
        reply = self._call(f"cannot begin distributed checkpoint {relative}",
                           lambda: self.stub.BeginJob(pb.BeginJobRequest(
                               path=relative, client_id=CLIENT_ID), timeout=CALL_TIMEOUT))
        return str(reply.job_id)

    def commit_job(self, job_id: str, manifest: bytes, node: str,
                   after_commit: AfterCommit | None = None,
                   files: dict[str, bytes] | None = None) -> str:
        """Commit a job, `files` written beside the manifest before it; returns
        what failed of after_commit ("": nothing)."""
        reply = self._call("cannot commit the distributed checkpoint", lambda: self._commit_job(
            pb.CommitJobRequest(job_id=job_id, node=node,
                                after_commit=_after_commit(after_commit)),
            pb.CommitJobRequest(manifest=manifest, files=files or {})))
        return str(reply.after_commit_error)

    def prepare_job(self, job_id: str, manifest: bytes, node: str, commit_node: str) -> str:
        """A node-local job's part on a node other than rank 0's (commit_node):
        durable but not visible; returns the prepared part's name."""
        reply = self._call("cannot prepare the distributed checkpoint", lambda: self._commit_job(
            pb.CommitJobRequest(job_id=job_id, node=node, prepare_for=commit_node),
            pb.CommitJobRequest(manifest=manifest)))
        return str(reply.prepared)

    def _commit_job(self, header: pb.CommitJobRequest, payload: pb.CommitJobRequest
                    ) -> pb.CommitJobResponse:
        reply: pb.CommitJobResponse = send_large(
            self.stub.CommitJob, self.stub.CommitJobStream, pb.CommitJobChunk, header, payload,
            CALL_TIMEOUT)
        return reply

    def resolve_prepared(self, relative: str, prepared: str, publish: bool) -> None:
        what = "publish" if publish else "discard"
        self._call(f"cannot {what} the prepared part {prepared} of {relative}",
                   lambda: self.stub.ResolvePrepared(pb.ResolvePreparedRequest(
                       path=relative, prepared=prepared, publish=publish),
                       timeout=CALL_TIMEOUT))

    def abort_job(self, job_id: str) -> None:
        self._call("cannot abort the distributed checkpoint", lambda: self.stub.AbortJob(
            pb.AbortJobRequest(job_id=job_id), timeout=CALL_TIMEOUT))

    def sends_header_apart(self, header: bytes) -> bool:
        """Whether a header goes out of its Submit message (the one rule for shm
        and streams): one over INLINE_HEADER_BYTES, to a daemon that takes that."""
        return (len(header) > INLINE_HEADER_BYTES
                and LARGE_HEADERS in self.info(cached=True).features)

    def submit_shm(self, ident: str, index: int, header: bytes, segment: str, offset: int,
                   length: int, header_at: tuple[str, int] | None = None) -> None:
        """header_at: the segment and offset where the header's bytes lie instead
        (then the message carries only its length, not a copy of up to 32 MiB)."""
        request = pb.SubmitShmRequest(
            checkpoint_id=ident,
            file=pb.DataFile(index=index, header=header if header_at is None else b""),
            data=pb.ShmRef(segment=segment, offset=offset, length=length))
        if header_at is not None:
            request.header_ref.CopyFrom(pb.ShmRef(segment=header_at[0], offset=header_at[1],
                                                  length=len(header)))
        self._call(f"cannot hand data file {index} over", lambda: self.stub.SubmitShm(
            request, timeout=CALL_TIMEOUT))

    def submit_stream(self, ident: str, index: int, header: bytes, length: int,
                      chunks: Iterable[bytes | memoryview]) -> None:
        in_parts = self.sends_header_apart(header)
        self._call(f"cannot stream data file {index}", lambda: self.stub.SubmitStream(
            submit_messages(ident, index, header, length, chunks, in_parts)))

    def commit(self, ident: str, tree_json: str, tensor_order: list[str], *,
               after_commit: AfterCommit | None = None, timeout: float = CALL_TIMEOUT) -> None:
        self._call("cannot hand the checkpoint over", lambda: send_large(
            self.stub.Commit, self.stub.CommitStream, pb.CommitChunk,
            pb.CommitRequest(checkpoint_id=ident, after_commit=_after_commit(after_commit)),
            pb.CommitRequest(tree_json=tree_json, tensor_order=tensor_order), timeout))

    def abort(self, ident: str) -> None:
        self._call("cannot abort", lambda: self.stub.Abort(
            pb.AbortRequest(checkpoint_id=ident), timeout=CALL_TIMEOUT))

    def wait(self, ident: str, min_files_written: int = 0,
             timeout: float | None = None) -> pb.CheckpointStatus:
        status: pb.CheckpointStatus = self._call("wait", lambda: self.stub.Wait(
            pb.WaitRequest(checkpoint_id=ident, min_files_written=min_files_written),
            timeout=timeout))
        return status

    def outcome(self, ident: str, commit: tuple[str, list[str], AfterCommit | None] | None = None,
                patience: float | None = None,
                handed_over: Callable[[], None] = lambda: None) -> pb.CheckpointStatus:
        """How checkpoint `ident` ended, asked after its Commit reply or its
        progress stream was lost: its COMMITTED, FAILED or ABORTED status.

        commit=(tree_json, tensor_order, after_commit) when Commit's reply was lost: Commit is
        sent again first, so that the daemon holds it either way (a second
        Commit is refused with FAILED_PRECONDITION if the first arrived);
        handed_over() runs once the daemon answered it. Each
        attempt uses a new channel, since the old one may be broken. Keeps
        asking while the daemon answers and finishes files; raises
        DaemonMayStillCommitError after `patience` (OUTCOME_PATIENCE) seconds
        without either, after RECONNECT_WINDOW seconds of not reaching it, or
        when it no longer knows the checkpoint (it restarted). Raises the
        DaemonError with which the daemon refused a re-sent Commit otherwise
        (then it does not hold the checkpoint: not committed).
        """
        patience = OUTCOME_PATIENCE if patience is None else patience
        deadline = time.monotonic() + patience
        unreachable_since: float | None = None
        written = 0  # files the daemon reported written
        pause = 0.05
        last: DaemonUnavailableError | None = None
        while True:
            now = time.monotonic()
            if now > deadline or (unreachable_since is not None
                                  and now - unreachable_since > RECONNECT_WINDOW):
                raise DaemonMayStillCommitError(
                    f"lost track of checkpoint {ident}: fastpersistd at {self.address} may "
                    f"still commit it, or may have ({last})", "UNAVAILABLE") from last
            fresh = DaemonClient(self.address)
            try:
                if commit is not None:
                    fresh._commit_again(ident, commit, min(ASK_EVERY, deadline - now))
                    commit = None
                    handed_over()
                status = fresh._wait_for_news(ident, written, min(ASK_EVERY, deadline - now))
            except DaemonUnavailableError as exc:
                last = exc
                if exc.code == "DEADLINE_EXCEEDED":
                    unreachable_since = None  # reached, but nothing finished meanwhile
                else:
                    unreachable_since = unreachable_since or now
                    time.sleep(pause)
                    pause = min(pause * 2, 1.0)
                continue
            finally:
                fresh.close()
            unreachable_since, pause = None, 0.05
            if status.state in TERMINAL:
                return status
            if status.files_written > written:
                written = status.files_written
                deadline = time.monotonic() + patience

    def _commit_again(self, ident: str, commit: tuple[str, list[str], AfterCommit | None],
                      timeout: float) -> None:
        """Commit, as a retry of one whose reply was lost."""
        try:
            self.commit(ident, commit[0], commit[1], after_commit=commit[2], timeout=timeout)
        except DaemonError as exc:
            # FAILED_PRECONDITION: the first Commit arrived, or the checkpoint
            # had ended (Wait says which). Anything else: refused, not held.
            if isinstance(exc, DaemonUnavailableError) or exc.code != "FAILED_PRECONDITION":
                raise

    def _wait_for_news(self, ident: str, written: int, timeout: float) -> pb.CheckpointStatus:
        """The status once one more file than `written` is durable, or at the
        end: progress shows a daemon still at work. DaemonUnavailableError: ask
        again."""
        try:
            return self.wait(ident, min_files_written=written + 1, timeout=timeout)
        except DaemonUnavailableError:
            raise
        except CheckpointError as exc:  # NOT_FOUND: it restarted since
            raise DaemonMayStillCommitError(
                f"fastpersistd at {self.address} cannot say how checkpoint {ident} ended "
                f"({exc}): it may have committed it", getattr(exc, "code", "")) from exc

    def list(self, relative: str = "", timeout: float = CALL_TIMEOUT) -> pb.ListResponse:
        reply: pb.ListResponse = self._call("list", lambda: self.stub.List(
            pb.ListRequest(path=relative), timeout=timeout))
        return reply

    def memory_copy(self, relative: str, timeout: float) -> pb.MemoryCopyResponse:
        """MemoryCopy: the daemon's copy in memory of the checkpoint at `relative`
        (directory "" when it holds none)."""
        reply: pb.MemoryCopyResponse = self._call(
            f"cannot ask for the memory copy of {relative}", lambda: self.stub.MemoryCopy(
                pb.MemoryCopyRequest(path=relative), timeout=timeout))
        return reply

    def delete(self, relative: str) -> None:
        self._call(f"cannot delete {relative}", lambda: self.stub.Delete(
            pb.DeleteRequest(path=relative), timeout=CALL_TIMEOUT))


def _after_commit(policy: AfterCommit | None) -> pb.AfterCommit | None:
    if policy is None:
        return None
    return pb.AfterCommit(point_latest=policy.point_latest, keep_last=policy.keep_last or 0,
                          keep_every=policy.keep_every or 0, skip_tier=not policy.upload)

