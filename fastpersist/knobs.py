"""Every tunable in one place, each with a default and an environment override.

    FASTPERSIST_BLOCK_SIZE     bytes per I/O (a multiple of 4096)        2 MiB
    FASTPERSIST_THREADS        I/O threads per file                      8
    FASTPERSIST_BUFFER_BUDGET  bounce-buffer memory, all threads          64 MiB
    FASTPERSIST_DIRECT         O_DIRECT: auto (fall back), on, off       auto
    FASTPERSIST_IO_BACKEND     pool (threads), uring (io_uring), or      pool
                               auto (io_uring unless refused here)
    FASTPERSIST_QUEUE_DEPTH    I/Os in flight per io_uring thread        8
    FASTPERSIST_ENGINE         native (C) or python (reference)          native
    FASTPERSIST_VERIFY_LOAD    check every tensor's CRC32C on load       1
    FASTPERSIST_STAGING_BUDGET async-save staging memory, bytes; 0: as   0
                               large as the state
    FASTPERSIST_MAX_IN_FLIGHT  async saves persisting at once            1
    FASTPERSIST_FILE_BYTES     data-file size cap (a larger tensor gets  256 MiB
                               a file of its own)
    FASTPERSIST_DAEMON         save through fastpersistd at this address (unset)
                               (unix:///PATH; or https://HOST:PORT with
                               FASTPERSIST_DAEMON_TOKEN_FILE and _CA_FILE,
                               and _CERT_FILE and _KEY_FILE where the daemon
                               asks for client certificates)
    FASTPERSIST_SHM_DIR        shared-memory segments for the daemon     /dev/shm
    FASTPERSIST_DAEMON_ROOM_TIMEOUT  seconds a save waits for room in     600
                               fastpersistd's staging budgets (other
                               clients' saves hold them) before failing
    FASTPERSIST_NODE           this process's node in a distributed save  hostname
                               (ranks on one node share its drives); for
                               fastpersistd, whose lock on its root is per
                               node
    FASTPERSIST_DIST_TIMEOUT   seconds a distributed save waits for the   600
                               other ranks before failing
    FASTPERSIST_PIECE_BYTES    smallest piece a large replicated tensor   4 MiB
                               is cut into across writers
    FASTPERSIST_TIER_CONCURRENCY  object-store requests in flight        8
                               (multipart parts, ranged GETs)
    FASTPERSIST_TIER_PART_BYTES   multipart part and ranged-GET size     16 MiB
                               (at least 5 MiB, S3's smallest part)
    FASTPERSIST_TIER_ATTEMPTS  tries of one object-store request (with    5
                               backoff) before it fails
    FASTPERSIST_CODEC_THREADS  threads that encode and decode compressed  min(8, CPUs)
                               tensors (compression="zstd")
    FASTPERSIST_FRAME_BYTES    raw bytes per compressed frame (a multiple 4 MiB
                               of 4096, at most 64 MiB): the unit a load
                               decodes, and decodes in parallel
    FASTPERSIST_LOAD_RING_BYTES  host memory a load to an accelerator    256 MiB
                               streams through (pinned; 0: read the whole
                               state to the CPU first)
    FASTPERSIST_BACKGROUND_NICE  nice value of background threads (async  10
                               persist, tier uploads, codec), 0..19; 0: off
                               (background.py)
    FASTPERSIST_HUGE_PAGES     huge pages for loaded tensors: on, off,   auto
                               or auto (on, unless the machine is a VM
                               that hands free memory back to its host:
                               anonmem.py); the engine's bounce buffers
                               ask for them unless it is off
    FASTPERSIST_LOAD_BOUNCE    loads read into new tensors through the   auto
                               engine's bounce buffers, not straight in
                               with O_DIRECT: on, off, or auto (on where
                               the new memory has 4 KiB pages, i.e. huge
                               pages are off, and the I/O backend is the
                               thread pool: anonmem.py)

The thread pool keeps one blocking I/O in flight per thread. io_uring runs one
thread per CPU (at most FASTPERSIST_THREADS), each copying and checksumming for
its own ring with FASTPERSIST_QUEUE_DEPTH I/Os in flight. Both are trimmed to
fit FASTPERSIST_BUFFER_BUDGET, since every I/O in flight holds one bounce buffer
of the block size.

Values are read when an operation starts, so a test or a launcher can change the
environment between saves.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

ALIGNMENT = 4096
_MIB = 1 << 20
# The largest compressed frame a reader accepts (format/frames.py bounds it too).
MAX_FRAME_BYTES = 64 * _MIB


def _int_env(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


def _choice_env(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default).strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return raw


@dataclass(frozen=True)
class Knobs:
    block_size: int
    threads: int
    buffer_budget: int
    direct: str
    engine: str
    verify_load: bool
    staging_budget: int
    max_in_flight: int
    io_backend: str = "pool"
    queue_depth: int = 8
    daemon: str = ""
    # Several files let the snapshot's copy of file k+1 overlap the write of file
    # k (daemon mode), and keep any one file a manageable size.
    file_bytes: int = 256 * _MIB
    node: str = ""
    dist_timeout: int = 600
    piece_bytes: int = 4 * _MIB
    tier_concurrency: int = 8
    tier_part_bytes: int = 16 * _MIB
    tier_attempts: int = 5
    tier_timeout: int = 120
    tier_retry_max: int = 60
    codec_threads: int = 8
    frame_bytes: int = 4 * _MIB
    background_nice: int = 10
    load_ring_bytes: int = 256 * _MIB
    daemon_room_timeout: int = 600

    @property
    def io_threads(self) -> int:
        """Threads that fit the budget: each holds one bounce buffer of block_size."""
        return max(1, min(self.threads, self.buffer_budget // self.block_size))

    @property
    def uring_threads(self) -> int:
        """io_uring threads, as the engine caps them: no more than the usable CPUs."""
        return max(1, min(self.io_threads, len(os.sched_getaffinity(0))))

    @property
    def io_queue_depth(self) -> int:
        """Queue depth per io_uring thread that fits the budget with uring_threads."""
        per_thread = self.buffer_budget // (self.block_size * self.uring_threads)
        return max(1, min(self.queue_depth, per_thread))


@dataclass(frozen=True)
class DaemonTLS:
    """Files a client needs for a daemon over TCP (https://HOST:PORT); "" if unset."""

    token_file: str  # FASTPERSIST_DAEMON_TOKEN_FILE: the bearer token
    ca_file: str  # FASTPERSIST_DAEMON_CA_FILE: the daemon's CA (default: the system's)
    cert_file: str  # FASTPERSIST_DAEMON_CERT_FILE: this client's certificate (mutual TLS)
    key_file: str  # FASTPERSIST_DAEMON_KEY_FILE: its private key


def daemon_tls() -> DaemonTLS:
    """The FASTPERSIST_DAEMON_*_FILE variables (read on their own: only a TCP
    client asks)."""
    def get(name: str) -> str:
        return os.environ.get(f"FASTPERSIST_DAEMON_{name}_FILE", "").strip()

    return DaemonTLS(get("TOKEN"), get("CA"), get("CERT"), get("KEY"))


def daemon_address() -> str:
    """FASTPERSIST_DAEMON (read on its own too: `fpctl daemon` asks, and needs
    none of the other knobs to be valid)."""
    return os.environ.get("FASTPERSIST_DAEMON", "").strip()


def shm_dir() -> str:
    """FASTPERSIST_SHM_DIR: where clients create the segments they lend to
    fastpersistd, and where the daemon looks for them (default /dev/shm)."""
    return os.environ.get("FASTPERSIST_SHM_DIR", "").strip() or "/dev/shm"


def huge_pages() -> str:
    """FASTPERSIST_HUGE_PAGES (read on its own: anonmem asks for every mapping
    it makes, and current() also asks the system for CPUs and the host name)."""
    return _choice_env("FASTPERSIST_HUGE_PAGES", "auto", ("auto", "on", "off"))


def io_backend() -> str:
    """FASTPERSIST_IO_BACKEND (read on its own too: anonmem.loads_bounce asks)."""
    return _choice_env("FASTPERSIST_IO_BACKEND", "pool", ("pool", "uring", "auto"))


def load_bounce() -> str:
    """FASTPERSIST_LOAD_BOUNCE (read on its own, as huge_pages is)."""
    return _choice_env("FASTPERSIST_LOAD_BOUNCE", "auto", ("auto", "on", "off"))


def current() -> Knobs:
    """The knobs as the environment sets them now."""
    # 2 MiB: one huge page of a bounce buffer (csrc/fp_util.c) per I/O. Against
    # 8 MiB here: a 1 GiB load(into=) 0.327 vs 0.370 s, verify 0.298 vs 0.366 s,
    # loads into new tensors and saves level (medians of 5 interleaved runs).
    block_size = _int_env("FASTPERSIST_BLOCK_SIZE", 2 * _MIB)
    if block_size % ALIGNMENT:
        raise ValueError(f"FASTPERSIST_BLOCK_SIZE={block_size} is not a multiple of {ALIGNMENT}")
    # 8 threads: measured best for O_DIRECT reads on this machine's virtual disk
    # (with 8 MiB blocks then: 2.2 GB/s vs 1.2 with 4), and no worse for writes.
    threads = _int_env("FASTPERSIST_THREADS", 8)
    if threads > 64:
        raise ValueError(f"FASTPERSIST_THREADS={threads} is above the limit of 64")
    # Pool over io_uring: 2 GiB, 8 MiB blocks, medians of 11 interleaved runs here:
    # pool x8 write 1.80 / cold read 2.42 GB/s, io_uring 2x4 1.66 / 2.23, 2x8 1.85 / 2.22.
    queue_depth = _int_env("FASTPERSIST_QUEUE_DEPTH", 8)
    if queue_depth > 1024:
        raise ValueError(f"FASTPERSIST_QUEUE_DEPTH={queue_depth} is above the limit of 1024")
    frame_bytes = _int_env("FASTPERSIST_FRAME_BYTES", 4 * _MIB, minimum=ALIGNMENT)
    if frame_bytes % ALIGNMENT or frame_bytes > MAX_FRAME_BYTES:
        raise ValueError(f"FASTPERSIST_FRAME_BYTES={frame_bytes} must be a multiple of "
                         f"{ALIGNMENT} and at most {MAX_FRAME_BYTES}")
    return Knobs(
        block_size=block_size,
        threads=threads,
        buffer_budget=_int_env("FASTPERSIST_BUFFER_BUDGET", 64 * _MIB),
        direct=_choice_env("FASTPERSIST_DIRECT", "auto", ("auto", "on", "off")),
        engine=_choice_env("FASTPERSIST_ENGINE", "native", ("native", "python")),
        verify_load=_choice_env("FASTPERSIST_VERIFY_LOAD", "1", ("0", "1")) == "1",
        staging_budget=_int_env("FASTPERSIST_STAGING_BUDGET", 0, minimum=0),
        max_in_flight=_int_env("FASTPERSIST_MAX_IN_FLIGHT", 1),
        io_backend=io_backend(),
        daemon=daemon_address(),
        file_bytes=_int_env("FASTPERSIST_FILE_BYTES", 256 * _MIB),
        node=os.environ.get("FASTPERSIST_NODE", "").strip() or socket.gethostname(),
        dist_timeout=_int_env("FASTPERSIST_DIST_TIMEOUT", 600),
        piece_bytes=_int_env("FASTPERSIST_PIECE_BYTES", 4 * _MIB),
        queue_depth=queue_depth,
        tier_concurrency=_int_env("FASTPERSIST_TIER_CONCURRENCY", 8),
        tier_part_bytes=_int_env("FASTPERSIST_TIER_PART_BYTES", 16 * _MIB, minimum=5 * _MIB),
        tier_attempts=_int_env("FASTPERSIST_TIER_ATTEMPTS", 5),
        tier_timeout=_int_env("FASTPERSIST_TIER_TIMEOUT", 120),
        tier_retry_max=_int_env("FASTPERSIST_TIER_RETRY_MAX", 60),
        codec_threads=min(_int_env("FASTPERSIST_CODEC_THREADS",
                                   min(8, len(os.sched_getaffinity(0)))), 64),
        frame_bytes=frame_bytes,
        background_nice=min(_int_env("FASTPERSIST_BACKGROUND_NICE", 10, minimum=0), 19),
        load_ring_bytes=_int_env("FASTPERSIST_LOAD_RING_BYTES", 256 * _MIB, minimum=0),
        daemon_room_timeout=_int_env("FASTPERSIST_DAEMON_ROOM_TIMEOUT", 600, minimum=0),
    )
