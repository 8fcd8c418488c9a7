"""The daemon's gRPC servers: sockets, TLS, who may call, and how much a call may send.

Two servers share one servicer (server.py): the Unix socket (no auth; the
socket's 0660 mode is the access control) and, optionally, TCP with TLS, a
bearer token and, with --tls-client-ca, client certificates.

What grpcio's server does with a call, in order (grpc/_server.py, 1.6x-1.8x):
when the call arrives (_handle_call) it runs the interceptors to find the
method's handler (_find_method_handler), on its polling thread, before any of
the request is read; then the handler's kind decides how the body is read: a
unary request is received whole and deserialized before the behavior runs
(_unary_request), a request stream only as the behavior iterates it
(_RequestIterator). So:

- TokenAuth refuses a call that lacks the token with a request-streaming
  handler that never iterates: no byte of the body is received or parsed
  (only what HTTP/2 flow control lets the peer send ahead, 64 KiB a stream).
  A unary one would have received and parsed up to the message limit first:
  three unauthenticated 60 MiB calls took the daemon from 47 to 341 MiB.
- Client certificates (--tls-client-ca) refuse a peer without one at the TLS
  handshake, before it can open a stream at all.
- MessageBounds gives each method the size its fields need (REQUEST_BYTES),
  checked on the serialized bytes before they are parsed, but after gRPC
  received them whole: gRPC itself knows one limit for all, which it checks
  from a message's length prefix. On the Unix socket that is the largest a
  client needs (CLIENT_MESSAGE_BYTES, a stream's chunk); over TCP a peer's
  Replicate header (MAX_MESSAGE_BYTES). Commit's and CommitJob's payloads,
  which grow with the job, are streamed in chunks (large_requests.py): eight
  60 MiB unary Commits, taken whole when they needed 64 MiB, had raised the
  daemon's peak RSS by 493 MiB (now 2-5 MiB).
- A connection may hold MAX_STREAMS_PER_CONNECTION calls at once (HTTP/2
  SETTINGS_MAX_CONCURRENT_STREAMS; gRPC refuses a stream over it), so one
  peer cannot take all MAX_WORKERS of the daemon's request threads.
"""

from __future__ import annotations

import hmac
import os
import socket
import stat
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from .._proto import fastpersist_pb2_grpc as pb_grpc
from ..protocol.chunked import INLINE_HEADER_BYTES, UNARY_PAYLOAD_BYTES
from . import logs, replica_wire
from .metrics import Metrics
from .requests import MAX_STREAM_CHUNK, RequestError

# What gRPC receives over TCP: an older peer's Replicate header may hold a
# manifest of up to this (a newer peer's holds at most 16 MiB and sends a
# larger one in 4 MiB parts after it, replica_manifest.py).
MAX_MESSAGE_BYTES = 64 << 20
# Each open Watch holds a worker thread; beyond this, calls are refused
# (RESOURCE_EXHAUSTED) instead of queueing behind long-running streams.
MAX_WORKERS = 128
# A client process holds at most 16 checkpoints in flight (requests.py), each
# with one or two long-lived streams (Open, or Begin and Watch) and a submit at
# a time: 48. gRPC's channels of one process share one connection.
MAX_STREAMS_PER_CONNECTION = 64
# Every request but the ones below: ids, paths (1 KiB), counts.
SMALL_REQUEST_BYTES = 64 << 10
REQUEST_BYTES = {
    # A data file's header; a larger one comes out of the message (submitted.py).
    "SubmitShm": INLINE_HEADER_BYTES + SMALL_REQUEST_BYTES,
    # A chunk: the header, or <= 4 MiB of data.
    "SubmitStream": max(INLINE_HEADER_BYTES, MAX_STREAM_CHUNK) + SMALL_REQUEST_BYTES,
    # The tree and every tensor's name, the job's manifest: larger ones are
    # streamed (large_requests.py).
    "Commit": UNARY_PAYLOAD_BYTES + SMALL_REQUEST_BYTES,
    "CommitJob": UNARY_PAYLOAD_BYTES + SMALL_REQUEST_BYTES,
    "CommitStream": MAX_STREAM_CHUNK + SMALL_REQUEST_BYTES,  # a chunk: header, or <= 4 MiB
    "CommitJobStream": MAX_STREAM_CHUNK + SMALL_REQUEST_BYTES,
    "Replicate": MAX_MESSAGE_BYTES,  # an older peer's header holds the manifest
    "ReadReplica": 2 << 20,  # up to 4,096 ranges of plain names
}
# What a client of this version sends instead of a unary call over its bound:
# a client older than the daemon does not, and is told to upgrade.
SENT_INSTEAD = {"Commit": "larger ones go as CommitStream",
                "CommitJob": "larger ones go as CommitJobStream",
                "SubmitShm": "a larger header goes in shared memory",
                "SubmitStream": "a larger header goes in the stream's chunks"}
# What gRPC receives on the Unix socket, where no peer daemon calls
# (Replicate comes over TCP, with the token): the largest message a client
# needs, a few MiB. gRPC refuses a larger one from its length prefix, without
# receiving it; below this, MessageBounds refuses it whole.
CLIENT_MESSAGE_BYTES = max(b for m, b in REQUEST_BYTES.items() if m != "Replicate")

# Instead of the generated deserializer: Replicate's data chunks without
# protobuf's copies of their bytes (replica_wire.py).
PARSERS: dict[str, Callable[[bytes], Any]] = {"Replicate": replica_wire.decode_chunk}


def _method(full_name: str) -> str:
    return full_name.rpartition("/")[2]


class TokenAuth(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call that lacks `authorization: Bearer <token>`, without
    reading its request (the module's docstring says why this way)."""

    def __init__(self, token: str, metrics: Metrics) -> None:
        self._token = token.encode()

        def deny(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            # Not logged: a peer without the token must not fill the log either.
            metrics.rejected.labels(code="UNAUTHENTICATED").inc()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                given = value.removeprefix("Bearer ").encode()
                if value.startswith("Bearer ") and hmac.compare_digest(given, self._token):
                    return continuation(details)
        return self._deny


class _TooLarge:
    """What a bounded deserializer gives for a message over its method's size."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class MessageBounds(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses (RESOURCE_EXHAUSTED) a request message over its method's
    REQUEST_BYTES before it is parsed."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = _method(details.method)
        bound = REQUEST_BYTES.get(method, SMALL_REQUEST_BYTES)
        parse = PARSERS.get(method) or handler.request_deserializer or bytes  # None: as they are

        def bounded(data: bytes) -> Any:
            return _TooLarge(len(data)) if len(data) > bound else parse(data)

        def message(size: int) -> str:
            text = f"{method} requests are limited to {bound} bytes; this one holds {size}"
            if method in SENT_INSTEAD:
                text += (f" ({SENT_INSTEAD[method]}, but not by a fastpersist client older "
                         "than this daemon: upgrade fastpersist where the trainer runs)")
            return text

        def refuse(context: grpc.ServicerContext, size: int) -> None:
            self._metrics.rejected.labels(code="RESOURCE_EXHAUSTED").inc()
            logs.info("rejected", code="RESOURCE_EXHAUSTED", reason=message(size),
                      peer=context.peer())
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message(size))

        def checked(requests: Iterator[Any]) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, _TooLarge):
                    # Raised where the servicer reads the stream: its status path.
                    raise RequestError("RESOURCE_EXHAUSTED", message(request.size))
                yield request

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                if handler.request_streaming:
                    return behavior(checked(request), context)
                if isinstance(request, _TooLarge):
                    refuse(context, request.size)
                return behavior(request, context)
            return call

        kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler,
                 (True, False): grpc.stream_unary_rpc_method_handler,
                 (True, True): grpc.stream_stream_rpc_method_handler}
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(wrap(behavior), request_deserializer=bounded,
                    response_serializer=handler.response_serializer)


def _options(max_receive: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        # gRPC binds with SO_REUSEPORT unless told otherwise: a second daemon
        # on a --listen in use would start, and the kernel would split the
        # peers' connections between the two. Bind alone, or fail.
        ("grpc.so_reuseport", 0),
    ]


def build_server(servicer: pb_grpc.FastPersistServicer,
                 health_servicer: health.HealthServicer, metrics: Metrics,
                 auth: TokenAuth | None = None) -> grpc.Server:
    """A server of the servicer and health, its requests bounded; with `auth`
    (TCP, where peers also call), calls without the token are refused first."""
    interceptors = [*([auth] if auth is not None else []), MessageBounds(metrics)]
    limit = CLIENT_MESSAGE_BYTES if auth is None else MAX_MESSAGE_BYTES
    server = grpc.server(futures.ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="fpd-rpc"),
                         options=_options(limit), maximum_concurrent_rpcs=MAX_WORKERS,
                         interceptors=interceptors)
    pb_grpc.add_FastPersistServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


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


def tls_credentials(cert: Path, key: Path, client_ca: Path | None = None
                    ) -> grpc.ServerCredentials:
    """The server's certificate; with client_ca, a client must present a
    certificate that it signed, or the TLS handshake fails."""
    pair = [(key.read_bytes(), cert.read_bytes())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=client_ca.read_bytes(),
                                       require_client_auth=True)
