"""The gRPC face of the daemon: request checks, error codes, servers.

Every handler turns a request into a call on checkpoints.Service. Whatever a
request holds, the daemon answers with a status code (INVALID_ARGUMENT for
malformed input) and never dies of it: unexpected exceptions become INTERNAL
and are logged. Two servers share one servicer: the Unix socket (no auth; the
socket's 0660 mode is the access control) and, optionally, TCP with TLS and a
bearer token.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import stat
import traceback
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .. import knobs, shm
from .._proto import fastpersist_pb2 as pb
from .._proto import fastpersist_pb2_grpc as pb_grpc
from .._version import __version__
from ..commit import delete_checkpoint
from ..errors import CheckpointError, ManifestError
from ..format.manifest import MANIFEST_NAME, Manifest
from . import logs
from .checkpoints import MAX_TENSORS, RequestError, Service, anonymous_buffer, invalid
from .paths import PathError, confine

SERVICE_NAME = "fastpersist.v1.FastPersist"
MAX_MESSAGE_BYTES = 64 << 20
MAX_STREAM_CHUNK = 16 << 20
# Each open Watch holds a worker thread; beyond this, calls are refused
# (RESOURCE_EXHAUSTED) instead of queueing behind long-running streams.
MAX_WORKERS = 128

T = TypeVar("T")


def _status(d: dict[str, Any]) -> pb.CheckpointStatus:
    return pb.CheckpointStatus(**d)


class Servicer(pb_grpc.FastPersistServicer):
    def __init__(self, service: Service, direct_io: bool) -> None:
        self.service = service
        self.direct_io = direct_io

    # Each handler body runs through _guard: errors become status codes.
    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RequestError as exc:
            self._reject(context, exc.code, str(exc))
        except (PathError, shm.SegmentError) as exc:
            self._reject(context, "INVALID_ARGUMENT", str(exc))
        except CheckpointError as exc:
            self._reject(context, "FAILED_PRECONDITION", str(exc))
        except Exception as exc:
            if context.code() is not None:
                raise  # context.abort's own exception: the status is set already
            if isinstance(exc, grpc.RpcError) and not context.is_active():
                # The client went away mid-request (a broken stream): nobody to
                # answer. Its checkpoint is aborted when its Watch lease breaks.
                logs.info("request-cancelled", peer=context.peer())
                raise
            logs.event(logging.ERROR, "internal-error", error=repr(exc),
                       traceback=traceback.format_exc())
            self._reject(context, "INTERNAL", f"fastpersistd failed on this request: {exc!r}")
        raise AssertionError("unreachable")  # context.abort raises

    def _reject(self, context: grpc.ServicerContext, code: str, message: str) -> None:
        self.service.metrics.rejected.labels(code=code).inc()
        logs.info("rejected", code=code, reason=message, peer=context.peer())
        context.abort(getattr(grpc.StatusCode, code), message)

    def _path(self, relative: str, *, allow_root: bool = False) -> Path:
        return confine(self.service.root, relative, allow_root=allow_root)

    # -- RPCs ----------------------------------------------------------------

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        s = self.service
        return pb.InfoResponse(
            version=__version__, root=str(s.root), staging_budget=s.budgets.staging,
            staging_in_use=s.reserved(), checkpoints_in_flight=len(s.in_flight()),
            direct_io=self.direct_io, io_backend=knobs.current().io_backend,
        )

    def Begin(self, request: pb.BeginRequest, context: grpc.ServicerContext
              ) -> pb.BeginResponse:
        def run() -> pb.BeginResponse:
            target = self._path(request.path)
            ck = self.service.begin(target, request.path.strip("/"), request.client_id,
                                    request.staging_bytes, request.file_count,
                                    request.job_id, request.rank)
            return pb.BeginResponse(checkpoint_id=ck.id)
        return self._guard(context, run)

    def SubmitShm(self, request: pb.SubmitShmRequest, context: grpc.ServicerContext
                  ) -> pb.SubmitResponse:
        def run() -> pb.SubmitResponse:
            f, ref = request.file, request.data
            ck, entries = self.service.check_submit(request.checkpoint_id, f.index, f.header,
                                                    ref.length)
            mapping = shm.open_range(self.service.shm_dir, ref.segment, ref.offset, ref.length)
            self.service.submit(ck, f.index, f.header, entries, mapping)
            return pb.SubmitResponse()
        return self._guard(context, run)

    def SubmitStream(self, request_iterator: Iterator[pb.StreamChunk],
                     context: grpc.ServicerContext) -> pb.SubmitResponse:
        def run() -> pb.SubmitResponse:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("part") != "header":
                raise invalid("a SubmitStream must start with a header chunk")
            head = first.header
            length = head.data_length
            ck, entries = self.service.check_submit(head.checkpoint_id, head.file.index,
                                                    head.file.header, length)
            buffer = anonymous_buffer(length)
            try:
                received = 0
                for chunk in request_iterator:
                    if chunk.WhichOneof("part") != "data":
                        raise invalid("only data chunks may follow the header chunk")
                    n = len(chunk.data)
                    if received + n > length:
                        raise invalid(f"the stream carries more than the {length} bytes its "
                                      "header announced")
                    buffer.view[received:received + n] = chunk.data
                    received += n
                if received != length:
                    raise invalid(f"the stream ended after {received} of {length} bytes")
            except BaseException:
                buffer.close()
                raise
            self.service.submit(ck, head.file.index, head.file.header, entries, buffer)
            return pb.SubmitResponse()
        return self._guard(context, run)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext
               ) -> pb.CommitResponse:
        def run() -> pb.CommitResponse:
            if len(request.tensor_order) > MAX_TENSORS:
                raise invalid(f"tensor_order has more than {MAX_TENSORS} names")
            self.service.commit(request.checkpoint_id, request.tree_json,
                                list(request.tensor_order))
            return pb.CommitResponse()
        return self._guard(context, run)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        def run() -> pb.AbortResponse:
            self.service.abort(request.checkpoint_id)
            return pb.AbortResponse()
        return self._guard(context, run)

    def Wait(self, request: pb.WaitRequest, context: grpc.ServicerContext
             ) -> pb.CheckpointStatus:
        return self._guard(context, lambda: _status(self.service.wait(
            request.checkpoint_id, request.min_files_written, alive=context.is_active)))

    def Watch(self, request: pb.WaitRequest, context: grpc.ServicerContext
              ) -> Iterator[pb.CheckpointStatus]:
        statuses = self.service.watch(request.checkpoint_id, alive=context.is_active)
        # The generator's first step raises NOT_FOUND; later ones only yield.
        try:
            first = next(statuses)
        except RequestError as exc:
            self._reject(context, exc.code, str(exc))
            return
        except StopIteration:
            return
        yield _status(first)
        for status in statuses:
            yield _status(status)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        def run() -> pb.ListResponse:
            directory = self._path(request.path, allow_root=True)
            if not directory.is_dir():
                raise RequestError("NOT_FOUND", f"{request.path or '.'} is not a directory")
            entries = [e for e in (_entry(p) for p in sorted(directory.iterdir())) if e]
            # Without ids: an id is the capability to submit to, commit or abort a
            # checkpoint, and only the client that began it should hold it.
            in_flight = [_status({**c.status(), "checkpoint_id": ""})
                         for c in self.service.in_flight() if directory in c.target.parents]
            return pb.ListResponse(entries=entries, in_flight=in_flight)
        return self._guard(context, run)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext
               ) -> pb.DeleteResponse:
        def run() -> pb.DeleteResponse:
            target = self._path(request.path)
            if not (target / MANIFEST_NAME).is_file():
                raise RequestError("NOT_FOUND", f"{request.path} is not a committed checkpoint")
            if self.service.busy_at(target):
                raise RequestError("FAILED_PRECONDITION",
                                   f"a checkpoint of {request.path} is in flight")
            delete_checkpoint(target)
            logs.info("deleted", path=request.path)
            return pb.DeleteResponse()
        return self._guard(context, run)

    def BeginJob(self, request: pb.BeginJobRequest, context: grpc.ServicerContext
                 ) -> pb.BeginJobResponse:
        def run() -> pb.BeginJobResponse:
            target = self._path(request.path)
            job_id = self.service.begin_job(target, request.path.strip("/"), request.client_id)
            return pb.BeginJobResponse(job_id=job_id)
        return self._guard(context, run)

    def CommitJob(self, request: pb.CommitJobRequest, context: grpc.ServicerContext
                  ) -> pb.CommitJobResponse:
        def run() -> pb.CommitJobResponse:
            prepared = self.service.commit_job(request.job_id, request.manifest, request.node,
                                               request.prepare_for)
            return pb.CommitJobResponse(prepared=prepared)
        return self._guard(context, run)

    def ResolvePrepared(self, request: pb.ResolvePreparedRequest,
                        context: grpc.ServicerContext) -> pb.ResolvePreparedResponse:
        def run() -> pb.ResolvePreparedResponse:
            target = self._path(request.path)
            self.service.resolve_prepared(target, request.path.strip("/"), request.prepared,
                                          request.publish)
            return pb.ResolvePreparedResponse()
        return self._guard(context, run)

    def AbortJob(self, request: pb.AbortJobRequest, context: grpc.ServicerContext
                 ) -> pb.AbortJobResponse:
        def run() -> pb.AbortJobResponse:
            self.service.abort_job(request.job_id)
            return pb.AbortJobResponse()
        return self._guard(context, run)


def _entry(path: Path) -> pb.ListEntry | None:
    if path.name.startswith(".") or path.is_symlink() or not path.is_dir():
        return None
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        return None
    try:
        m = Manifest.from_json(manifest.read_bytes(), str(path))
    except (ManifestError, OSError) as exc:
        return pb.ListEntry(name=path.name, state=f"corrupt: {exc}")
    return pb.ListEntry(name=path.name, state="committed", bytes=m.total_bytes,
                        created_unix=m.created_unix)


class TokenAuth(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call that lacks `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                given = value.removeprefix("Bearer ").encode()
                if value.startswith("Bearer ") and hmac.compare_digest(given, self._token):
                    return continuation(details)
        return self._deny


def _options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def build_server(servicer: Servicer, health_servicer: health.HealthServicer,
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="fpd-rpc"),
                         options=_options(), maximum_concurrent_rpcs=MAX_WORKERS,
                         interceptors=interceptors)
    pb_grpc.add_FastPersistServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


def health_servicer() -> health.HealthServicer:
    h = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        h.set(name, health_pb2.HealthCheckResponse.SERVING)
    return h


def set_not_serving(h: health.HealthServicer) -> None:
    for name in ("", SERVICE_NAME):
        h.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def prepare_socket(path: Path) -> None:
    """Make the socket's directory; remove a stale socket left by a dead daemon,
    but refuse to take over one that a live daemon serves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SystemExit(f"fastpersistd: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        os.unlink(path)  # nobody listens: a leftover of a daemon that died
        return
    finally:
        probe.close()
    raise SystemExit(f"fastpersistd: another daemon is serving {path}")


def bind_unix(server: grpc.Server, path: Path, group: int | None) -> None:
    """Bind with mode 0660 from the start (umask), not chmod'ed afterwards: no
    moment in which others may connect."""
    old = os.umask(0o117)
    try:
        server.add_insecure_port(f"unix:{path}")
        server.start()
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)


def tls_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])

