"""Who this daemon replicates to, and how it reaches them (replication.py sends).

Peers come from --peer HOST:PORT (repeatable) and from --peers-dns NAME:PORT,
a Kubernetes headless service whose A records are the DaemonSet's pods (this
one's among them), resolved again at every replication round.
A peer is reached the only way fastpersistd serves TCP (transport.py): TLS,
verified against --peer-tls-ca (default: the system's CAs), and the bearer
token of --token-file (the peers of one job share it). A DNS peer's
certificate is checked for NAME, the name the service's pods share. Before
sending, the sender asks each peer's Info for its node name, failure domain
and job: itself (its own pod's record: the same --node-name, which is how
"minus self" is decided, whatever address reaches it) and a peer of another
job are left out.

The rate limit is a token bucket over all sends together: replication
uses at most --replication-rate bytes a second of the node's network, so that
it does not starve the training's own traffic.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import grpc

from .._proto import fastpersist_pb2 as pb
from .._proto import fastpersist_pb2_grpc as pb_grpc
from ..checksum import crc32c
from .transport import MAX_MESSAGE_BYTES

INFO_TIMEOUT = 5.0  # a peer that does not answer Info in this long is skipped this round


@dataclass(frozen=True)
class PeerSettings:
    node: str
    domain: str
    job: str
    replicas: int
    static: tuple[str, ...] = ()  # HOST:PORT
    dns: str = ""  # NAME:PORT
    token: str = ""
    ca: bytes | None = None  # PEM; None: the system's
    rate: float = 0.0  # bytes a second; 0: unlimited
    timeout: float = 600.0  # one Replicate call, at most


@dataclass(frozen=True)
class Peer:
    target: str  # HOST:PORT
    node: str
    domain: str


def resolve(settings: PeerSettings) -> list[tuple[str, str]]:
    """(target, TLS name override or "") of every configured peer, now."""
    out = [(t, "") for t in settings.static]
    if settings.dns:
        name, _, port = settings.dns.rpartition(":")
        try:
            infos = socket.getaddrinfo(name, int(port), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            infos = []
        for ip in sorted({str(i[4][0]) for i in infos}):
            out.append((f"{ip}:{port}", name))
    return out


def channel(settings: PeerSettings, target: str, override: str = "") -> grpc.Channel:
    options: list[tuple[str, str | int]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if override:
        options.append(("grpc.ssl_target_name_override", override))
    creds = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(settings.ca),
        grpc.access_token_call_credentials(settings.token))
    return grpc.secure_channel(target, creds, options)


def identify(settings: PeerSettings, target: str, override: str
             ) -> tuple[Peer | None, str]:
    """The peer at target (None: not one to send to), and why not."""
    ch = channel(settings, target, override)
    try:
        info = pb_grpc.FastPersistStub(ch).Info(pb.InfoRequest(),  # type: ignore[no-untyped-call]
                                                timeout=INFO_TIMEOUT)
    except grpc.RpcError as exc:
        return None, f"{target}: {exc.code().name}: {exc.details()}"
    finally:
        ch.close()
    if info.node_name == settings.node:
        return None, f"{target} is this node"
    if info.job != settings.job:
        return None, f"{target} is of job {info.job!r}, not {settings.job!r}"
    return Peer(target, info.node_name or target, info.failure_domain), ""


def placement(settings: PeerSettings, peers: list[Peer], relpath: str) -> tuple[list[Peer], int]:
    """The peers in the order to try them, and how many lie outside this
    node's failure domain (first). Within each group the order is a hash of
    (path, peer): the copies of a node's checkpoints spread over its peers,
    and a retry tries the same ones first."""
    def rank(p: Peer) -> int:
        return int(crc32c(f"{relpath}\0{p.node}".encode()))

    if not settings.domain:
        return sorted(peers, key=rank), len(peers)
    others = sorted((p for p in peers if p.domain != settings.domain), key=rank)
    same = sorted((p for p in peers if p.domain == settings.domain), key=rank)
    return others + same, len(others)


class TokenBucket:
    """At most `rate` bytes a second (bursts of one second's worth); 0: unlimited."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:  # one sender waits at a time: the others queue behind it
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            if self._tokens < 0:
                time.sleep(-self._tokens / self.rate)
                self._last = time.monotonic()
                self._tokens = 0.0
