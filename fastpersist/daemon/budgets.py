"""Memory and counts: the clients' shared memory the daemon accepts, checkpoints
in flight, and the daemon's own memory.

Shared memory. A checkpoint reserves, at Begin, the shared memory it will
reference; the sum over checkpoints in flight is bounded by --staging-budget
and per client by --client-budget. A Begin that does not fit is refused
(RESOURCE_EXHAUSTED, naming the numbers) before anything is made. Those pages
are the trainers': tmpfs charges them to the cgroup that first touches them,
not to the daemon. By default the daemon accepts at once half of the
shared-memory file system, and one client half of that. The Ledger keeps the
sums as the checkpoints come and go, so that checking a Begin (with the
service lock held) costs the same with ten thousand checkpoints known as with
one.

The daemon's own memory is bounded by construction, whatever the requests:
streamed files need no staging and go to disk through --max-streams slots of
two blocks each (streams.py), and the --write-concurrency workers each hold at
most the engine's bounce buffers (FASTPERSIST_BUFFER_BUDGET). own_memory()
adds it up; the daemon logs it at start and warns if its cgroup's limit is
lower.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import knobs
from .requests import MAX_IN_FLIGHT_PER_CLIENT, RequestError

# Checkpoints in flight over all clients: each holds two descriptors, a staging
# directory and its bookkeeping; client ids are the clients' to choose.
MAX_IN_FLIGHT = 1024
MIB = 1 << 20
DEFAULT_STREAMS = 4
# The chunk the client library streams (daemon_client.CHUNK), and how many of
# them a stream holds in gRPC and protobuf (the transport's window, the message
# arriving, its parsed copy, the bytes being copied): measured, 4 streams held
# 33 MiB of 1 MiB messages at their peak.
CLIENT_CHUNK = 1 * MIB
CHUNKS_HELD = 12
# An idle daemon: the interpreter, gRPC, its modules (44 MiB measured), with room.
IDLE_BYTES = 64 * MIB


@dataclass(frozen=True)
class Budgets:
    staging: int  # bytes, all clients; 0: unlimited
    client: int  # bytes, one client; 0: unlimited


class Ledger:
    """Staging reserved and checkpoints in flight, in all and per client.
    Called with the service lock held."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.total = 0
        self.count = 0
        # What the budgets bound, as it was at its highest since the start
        # (Info): the reservations, and the submitted files' shared memory the
        # daemon holds mapped until it wrote them (within the reservations).
        self.peak = 0
        self.mapped = 0
        self.mapped_peak = 0
        self._bytes: Counter[str] = Counter()
        self._count: Counter[str] = Counter()

    def reserved(self, client: str | None = None) -> int:
        return self.total if client is None else self._bytes[client]

    def in_flight(self, client: str | None = None) -> int:
        return self.count if client is None else self._count[client]

    def check(self, client: str, staging_bytes: int) -> None:
        """Refuse a Begin that exceeds a budget or a count."""
        if self._count[client] >= MAX_IN_FLIGHT_PER_CLIENT:
            raise RequestError("RESOURCE_EXHAUSTED",
                               f"this client has {self._count[client]} checkpoints in flight, "
                               "the most one client may have")
        if self.count >= MAX_IN_FLIGHT:
            raise RequestError("RESOURCE_EXHAUSTED",
                               f"{self.count} checkpoints are in flight, the most the daemon "
                               "takes at once")
        b = self.budgets
        if b.client and self._bytes[client] + staging_bytes > b.client:
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"this client would hold {self._bytes[client] + staging_bytes} bytes of "
                f"staging, over the daemon's per-client budget of {b.client}")
        if b.staging and self.total + staging_bytes > b.staging:
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"{staging_bytes} bytes of staging do not fit the daemon's budget: "
                f"{self.total} of {b.staging} are in use")

    def add(self, client: str, staging_bytes: int) -> None:
        self.total += staging_bytes
        self.peak = max(self.peak, self.total)
        self.count += 1
        self._bytes[client] += staging_bytes
        self._count[client] += 1

    def remove(self, client: str, staging_bytes: int) -> None:
        self.total -= staging_bytes
        self.count -= 1
        self._bytes[client] -= staging_bytes
        self._count[client] -= 1
        if not self._count[client]:  # forget the client: ids are unbounded
            del self._bytes[client], self._count[client]

    def map(self, nbytes: int) -> None:
        self.mapped += nbytes
        self.mapped_peak = max(self.mapped_peak, self.mapped)

    def unmap(self, nbytes: int) -> None:
        self.mapped -= nbytes


# Parsing JSON takes many times its size in Python objects (a 7 MB list of
# small numbers: 250 MB), and what one parse freed is not all given back to
# the system: 32 clients parsing big headers and trees at once left the
# daemon at 400 MiB of RSS (measured). Big parses take turns instead.
BIG_PARSE_BYTES = 1 << 20
_big_parses = threading.BoundedSemaphore(2)
_holds_a_turn = threading.local()


@contextlib.contextmanager
def parsing(nbytes: int) -> Iterator[None]:
    """Hold this while receiving or parsing `nbytes` of a request (never with
    the service lock). Within a thread's turn it takes no second one: two
    threads each holding one and waiting for another would wait forever."""
    if nbytes < BIG_PARSE_BYTES or getattr(_holds_a_turn, "held", False):
        yield
        return
    with _big_parses:
        _holds_a_turn.held = True
        try:
            yield
        finally:
            _holds_a_turn.held = False


def default_budgets(shm_dir: Path) -> Budgets:
    """Half of the shared-memory file system's size for all clients, half of
    that for one: staged checkpoints live there, and a Begin refused with the
    numbers is better than a client's ENOSPC (or a node out of memory)."""
    st = os.statvfs(shm_dir)
    staging = st.f_blocks * st.f_frsize // 2
    return Budgets(staging, staging // 2)


def default_tier_bytes(quarter: int, own: dict[str, int], limit: int | None) -> int:
    """--memory-tier-bytes' default: a quarter of the shared-memory file
    system, and within a cgroup's limit half of what the daemon's own memory
    leaves of it. The copies are tmpfs pages the daemon wrote: its cgroup is
    charged for them and cannot reclaim them (only swap them), so a budget
    over the limit would have the daemon OOM-killed."""
    if limit is None:
        return quarter
    return max(0, min(quarter, (limit - sum(own.values())) // 2))


def stream_block() -> int:
    """The size of each of a stream slot's two blocks: the engine's block size."""
    return knobs.current().block_size


def own_memory(write_concurrency: int, max_streams: int) -> dict[str, int]:
    """An upper bound of the daemon's own (cgroup-charged) memory, by part."""
    k = knobs.current()
    # The engine's bounce buffers per write: one block per pool thread, or
    # queue_depth blocks per io_uring thread; both fit FASTPERSIST_BUFFER_BUDGET.
    per_write = max(k.io_threads, k.uring_threads * k.io_queue_depth) * k.block_size
    return {
        "idle": IDLE_BYTES,
        "writers": write_concurrency * per_write,
        "streams": max_streams * (2 * stream_block() + CHUNKS_HELD * CLIENT_CHUNK),
    }


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        mount: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit (v2 memory.max, or v1
    memory.limit_in_bytes), None where there is none or it cannot be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(Path(mount, path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            candidates.append(Path(mount, "memory", path.lstrip("/"), "memory.limit_in_bytes"))
    for file in candidates:
        try:
            text = file.read_text().strip()
        except OSError:
            continue  # another namespace's path, or the controller is not mounted
        # "max" (v2) or a page-rounded 2**63 (v1) says there is no limit.
        return int(text) if text.isdigit() and int(text) < 1 << 60 else None
    return None
