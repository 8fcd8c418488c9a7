"""The exchanges of a distributed save, and the agreement on each phase's outcome.

Every phase of a save ends in an exchange (a collective over the checkpoint's
own gloo group) that carries each rank's error, if any, so that every rank
raises the same error (Phase.agree). An exchange that fails itself means
that a rank died or hung, or the network broke: Phase.collective raises
RanksLost, and the save finds out who is gone and whether the job committed
(outcome.py) before it answers.
"""

from __future__ import annotations

import datetime
import pickle
import secrets
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .. import gcpause
from ..errors import CheckpointError, DistributedCheckpointError
from ..knobs import current as current_knobs
from .outcome import ProcessId
from .planner import PlanCache

T = TypeVar("T")


class Coordinator:
    """The gloo group and plan cache for one process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        timeout = datetime.timedelta(seconds=current_knobs().dist_timeout)
        # Collective over the whole world: every rank must make its first
        # distributed save (or load) at the same point, as with any new_group.
        self.group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        self.ranks = ranks
        self.rank = dist.get_rank(self.group)
        self.size = len(ranks)
        self.cache = PlanCache()
        self.plans_made = 0  # for tests and benchmarks: cache hits make none
        self.warned_values = False  # ranks' differing values are reported once
        # Names this group's keys in the job's store: a job restarted under
        # torchrun meets the keys of its previous incarnation there.
        self.token: str = self.broadcast(secrets.token_hex(8) if self.rank == 0 else None)
        self.saves = 0  # every rank counts its saves alike: they run in one order
        # The ranks' processes (outcome.ProcessId) as of the last describe: for
        # a rank lost before the next save's describe exchange.
        self.processes: list[ProcessId] | None = None

    # The gathers move pickled bytes and unpickle them here (unpickled): the
    # messages of thousands of ranks are hundreds of thousands of objects,
    # unpickled with the cyclic collector paused, and only then; torch's
    # *_object collectives unpickle inside the call, and the call also waits
    # for the slowest rank, which a pause must not span.

    def all_gather(self, value: T) -> list[T]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, pickle.dumps(value), group=self.group)
        return unpickled(out)

    def gather(self, value: T) -> list[T] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(pickle.dumps(value), out, dst=self.ranks[0], group=self.group)
        return None if out is None else unpickled(out)

    def gather_bytes(self, value: bytes) -> list[bytes] | None:
        """gather for a message that is bytes already, sent as it is: rank 0
        reads each through views (written.Written.received), where gather
        would unpickle a copy of every rank's (277 MB at 16,384 ranks of a
        405B model, most of the first commit's time in page faults)."""
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=self.ranks[0], group=self.group)
        return out

    def gather_from(self, value: T, sources: list[int]) -> dict[int, T] | None:
        """Rank 0 gets `value` from each of `sources` (ranks of the group) and
        from them only, each message its own size; the others send nothing.
        For what only some ranks hold (one description per layout): gather
        pads every rank's message to the largest, so rank 0 would receive
        size x largest bytes (gigabytes at thousands of ranks)."""
        got = self.gather_bytes_from(pickle.dumps(value), sources)
        if got is None:
            return None
        values = iter(unpickled([got[src] for src in sources if src != 0]))
        return {src: value if src == 0 else next(values) for src in sources}

    def gather_bytes_from(self, value: bytes, sources: list[int]) -> dict[int, bytes] | None:
        """gather_from for a message that is bytes already, sent as it is
        (table.BoxTable.sent), as gather_bytes."""
        if self.rank == 0:
            got: dict[int, bytes] = {}
            for src in sources:
                if src != 0:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=self.ranks[src], group=self.group)
                    got[src] = box[0]
            return {src: value if src == 0 else got[src] for src in sources}
        if self.rank in sources:
            dist.send_object_list([value], dst=self.ranks[0], group=self.group)
        return None

    def scatter(self, values: list[T] | None) -> T:
        """Rank 0's values[r] to each rank r: what only that rank needs, so a
        rank receives its share and not the whole (a plan at thousands of ranks)."""
        out: list[Any] = [None]
        dist.scatter_object_list(out, values, src=self.ranks[0], group=self.group)
        return out[0]  # type: ignore[no-any-return]

    def broadcast(self, value: T | None) -> T:
        box = [value]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]  # type: ignore[return-value]


@gcpause.paused()
def unpickled(messages: list[bytes]) -> list[Any]:
    """What the ranks sent, from their pickled messages (Coordinator's gathers)."""
    return list(map(pickle.loads, messages))


_coordinators: dict[Any, Coordinator] = {}


def coordinator_for(group: dist.ProcessGroup | None) -> Coordinator:
    key = group if group is not None else "world"
    if key not in _coordinators:
        _coordinators[key] = Coordinator(group)
    return _coordinators[key]


@dataclass
class Failure:
    rank: int
    phase: str
    error: str


def failure(rank: int, phase: str, exc: BaseException) -> Failure:
    if isinstance(exc, CheckpointError | OSError | ValueError | TypeError):
        return Failure(rank, phase, f"{type(exc).__name__}: {exc}")
    return Failure(rank, phase, "".join(traceback.format_exception_only(exc)).strip())


class RanksLost(Exception):
    """An exchange failed: a rank died or hung, or the group broke. Never
    reaches the user: the save turns it into its one error (outcome.py)."""

    def __init__(self, phase: str, cause: str) -> None:
        super().__init__(f"the {phase} exchange failed: {cause}")
        self.phase = phase
        self.cause = cause


class Phase:
    """Runs one phase's exchange, and agrees with every rank on its outcome."""

    def __init__(self, co: Coordinator, on_failure: Callable[[], None]) -> None:
        self.co = co
        self.on_failure = on_failure

    def collective(self, phase: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # a peer died, hung, or the group broke
            raise RanksLost(phase, str(exc).split(". This is typically")[0]) from exc

    def agree(self, phase: str, error: Failure | None) -> None:
        """Every rank learns every failure of this phase; all raise the same error."""
        failures = [f for f in self.collective(phase, lambda: self.co.all_gather(error)) if f]
        if failures:
            self.on_failure()
            raise failed(failures)


def failed(failures: list[Failure], what: str = "distributed checkpoint failed") -> \
        DistributedCheckpointError:
    return DistributedCheckpointError(
        f"{what}: " + "; ".join(f"rank {f.rank} ({f.phase}): {f.error}" for f in failures),
        {f.rank: f"{f.phase}: {f.error}" for f in failures})


__all__ = ["Coordinator", "Failure", "Phase", "RanksLost", "coordinator_for", "failed",
           "failure"]
