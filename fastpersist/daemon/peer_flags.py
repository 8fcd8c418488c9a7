"""fastpersistd's peer-replication flags: parsed, checked, and turned into the
settings (peers.py), the replicas held for other nodes (replicas.py) and the
sender (replication.py).

    --peer HOST:PORT (repeatable)  --peers-dns NAME:PORT  --replicas R
    --node-name NAME  --failure-domain LABEL  --job NAME  --replica-bytes BYTES
    --replication-rate BYTES  --replication-timeout SECONDS  --peer-tls-ca FILE

The sender authenticates with --token-file's token (the job's daemons share
it) over TLS only, as fastpersistd serves TCP only with TLS (transport.py).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Callable
from pathlib import Path

from . import logs
from .metrics import Metrics
from .peers import PeerSettings
from .replicas import ReplicaStore
from .replication import Replicator
from .rootfs import Root

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def host_port(text: str) -> str:
    m = _HOST_PORT.match(text)
    if not m or not 0 < int(m[2]) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def add_arguments(p: argparse.ArgumentParser, size: Callable[[str], int]) -> None:
    g = p.add_argument_group("peer replication (docs/guides/daemon.md)")
    g.add_argument("--peer", action="append", default=[], type=host_port, metavar="HOST:PORT",
                   help="a peer daemon's --listen address to replicate to (repeatable)")
    g.add_argument("--peers-dns", type=host_port, metavar="NAME:PORT",
                   help="peers from DNS: every A record of NAME (a Kubernetes headless "
                        "service) but this node (told by its --node-name), resolved at every "
                        "round; their certificates are checked for NAME")
    g.add_argument("--replicas", type=int, default=0, metavar="R",
                   help="send every committed checkpoint (this node's files of it) to R "
                        "peers, outside this node's failure domain first (default 0: off)")
    g.add_argument("--node-name", default=None,
                   help="this node's name among its peers (default: the host name)")
    g.add_argument("--failure-domain", default="", metavar="LABEL",
                   help="e.g. the rack: replicas go to peers of other labels first")
    g.add_argument("--job", default="",
                   help="the job this daemon serves; replicas from daemons of another job are "
                        "refused, and theirs are not sent to")
    g.add_argument("--replica-bytes", type=size, default=0, metavar="BYTES",
                   help="memory (files in --shm-dir) for replicas held for other nodes, "
                        "their data files and manifests; the oldest is evicted to make room "
                        "(default 0: refuse replicas)")
    g.add_argument("--replication-rate", type=size, default=0, metavar="BYTES",
                   help="bytes a second sent to peers, all together (default 0: unlimited)")
    g.add_argument("--replication-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up one send to a peer after this long and try another "
                        "(default 600)")
    g.add_argument("--peer-tls-ca", type=Path, metavar="FILE",
                   help="CA (PEM) that peers' certificates are checked against (default: the "
                        "system's)")


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.replicas < 0:
        p.error("--replicas must be 0 (off) or more")
    if args.replicas and not (args.peer or args.peers_dns):
        p.error("--replicas needs peers: --peer HOST:PORT or --peers-dns NAME:PORT")
    if args.replicas and not args.token_file:
        p.error("--replicas sends to peers with the bearer token of --token-file")
    if args.peer_tls_ca is not None and not args.peer_tls_ca.is_file():
        p.error(f"--peer-tls-ca {args.peer_tls_ca} is not a file")
    if args.replication_timeout <= 0:
        p.error("--replication-timeout must be positive")
    if args.node_name is None:
        args.node_name = socket.gethostname()
    for name in ("node_name", "failure_domain", "job"):
        value = getattr(args, name)
        if len(value) > 512 or any(ord(c) < 32 for c in value):
            p.error(f"--{name.replace('_', '-')} is at most 512 printable characters")
    if not args.node_name:
        p.error("--node-name must not be empty")


def build(args: argparse.Namespace, root: Root, metrics: Metrics
          ) -> tuple[PeerSettings, ReplicaStore, Replicator | None]:
    token = args.token_file.read_text().strip() if args.replicas else ""
    settings = PeerSettings(
        node=args.node_name, domain=args.failure_domain, job=args.job, replicas=args.replicas,
        static=tuple(args.peer), dns=args.peers_dns or "", token=token,
        ca=args.peer_tls_ca.read_bytes() if args.peer_tls_ca else None,
        rate=float(args.replication_rate), timeout=args.replication_timeout)
    store = ReplicaStore(args.shm_dir, args.replica_bytes, args.job, metrics)
    for name in store.sweep():
        logs.info("removed-replica", directory=name)
    sender = Replicator(root, settings, metrics).start() if args.replicas else None
    return settings, store, sender
