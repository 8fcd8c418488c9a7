"""After an exchange of a distributed save failed: who is gone, and did the job commit?

A failed exchange (a rank died or hung, the network broke) ends the save on
every rank that notices, but not at the same exchange: gloo completes a
collective on each rank that received what it needs, so one rank may pass
the exchange that fails on another. Two questions must then get one answer
on every rank that survives:

1. Did the job commit? Rank 0's publish is the commit point. The ranks
   decide it in the job's c10d store (the one init_process_group made; under
   torchrun the agent hosts it, so it outlives every rank) with a Ballot:
   rank 0 claims it ("publishing") before it publishes and records what came
   of it ("committed", or "failed: ..."), and a survivor claims it
   ("abandoned") before it gives the job up. The first claim wins: rank 0
   does not publish an abandoned job, and a survivor that finds "committed"
   treats the save as done. When the store is gone too (it lived in rank 0's
   process), shared storage still answers (Storage.fate: the staging
   directory is taken out of rank 0's reach, then the target shows which
   happened first); node-local storage has no common ground, and the
   outcome is reported as in doubt, for settling.py to resolve.

2. Which ranks are gone? After a failure each survivor checks in (and each
   rank checks in as done after a save), and tells what it sees of the
   processes of the ranks on its machine: gone, or alive. The first survivor
   to get there names the lost ranks (post_mortem) and records that
   verdict; the others repeat it, so that every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# The store's calls are bounded by this, as a hung store (rank 0 stopped, not
# dead) would otherwise hold a survivor for the store's own timeout.
STORE_CALL_SECONDS = 10.0
POLL_SECONDS = 0.05

PUBLISHING, COMMITTED, ABANDONED, FAILED = "publishing", "committed", "abandoned", "failed: "


def job_store() -> Any:
    """The store every rank of the job shares, or None."""
    try:
        # torch has no public accessor for it; every rank holds one (see module docstring)
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


class SaveStore:
    """One save's keys in the job's store. Every call returns None (and the
    store counts as gone from then on) when the store fails or does not
    answer within STORE_CALL_SECONDS."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.gone = store is None

    def call(self, fn: Callable[[Any], T]) -> T | None:
        """fn(store), bounded; None if the store is gone."""
        if self.gone:
            return None
        box: list[Any] = []

        def run() -> None:
            # An error: the store's process died, or the connection broke.
            with contextlib.suppress(Exception):
                box.append(fn(self.store))

        # A thread, so that a store that hangs cannot hold us beyond the bound.
        worker = threading.Thread(target=run, name="fastpersist-store", daemon=True)
        worker.start()
        worker.join(STORE_CALL_SECONDS)
        if not box:
            self.gone = True
            return None
        return box[0]  # type: ignore[no-any-return]

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def add(self, name: str, n: int) -> int | None:
        return self.call(lambda s: int(s.add(self.key(name), n)))

    def has(self, name: str) -> bool | None:
        return self.call(lambda s: bool(s.check([self.key(name)])))

    def get(self, name: str) -> str | None:
        """The value, or None if there is none (yet) or the store is gone."""
        return self.call(lambda s: s.get(self.key(name)).decode() if s.check(
            [self.key(name)]) else None)

    def claim(self, name: str, value: str) -> str | None:
        """Set name to value unless it is set: the value it has now."""
        return self.call(lambda s: s.compare_set(self.key(name), "", value).decode())

    def set(self, name: str, value: str) -> None:
        self.call(lambda s: s.set(self.key(name), value))

    def delete(self, names: list[str]) -> None:
        self.call(lambda s: [s.delete_key(self.key(n)) for n in names])


class Ballot:
    """Whether the job committed, decided once for all ranks (module docstring)."""

    def __init__(self, store: SaveStore) -> None:
        self.store = store

    def claim(self, value: str) -> str | None:
        return self.store.claim("ballot", value)

    def record(self, value: str) -> None:
        self.store.set("ballot", value)

    def decide(self, value: str) -> str | None:
        """For rank 0, lost at its publish: `value`, found on its storage
        (Storage.fate), unless the ballot was decided meanwhile. Its value now."""
        return self.store.call(lambda s: s.compare_set(
            self.store.key("ballot"), PUBLISHING, value).decode())

    def settle(self, wait: float) -> str | None:
        """The ballot's value once it is no longer "publishing" (rank 0 is at its
        publish), waiting up to `wait` s: still PUBLISHING then if rank 0 died
        or hung in the middle of it; None if the store is gone."""
        deadline = time.monotonic() + wait
        while True:
            value = self.store.get("ballot")
            if value != PUBLISHING or time.monotonic() > deadline:
                return value
            time.sleep(POLL_SECONDS)


# --- which ranks are gone -------------------------------------------------------


@dataclass(frozen=True)
class ProcessId:
    """A rank's process, so that survivors on its machine can tell if it is gone."""

    machine: str  # boot id and pid namespace: pids compare only within one
    pid: int
    started: str  # the process's start time: pids are reused

    def gone(self) -> bool | None:
        """Whether the process has exited; None where this process cannot tell."""
        if not self.machine or self.machine != _machine():
            return None
        return _started(self.pid) != self.started


def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _started(pid: int) -> str:
    """The start time of a running process; "" for none (or one that exited
    and waits to be reaped: a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name (which may hold spaces): the state
            # is field 3, the start time field 22.
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return ""
    return fields[19]


def this_process() -> ProcessId:
    machine = _machine()
    return ProcessId(machine, os.getpid(), _started(os.getpid()) if machine else "")


@dataclass(frozen=True)
class Verdict:
    """The ranks found gone after a failed exchange, the same on every survivor."""

    phase: str  # the exchange in which the survivor that named them noticed
    lost: dict[int, str]  # rank -> what became of it
    cause: str = ""  # what that exchange raised there
    store_gone: bool = False  # not agreed: what one survivor saw by itself

    def describe(self) -> str:
        if not self.lost:
            return (f"the {self.phase} exchange failed ({self.cause}), but every rank "
                    "answered after it")
        named = "; ".join(f"rank {r} {what}" for r, what in sorted(self.lost.items()))
        # (Without a store, not said: the survivors that found one would not say it.)
        return f"{named} (noticed in the {self.phase} exchange)"


def check_in(store: SaveStore, stage: str, rank: int) -> None:
    """This rank is alive (after a failure) or done (after a save) in `stage`.
    (add, not set: it returns once the store has it, and a rank checks in
    before it exits, which _Watch relies on.)"""
    store.add(f"{stage}/alive/{rank}", 1)


def post_mortem(store: SaveStore, stage: str, rank: int, size: int, phase: str, cause: str,
                processes: list[ProcessId] | None, grace: float, timeout: float) -> Verdict:
    """Which ranks are gone (module docstring, 2): _find's verdict, which
    every survivor has before rank 0 returns (_wait_heard)."""
    verdict = _find(store, stage, rank, size, phase, cause, processes, grace, timeout)
    _wait_heard(store, stage, rank, size, verdict, grace)
    return verdict


def _wait_heard(store: SaveStore, stage: str, rank: int, size: int, verdict: Verdict,
                grace: float) -> None:
    """Rank 0 waits (at most `grace` s) until every survivor has read the
    verdict. Its process hosts the job's store (torch's TCPStore, under
    torchrun): a survivor still polling for the verdict when rank 0 returned
    and exited found the store gone, judged alone, and named rank 0 among the
    dead (seen under load in test_a_rank_killed_mid_save_fails_the_others_naming_it)."""
    if verdict.store_gone:
        return
    heard = store.add(f"{stage}/heard", 1)
    survivors = size - len(verdict.lost)
    deadline = time.monotonic() + grace
    while (rank == 0 and heard is not None and heard < survivors
           and time.monotonic() < deadline):
        time.sleep(POLL_SECONDS)
        heard = store.add(f"{stage}/heard", 0)


def _find(store: SaveStore, stage: str, rank: int, size: int, phase: str, cause: str,
          processes: list[ProcessId] | None, grace: float, timeout: float) -> Verdict:
    """Which ranks are gone. The first survivor here
    names them, once for all, when every rank has checked in or is known:
    dead, or alive (a survivor on its machine sees its process: a rank
    waiting in an exchange that others left may not notice before
    FASTPERSIST_DIST_TIMEOUT). It names the dead ranks, and the ranks that
    nobody answered for within `grace` s; if there are none, the ranks seen
    alive that did not answer within `timeout` s: they hung."""
    check_in(store, stage, rank)
    watch = _Watch(store, stage, processes)
    watch.look()
    if not store.gone and store.add(f"{stage}/reporter", 1) == 1:
        start, pause = time.monotonic(), POLL_SECONDS
        while True:
            watch.look()
            status = {r: _status(store, stage, r) for r in range(size)}
            dead = [r for r, s in status.items() if s == "dead"]
            unseen = [r for r, s in status.items() if s == "unseen"]
            seen = [r for r, s in status.items() if s == "seen"]
            elapsed = time.monotonic() - start
            if store.gone or not (unseen or seen) or (dead and not unseen) or (
                    unseen and elapsed > grace) or elapsed > timeout:
                break
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        lost = {r: "died" for r in dead}
        lost |= {r: f"did not answer within {grace:.0f} s (died or hung)" for r in unseen}
        if not lost:
            lost = {r: f"is alive but did not answer within {timeout:.0f} s (hung)"
                    for r in seen}
        verdict = Verdict(phase, lost, cause)
        recorded = store.claim(f"{stage}/verdict", _dump(verdict))
        return verdict if recorded is None else _parse(recorded)
    # The others repeat the reporter's verdict, and meanwhile go on telling
    # what they see of the ranks on their machine.
    deadline = time.monotonic() + max(timeout, grace) + grace
    while not store.gone and time.monotonic() < deadline:
        recorded = store.get(f"{stage}/verdict")
        if recorded is not None:
            return _parse(recorded)
        watch.look()
        time.sleep(POLL_SECONDS * 4)
    # No store to agree in: what this rank can see for itself.
    lost = {r: "died" for r in range(size)
            if r != rank and processes and processes[r].gone()}
    return Verdict(phase, lost, cause, store_gone=True)


def _status(store: SaveStore, stage: str, r: int) -> str:
    if store.has(f"{stage}/alive/{r}"):
        return "answered"
    if store.has(f"{stage}/dead/{r}"):
        return "dead"
    return "seen" if store.has(f"{stage}/seen/{r}") else "unseen"


class _Watch:
    """What a survivor sees of the ranks on its machine, told in the store:
    dead (gone before checking in), or alive (working, waiting, or hung)."""

    def __init__(self, store: SaveStore, stage: str, processes: list[ProcessId] | None) -> None:
        self.store, self.stage = store, stage
        self.processes = processes or []
        self.local = [r for r, p in enumerate(self.processes) if p.gone() is not None]
        self.told: dict[int, str] = {}

    def look(self) -> None:
        for r in self.local:
            if self.told.get(r) in ("dead", "answered"):
                continue
            if not self.processes[r].gone():
                if r not in self.told:
                    self.told[r] = "seen"
                    self.store.set(f"{self.stage}/seen/{r}", "1")
            elif self.store.has(f"{self.stage}/alive/{r}"):
                self.told[r] = "answered"  # and exited since
            else:
                # Gone before it checked in (looked up after it was seen gone:
                # a rank checks in before it exits).
                self.told[r] = "dead"
                self.store.set(f"{self.stage}/dead/{r}", "1")


def _dump(v: Verdict) -> str:
    return json.dumps({"phase": v.phase, "lost": {str(r): w for r, w in v.lost.items()},
                       "cause": v.cause})


def _parse(text: str) -> Verdict:
    doc = json.loads(text)
    return Verdict(doc["phase"], {int(r): w for r, w in doc["lost"].items()}, doc["cause"])


def forget(store: SaveStore, stages: list[str], rank: int, size: int) -> None:
    """Remove a finished save's keys (its successor calls this): each rank its
    own, rank 0 the shared ones, so that a month of saves leaves nothing."""
    names = [f"{s}/alive/{rank}" for s in stages]
    if rank == 0:
        names += ["ballot"] + [f"{s}/{n}" for s in stages
                               for n in ("reporter", "verdict", "heard")]
    store.delete(names)


__all__ = ["ABANDONED", "COMMITTED", "FAILED", "PUBLISHING", "Ballot", "ProcessId",
           "SaveStore", "Verdict", "check_in", "forget", "job_store", "post_mortem",
           "this_process"]
