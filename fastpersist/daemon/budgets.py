"""Memory the daemon accepts: staging budgets, and the buffers of streamed files.

A checkpoint reserves, at Begin, the shared memory it will reference; the sum
over checkpoints in flight is bounded by --staging-budget and per client by
--client-budget. A Begin that does not fit is refused (RESOURCE_EXHAUSTED).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass

from ..shm import Mapping
from .checkpoints import Checkpoint
from .requests import RequestError


@dataclass(frozen=True)
class Budgets:
    staging: int  # bytes, all clients; 0: unlimited
    client: int  # bytes, one client; 0: unlimited


def reserved(checkpoints: Iterable[Checkpoint], client: str | None = None) -> int:
    """Staging reserved by the checkpoints in flight (of one client, or all)."""
    return sum(c.reserved for c in checkpoints
               if not c.terminal and (client is None or c.client == client))


def check_fits(budgets: Budgets, checkpoints: Iterable[Checkpoint], client: str,
               staging_bytes: int) -> None:
    """Refuse a Begin whose staging would exceed a budget."""
    checkpoints = list(checkpoints)
    if budgets.client and reserved(checkpoints, client) + staging_bytes > budgets.client:
        raise RequestError(
            "RESOURCE_EXHAUSTED",
            f"client {client} would hold {reserved(checkpoints, client) + staging_bytes} bytes "
            f"of staging, over the daemon's per-client budget of {budgets.client}")
    if budgets.staging and reserved(checkpoints) + staging_bytes > budgets.staging:
        raise RequestError(
            "RESOURCE_EXHAUSTED",
            f"{staging_bytes} bytes of staging do not fit the daemon's budget: "
            f"{reserved(checkpoints)} of {budgets.staging} are in use")


def anonymous_buffer(nbytes: int) -> Mapping:
    """Memory for a streamed data file (SubmitStream): page-aligned, so the
    engine writes it with O_DIRECT like a shared-memory segment."""
    try:
        m = mmap.mmap(-1, max(nbytes, 1))
    except (OSError, OverflowError, MemoryError) as exc:
        raise RequestError("RESOURCE_EXHAUSTED",
                           f"cannot hold a {nbytes}-byte streamed file in memory: {exc}") from None
    return Mapping(m, memoryview(m)[:nbytes])
