"""`fastpersistd`: start the daemon, clean up after a previous one, serve, drain.

    fastpersistd --root DIR [--socket PATH] [--socket-group GROUP]
                 [--listen HOST:PORT --tls-cert FILE --tls-key FILE --token-file FILE
                  [--tls-client-ca FILE]]
                 [--staging-budget BYTES] [--client-budget BYTES] [--shm-dir DIR]
                 [--memory-tier-count N] [--memory-tier-bytes BYTES]
                 [--metrics-listen HOST:PORT] [--write-concurrency N] [--max-streams N]
                 [--idle-timeout SECONDS] [--drain-timeout SECONDS]
                 [--tier s3://BUCKET/PREFIX [--tier-keep-last N] [--tier-endpoint URL]
                  [--tier-compression zstd|none]]
                 [--replicas R --peer HOST:PORT... | --peers-dns NAME:PORT] [--replica-bytes B]
                 [--log-format json|text] [--log-level LEVEL]   (peers: peer_flags.py)

SIGTERM or SIGINT: stop taking checkpoints, abort the ones not handed over,
finish (commit) the handed-over ones, then exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import grp
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import knobs
from .._version import __version__
from ..engine import get_engine
from ..errors import CheckpointError
from ..protocol import shm
from ..tier.url import TierURL
from . import logs, peer_flags
from .budgets import (
    DEFAULT_STREAMS,
    Budgets,
    cgroup_memory_limit,
    default_budgets,
    default_tier_bytes,
    own_memory,
)
from .health import NOT_SERVING, Watchdog, health_servicer, set_status
from .memory import DEFAULT_COUNT, MemoryTier
from .metrics import Metrics
from .rootfs import Root
from .rootlock import lock_root
from .server import Servicer
from .service import Service
from .transport import TokenAuth, bind_unix, build_server, prepare_socket, tls_credentials

DEFAULT_SOCKET = "/run/fastpersist/fastpersistd.sock"
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
# gRPC's other address schemes: a --socket that starts with one is a mistake,
# not a file name (a path may hold a colon, so only these are refused).
_SCHEME = re.compile(r"^(?:unix-abstract|vsock|dns|ipv4|ipv6|https?|tcp):", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'0', '1048576', '64M', '64MiB', '2G' -> bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 64G)")
    power = " kmgt".index(m[2][0].lower()) if m[2] else 0
    return int(m[1]) << (10 * power)


def socket_path(text: str) -> Path:
    """--socket: a path, or the address clients are given (FASTPERSIST_DAEMON=
    unix:///PATH, or gRPC's unix:PATH). Taken literally, the address made a
    socket named 'unix:' under the working directory that no client finds."""
    if text.startswith("unix://"):
        path = text.removeprefix("unix://")
        if not path.startswith("/"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: after unix:// comes an absolute path (unix:///run/fastpersist/"
                "fastpersistd.sock has three slashes)")
        return Path(path)
    path = text.removeprefix("unix:")
    if "://" in path or _SCHEME.match(path):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Unix socket: --socket takes a path or unix:///PATH (serve TCP "
            "with --listen HOST:PORT)")
    if not path:
        raise argparse.ArgumentTypeError(f"{text!r} names no path")
    return Path(path)


def group_id(text: str) -> int:
    """A group name, or a numeric gid (which needs no /etc/group entry: a
    container's groups often have none). KeyError: no such group."""
    return int(text) if text.isdigit() else grp.getgrnam(text).gr_gid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastpersistd", description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, type=Path,
                   help="directory the checkpoints live under; every request path is confined "
                        "to it")
    p.add_argument("--socket", type=socket_path, default=Path(DEFAULT_SOCKET),
                   help=f"Unix socket to serve, created 0660: a path or unix:///PATH (default "
                        f"{DEFAULT_SOCKET})")
    p.add_argument("--socket-group",
                   help="group to give the socket, by name or number (trainers in it may "
                        "connect)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="also serve TCP; needs --tls-cert, --tls-key and --token-file")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--token-file", type=Path,
                   help="file holding the bearer token TCP clients must send")
    p.add_argument("--tls-client-ca", type=Path, metavar="FILE",
                   help="mutual TLS: TCP clients must present a certificate signed by this CA "
                        "(PEM); one without is refused at the TLS handshake. Clients set "
                        "FASTPERSIST_DAEMON_CERT_FILE and FASTPERSIST_DAEMON_KEY_FILE")
    p.add_argument("--staging-budget", type=parse_size, default=None,
                   help="clients' shared memory accepted at once, all clients; a Begin over it "
                        "is refused (RESOURCE_EXHAUSTED). These pages are the trainers' (tmpfs "
                        "charges the cgroup that touches them first), not the daemon's. "
                        "Default: half of the --shm-dir file system; 0: no limit")
    p.add_argument("--client-budget", type=parse_size, default=None,
                   help="the same for one client (default: half of --staging-budget; 0: no "
                        "limit)")
    p.add_argument("--shm-dir", type=Path, default=None,
                   help="where clients' shared-memory segments live (default "
                        "$FASTPERSIST_SHM_DIR or /dev/shm)")
    p.add_argument("--memory-tier-count", type=int, default=DEFAULT_COUNT, metavar="N",
                   help="keep the newest N checkpoints this daemon committed in memory (files "
                        "in --shm-dir), for a trainer restarted on this node to load without "
                        "reading the disk; only checkpoints handed in as shared memory, "
                        f"uncompressed and not distributed (default {DEFAULT_COUNT}; 0: off)")
    p.add_argument("--memory-tier-bytes", type=parse_size, default=None, metavar="BYTES",
                   help="memory the kept checkpoints may hold, all together; the oldest is "
                        "evicted to make room, and a checkpoint larger is not kept. tmpfs "
                        "charges these pages to the daemon's cgroup (default: a quarter of the "
                        "--shm-dir file system, and under a cgroup memory limit half of what "
                        "the daemon's own memory leaves of it; 0: off)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics over HTTP here")
    p.add_argument("--write-concurrency", type=int, default=2,
                   help="data files written at once from shared memory, over all clients; each "
                        "holds up to FASTPERSIST_BUFFER_BUDGET (64 MiB; 32 MiB with the default "
                        "block size) of the engine's bounce buffers (default 2)")
    p.add_argument("--max-streams", type=int, default=DEFAULT_STREAMS,
                   help="data files streamed over gRPC at once (tensors over a client's "
                        "staging budget); each is written to disk as it arrives through two "
                        "FASTPERSIST_BLOCK_SIZE (2 MiB) blocks, and a further stream waits for "
                        f"one (default {DEFAULT_STREAMS}). With the defaults the daemon's own "
                        "memory stays under 64 MiB (idle) + 2 x 32 MiB (writers) + 4 x 16 MiB "
                        "(streams) = 192 MiB, in the DaemonSet's 512 MiB limit; logged at "
                        "start as memory_bound, with a warning if the cgroup allows less")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="abort an unwatched checkpoint not handed over after this many seconds")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="at shutdown, wait at most this long for handed-over checkpoints "
                        "(default: as long as they take)")
    p.add_argument("--tier", metavar="s3://BUCKET/PREFIX",
                   help="copy every committed checkpoint to this object store in the background "
                        "(ROOT/REL to PREFIX/REL); what is not uploaded is kept locally, and "
                        "uploaded after a restart. Credentials: the standard AWS configuration")
    p.add_argument("--tier-keep-last", type=int, default=None, metavar="N",
                   help="keep the N newest step-N checkpoints of each directory in the store "
                        "(default: all)")
    p.add_argument("--tier-compression", choices=("zstd", "none"), default="zstd",
                   help="zstd (default): compress raw checkpoints on their way to the store "
                        "(byte-grouped zstd, as compression='zstd'; the local copy stays raw); "
                        "none: upload them as they are")
    p.add_argument("--tier-endpoint", metavar="URL",
                   help="the store's endpoint URL (default: the standard AWS configuration, "
                        "e.g. AWS_ENDPOINT_URL)")
    peer_flags.add_arguments(p, parse_size)
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.add_argument("--log-level", default="info")
    p.add_argument("--version", action="version", version=f"fastpersistd {__version__}")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.root.is_dir():
        p.error(f"--root {args.root} is not a directory")
    if args.listen and not (args.tls_cert and args.tls_key and args.token_file):
        p.error("--listen serves TCP only with TLS and a token: give --tls-cert, --tls-key and "
                "--token-file")
    if args.tls_client_ca and not args.listen:
        p.error("--tls-client-ca is for TCP clients: it needs --listen")
    for name in ("tls_cert", "tls_key", "token_file", "tls_client_ca"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            p.error(f"--{name.replace('_', '-')} {path} is not a file")
    if args.write_concurrency < 1:
        p.error("--write-concurrency must be at least 1")
    if args.memory_tier_count < 0:
        p.error("--memory-tier-count must be 0 (off) or more")
    if args.max_streams < 1:
        p.error("--max-streams must be at least 1")
    if args.tier_keep_last is not None and args.tier_keep_last < 1:
        p.error("--tier-keep-last must be at least 1")
    if args.tier_keep_last is not None and not args.tier:
        p.error("--tier-keep-last needs --tier")
    if args.tier:
        try:
            args.tier = TierURL.parse(args.tier)
        except ValueError as exc:
            p.error(f"--tier: {exc}")
    if args.shm_dir is None:
        args.shm_dir = shm.shm_dir()
    if not args.shm_dir.is_dir():
        p.error(f"--shm-dir {args.shm_dir} is not a directory")
    defaults = default_budgets(args.shm_dir)
    if args.memory_tier_bytes is None:
        args.memory_tier_bytes = default_tier_bytes(defaults.staging // 2, own_memory(
            args.write_concurrency, args.max_streams), cgroup_memory_limit())
    if args.staging_budget is None:
        args.staging_budget = defaults.staging
    if args.client_budget is None:
        args.client_budget = args.staging_budget // 2 if args.staging_budget else 0
    peer_flags.check(p, args)


def _step(metrics: Metrics, what: str, step: Callable[[], object]) -> None:
    """One housekeeping step: a failure is logged and counted, and the daemon goes on."""
    try:
        step()
    except Exception as exc:
        metrics.housekeeping_failures.inc()
        logs.error("housekeeping-failed", step=what, error=repr(exc))


def _reclaim(shm_dir: Path, metrics: Metrics) -> None:
    for name in shm.reclaim_orphans(shm_dir):
        metrics.reclaimed_segments.inc()
        logs.info("reclaimed-segment", segment=name)


def _swept(memory: MemoryTier) -> None:
    for name in memory.sweep():
        logs.info("removed-memory-copy", directory=name)


def _limit_malloc_arenas() -> None:
    """glibc gives each thread that allocates its own arena (up to 8 per core),
    and what an arena freed it keeps: with 128 request threads, big requests
    arriving at once left the daemon at 400 MiB of RSS, 220 MiB with two arenas
    (measured; deploy/README.md). Same as MALLOC_ARENA_MAX=2, set before the
    server's threads start; M_ARENA_MAX is -8."""
    if "MALLOC_ARENA_MAX" not in os.environ:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).mallopt(-8, 2)


def take_root_group(root_fd: int) -> None:
    """Everything the daemon creates under --root belongs to the root's group,
    so that the trainers in that group can read it (and, with a umask of 0027,
    nobody else can). As root, the daemon takes that group as its effective
    group; otherwise its own group must be it, or the root carry the setgid
    bit (new entries then inherit its group), and it warns if neither holds."""
    st = os.fstat(root_fd)
    if os.getegid() == st.st_gid:
        return
    if os.geteuid() == 0:
        os.setegid(st.st_gid)  # before any thread starts: one group for all of them
        logs.info("root-group", gid=st.st_gid)
    elif not st.st_mode & stat.S_ISGID:
        logs.warning("root-group", gid=st.st_gid, daemon_gid=os.getegid(),
                     reason="checkpoints will belong to the daemon's group, not the root's: "
                            "trainers in the root's group may not be able to read them "
                            "(chmod g+s the root, or run the daemon with its group)")


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    _limit_malloc_arenas()
    logs.setup(args.log_format, args.log_level)
    root = Root(args.root.resolve())
    try:
        # Looked up here, not while parsing: the deployed arguments are checked
        # on machines without the group.
        group = group_id(args.socket_group) if args.socket_group else None
    except KeyError:
        p.error(f"--socket-group: no group {args.socket_group!r}")

    take_root_group(root.fd)
    try:
        node = knobs.current().node
    except ValueError as exc:  # a FASTPERSIST_* variable out of range
        p.error(str(exc))
    # Before anything touches the root: a second daemon must not clean up
    # the first's checkpoints in flight.
    lock_root(root.fd, str(root.path), node, str(args.socket), args.listen or "")
    metrics = Metrics()
    _step(metrics, "clean up leftovers", root.clean_up_leftovers)
    _step(metrics, "reclaim segments", lambda: _reclaim(args.shm_dir, metrics))
    direct = root.probe_direct_io()
    tier = None
    if args.tier:
        from ..tier.client import S3
        from .tiering import DaemonTier

        if args.tier_compression == "zstd":
            try:
                import numpy  # noqa: F401
                import zstandard  # noqa: F401
            except ImportError as exc:
                p.error(f"--tier-compression zstd (the default) needs numpy and zstandard "
                        f"({exc}); install them, or pass --tier-compression none")
        try:
            tier = DaemonTier(root, args.tier, S3(args.tier_endpoint), metrics,
                              keep_last=args.tier_keep_last,
                              compression=args.tier_compression)
        except CheckpointError as exc:  # boto3 missing
            p.error(f"--tier: {exc}")
    memory = MemoryTier(args.shm_dir, args.memory_tier_count, args.memory_tier_bytes,
                        get_engine(), metrics, group)
    _step(metrics, "remove a dead daemon's memory copies", lambda: _swept(memory))
    service = Service(root, args.shm_dir, Budgets(args.staging_budget, args.client_budget),
                      metrics, write_concurrency=args.write_concurrency,
                      idle_timeout=args.idle_timeout, max_streams=args.max_streams, tier=tier,
                      memory=memory if memory.enabled else None)
    if tier is not None:
        _step(metrics, "queue the checkpoints to upload", tier.start)
    own = own_memory(args.write_concurrency, args.max_streams)
    # tmpfs charges the memory tier's and the replicas' pages to the daemon's cgroup.
    tier_bytes = (memory.budget if memory.enabled else 0) + args.replica_bytes
    limit = cgroup_memory_limit()
    if limit is not None and sum(own.values()) + tier_bytes > limit:
        logs.warning("memory-over-limit", bound=sum(own.values()) + tier_bytes, limit=limit,
                     **own, memory_tier=tier_bytes - args.replica_bytes,
                     replicas=args.replica_bytes,
                     hint="lower --memory-tier-bytes, --replica-bytes, --max-streams, "
                          "--write-concurrency or "
                          "FASTPERSIST_BLOCK_SIZE")
    peering = peer_flags.build(args, root, metrics)
    service.after_commits.replicator = peering[2]
    servicer = Servicer(service, direct, peering)
    health = health_servicer()

    servers = []
    prepare_socket(args.socket)
    unix = build_server(servicer, health, metrics)
    bind_unix(unix, args.socket, group)
    servers.append(unix)
    if args.listen:
        token = args.token_file.read_text().strip()
        if not token:
            p.error(f"--token-file {args.token_file} is empty")
        tcp = build_server(servicer, health, metrics, TokenAuth(token, metrics))
        try:
            tcp.add_secure_port(args.listen, tls_credentials(args.tls_cert, args.tls_key,
                                                             args.tls_client_ca))
        except RuntimeError as exc:  # grpc's "Failed to bind to address"
            p.error(f"--listen {args.listen}: cannot listen there (a process on it?): {exc}")
        tcp.start()
        servers.append(tcp)
    if args.metrics_listen:
        metrics.serve(args.metrics_listen)
    watchdog = Watchdog(service, health)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logs.info("ready", version=__version__, root=str(root.path), socket=str(args.socket),
              tier=str(args.tier or ""), listen=args.listen or "",
              client_certificates=bool(args.tls_client_ca), direct_io=direct,
              staging_budget=args.staging_budget,
              client_budget=args.client_budget, memory_bound=sum(own.values()),
              memory_tier_count=args.memory_tier_count if memory.enabled else 0,
              memory_tier_bytes=args.memory_tier_bytes if memory.enabled else 0,
              node_name=args.node_name, failure_domain=args.failure_domain, job=args.job,
              replicas=args.replicas, replica_bytes=args.replica_bytes,
              pid=os.getpid(), openat2=root.uses_openat2)
    # Housekeeping until told to stop: idle checkpoints, orphaned segments.
    while not stop.wait(2.0):
        _step(metrics, "reap idle checkpoints", service.reap_idle)
        _step(metrics, "reclaim segments", lambda: _reclaim(args.shm_dir, metrics))
        _step(metrics, "release idle memory", service.writers.release_memory)
        _step(metrics, "prune memory copies", lambda: memory.prune(service.registry))

    logs.info("draining", in_flight=len(service.in_flight()))
    watchdog.stop()
    set_status(health, NOT_SERVING)
    finished = service.drain(args.drain_timeout)
    memory.close()  # the copies live as long as the daemon
    if peering[2] is not None:
        peering[2].close()  # what is not replicated yet is not (the disk holds it)
    if tier is not None:
        logs.info("tier-stopped", pending=len(tier.stop()))
    for server in servers:
        server.stop(grace=2.0).wait()
    peering[1].close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    logs.info("stopped", finished=finished)
    return 0 if finished else 1
