"""Memory and counts the daemon accepts: staging budgets, checkpoints in flight,
and the slots of streamed files.

A checkpoint reserves, at Begin, the shared memory it will reference; the sum
over checkpoints in flight is bounded by --staging-budget and per client by
--client-budget. A Begin that does not fit is refused (RESOURCE_EXHAUSTED).
The Ledger keeps the sums as the checkpoints come and go, so that checking a
Begin (with the service lock held) costs the same with ten thousand
checkpoints known as with one. A streamed file needs no staging: it goes to
disk through one of --max-streams slots of two blocks each (streams.py).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .. import knobs
from .requests import MAX_IN_FLIGHT_PER_CLIENT, RequestError

# Checkpoints in flight over all clients: each holds two descriptors, a staging
# directory and its bookkeeping; client ids are the clients' to choose.
MAX_IN_FLIGHT = 1024
DEFAULT_STREAMS = 4


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


def stream_block() -> int:
    """The size of each of a stream slot's two blocks: the engine's block size."""
    return knobs.current().block_size
