"""Talking to fastpersistd: addresses, calls, and errors as CheckpointErrors.

Addresses (FASTPERSIST_DAEMON or a `daemon=` argument):
    unix:///run/fastpersist/fastpersistd.sock   the node's daemon (the usual case)
    https://HOST:PORT                           TCP with TLS; the bearer token is read
                                                from FASTPERSIST_DAEMON_TOKEN_FILE and
                                                the CA from FASTPERSIST_DAEMON_CA_FILE

Torch-free (fpctl daemon status uses it).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from . import errors
from ._proto import fastpersist_pb2 as pb
from ._proto import fastpersist_pb2_grpc as pb_grpc
from .errors import CheckpointError, DaemonError, DaemonUnavailableError

# Unary calls are quick (no I/O waits in them); a daemon that does not answer
# in this long is treated as gone rather than hung on.
CALL_TIMEOUT = 60.0
CHUNK = 4 << 20  # SubmitStream data chunk
T = TypeVar("T")

# One id per client process: the daemon accounts staging and fairness by it.
CLIENT_ID = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def grpc_target(address: str) -> tuple[str, bool]:
    """(gRPC target, whether it is TCP with TLS) for a daemon address."""
    if address.startswith("unix://"):
        return "unix:" + address.removeprefix("unix://"), False
    if address.startswith("unix:"):
        return address, False
    if address.startswith("https://"):
        return address.removeprefix("https://").rstrip("/"), True
    raise DaemonError(
        f"daemon address {address!r} is not unix:///PATH or https://HOST:PORT", "INVALID_ARGUMENT"
    )


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
        target, tls = grpc_target(address)
        options = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
        if tls:
            ca_file = os.environ.get("FASTPERSIST_DAEMON_CA_FILE")
            token_file = os.environ.get("FASTPERSIST_DAEMON_TOKEN_FILE")
            if not token_file:
                raise DaemonError("a TCP daemon address needs FASTPERSIST_DAEMON_TOKEN_FILE",
                                  "UNAUTHENTICATED")
            token = Path(token_file).read_text().strip()
            creds = grpc.composite_channel_credentials(
                grpc.ssl_channel_credentials(Path(ca_file).read_bytes() if ca_file else None),
                grpc.access_token_call_credentials(token),
            )
            self.channel = grpc.secure_channel(target, creds, options)
        else:
            self.channel = grpc.insecure_channel(target, options)
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

    def info(self) -> pb.InfoResponse:
        reply: pb.InfoResponse = self._call("daemon info", lambda: self.stub.Info(
            pb.InfoRequest(), timeout=CALL_TIMEOUT))
        return reply

    def health(self, timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ...: the standard health service's answer."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self._call("health check", lambda: stub.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    @property
    def root(self) -> Path:
        if self._info is None:
            self._info = self.info()
        return Path(self._info.root)

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

    def begin_job(self, relative: str) -> str:
        reply = self._call(f"cannot begin distributed checkpoint {relative}",
                           lambda: self.stub.BeginJob(pb.BeginJobRequest(
                               path=relative, client_id=CLIENT_ID), timeout=CALL_TIMEOUT))
        return str(reply.job_id)

    def commit_job(self, job_id: str, manifest: bytes, node: str, *,
                   prepare_for: str = "") -> str:
        """Commit the job; with prepare_for, prepare this node's part (the
        node named commits the job) and return the prepared part's name."""
        what = "prepare" if prepare_for else "commit"
        reply = self._call(f"cannot {what} the distributed checkpoint", lambda: self.stub.CommitJob(
            pb.CommitJobRequest(job_id=job_id, manifest=manifest, node=node,
                                prepare_for=prepare_for), timeout=CALL_TIMEOUT))
        return str(reply.prepared)

    def resolve_prepared(self, relative: str, prepared: str, publish: bool) -> None:
        what = "publish" if publish else "discard"
        self._call(f"cannot {what} the prepared part {prepared} of {relative}",
                   lambda: self.stub.ResolvePrepared(pb.ResolvePreparedRequest(
                       path=relative, prepared=prepared, publish=publish),
                       timeout=CALL_TIMEOUT))

    def abort_job(self, job_id: str) -> None:
        self._call("cannot abort the distributed checkpoint", lambda: self.stub.AbortJob(
            pb.AbortJobRequest(job_id=job_id), timeout=CALL_TIMEOUT))

    def submit_shm(self, ident: str, index: int, header: bytes, segment: str, offset: int,
                   length: int) -> None:
        self._call(f"cannot hand data file {index} over", lambda: self.stub.SubmitShm(
            pb.SubmitShmRequest(
                checkpoint_id=ident, file=pb.DataFile(index=index, header=header),
                data=pb.ShmRef(segment=segment, offset=offset, length=length)),
            timeout=CALL_TIMEOUT))

    def submit_stream(self, ident: str, index: int, header: bytes, length: int,
                      chunks: Iterable[bytes | memoryview]) -> None:
        def messages() -> Iterator[pb.StreamChunk]:
            yield pb.StreamChunk(header=pb.StreamHeader(
                checkpoint_id=ident, file=pb.DataFile(index=index, header=header),
                data_length=length))
            for chunk in chunks:
                for start in range(0, len(chunk), CHUNK):
                    yield pb.StreamChunk(data=bytes(chunk[start:start + CHUNK]))

        self._call(f"cannot stream data file {index}", lambda: self.stub.SubmitStream(
            messages()))

    def commit(self, ident: str, tree_json: str, tensor_order: list[str]) -> None:
        self._call("cannot hand the checkpoint over", lambda: self.stub.Commit(
            pb.CommitRequest(checkpoint_id=ident, tree_json=tree_json,
                             tensor_order=tensor_order), timeout=CALL_TIMEOUT))

    def abort(self, ident: str) -> None:
        self._call("cannot abort", lambda: self.stub.Abort(
            pb.AbortRequest(checkpoint_id=ident), timeout=CALL_TIMEOUT))

    def wait(self, ident: str, min_files_written: int = 0,
             timeout: float | None = None) -> pb.CheckpointStatus:
        status: pb.CheckpointStatus = self._call("wait", lambda: self.stub.Wait(
            pb.WaitRequest(checkpoint_id=ident, min_files_written=min_files_written),
            timeout=timeout))
        return status

    def list(self, relative: str = "") -> pb.ListResponse:
        reply: pb.ListResponse = self._call("list", lambda: self.stub.List(
            pb.ListRequest(path=relative), timeout=CALL_TIMEOUT))
        return reply

    def delete(self, relative: str) -> None:
        self._call(f"cannot delete {relative}", lambda: self.stub.Delete(
            pb.DeleteRequest(path=relative), timeout=CALL_TIMEOUT))


def state_name(state: int) -> str:
    return str(pb.CheckpointStatus.State.Name(state)).lower()


def as_dict(status: pb.CheckpointStatus) -> dict[str, Any]:
    return {
        "checkpoint_id": status.checkpoint_id, "path": status.path,
        "state": state_name(status.state), "bytes_written": status.bytes_written,
        "bytes_total": status.bytes_total, "files_written": status.files_written,
        "files_total": status.files_total, "error": status.error,
    }
