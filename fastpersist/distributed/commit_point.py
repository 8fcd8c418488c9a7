"""Step 5 of a distributed save (coordinator.py), and its one outcome when ranks are lost.

    5a rank 0 builds the job manifest and broadcasts it
    5b node-local: the first rank of every other node prepares its part:
       durable and hidden (prepared.py)
    5c rank 0 claims the job's Ballot and publishes its domain: the commit
       point; the ballot records what came of it (outcome.py)
    5d node-local: the other nodes publish their prepared part

Nothing but rank 0's publish decides whether the job committed. From the
moment rank 0 may hold the manifest (the gather of the write records) an
exchange that fails on a rank makes it ask the ballot (or the storage) which
it was, so that every rank answers alike: a job that committed is reported
as saved, with a warning naming the lost ranks; one that did not raises the
same DistributedCheckpointError on every rank, naming them; node-local with
no way to learn it, every rank reports it in doubt and the prepared parts
wait for settling.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..errors import DistributedCheckpointError
from ..storage.retention import AfterCommit
from .outcome import (
    ABANDONED,
    COMMITTED,
    FAILED,
    PUBLISHING,
    Ballot,
    ProcessId,
    SaveStore,
    check_in,
    post_mortem,
)
from .phases import Coordinator, Failure, Phase, RanksLost, failed, failure
from .storage import Ident, Storage

NOT_COMMITTED, IN_DOUBT = "not committed", "in doubt"


class CommitPoint:
    """The commit step and the answer after a lost rank, for coordinator.Save,
    which sets these attributes as the save goes."""

    co: Coordinator
    storage: Storage
    phase: Phase
    target: Path
    node_local: bool
    nodes: list[str]
    grace: float  # how long survivors wait for ranks nobody sees, after a failure
    timeout: float  # FASTPERSIST_DIST_TIMEOUT: and for ranks seen alive
    store: SaveStore
    ballot: Ballot
    processes: list[ProcessId] | None = None
    staged: str | None = None  # this rank staged its domain (storage.stage)
    directory: str = ""  # its domain's staging place
    staging_ident: Ident | None = None  # in rank 0's domain: that place's (dev, inode)
    committing = False  # rank 0 may hold the manifest: a lost rank asks the ballot
    published = False  # this rank published its domain
    prepared: str | None = None  # node-local: this rank's prepared part
    job_committed = False  # the job committed, as far as this rank knows
    ranks_lost = False  # the save ended, committed, with ranks lost
    after_commit_policy: AfterCommit | None = None  # a Checkpointer's, applied with 5c
    after_commit_error = ""  # what of it failed, as the storage reported

    def commit(self, manifest: bytes | None) -> None:
        """5a-5d; `manifest`: rank 0's, None elsewhere."""
        co, phase = self.co, self.phase
        # Only node-local parts (5b) need the manifest on other ranks; on shared
        # storage the exchange carries nothing, not the manifest to every rank.
        sent = manifest if self.node_local or manifest is None else b""
        got = phase.collective("commit", lambda: co.broadcast(sent))
        manifest = manifest if co.rank == 0 else got
        assert manifest is not None
        if self.node_local:
            phase.agree("prepare", self._prepare_part(manifest) if co.rank != 0 else None)
        # Returns once rank 0 published (or raises everywhere if it could not).
        phase.agree("commit", self._commit(manifest) if co.rank == 0 else None)
        self.job_committed = True
        if self.node_local:
            mine = self._publish_part()
            failures = [f for f in phase.collective("publish", lambda: co.all_gather(mine))
                        if f]
            if failures:
                error = failed(failures, f"distributed checkpoint {self.target.name} was "
                               "committed, but a node could not publish its part (it stays "
                               "prepared, in doubt, until fastpersist.distributed.settle "
                               "publishes it)")
                error.committed = True
                raise error

    def _prepare_part(self, manifest: bytes) -> Failure | None:
        """5b, on the first rank of a node other than rank 0's."""
        if self.staged is None:
            return None
        try:
            self.prepared = self.storage.prepare(self.target, self.staged, manifest,
                                                 self.nodes[self.co.rank], self.nodes[0])
        except Exception as exc:
            return failure(self.co.rank, "prepare", exc)
        self.staged = None
        return None

    def _commit(self, manifest: bytes) -> Failure | None:
        """5c, on rank 0."""
        claimed = self.ballot.claim(PUBLISHING)
        if claimed not in (None, PUBLISHING):
            # A rank lost an exchange and gave the job up first.
            raise RanksLost("commit", "another rank gave the job up")
        assert self.staged is not None
        try:
            # A Checkpointer's policy goes with rank 0's publish, the job's
            # commit point (never before it: the commit may still fail).
            self.after_commit_error = self.storage.publish(
                self.staged, manifest, self.nodes[0] if self.node_local else None,
                self.after_commit_policy)
        except Exception as exc:
            self.ballot.record(FAILED + str(exc))
            return failure(0, "commit", exc)
        self.published = True
        self.ballot.record(COMMITTED)
        return None

    def _publish_part(self) -> Failure | None:
        """5d: the prepared part of this node, after the commit."""
        if self.prepared is None:
            return None
        try:
            self.storage.resolve(self.target, self.prepared, publish=True)
        except Exception as exc:
            return failure(self.co.rank, "publish", exc)
        self.prepared = None
        self.published = True
        return None

    def clean_up(self, *, keep_prepared: bool = False) -> None:
        """After the job failed, or is in doubt (keep_prepared). Its own
        errors are warned about, not raised: every rank must raise the job's
        one error."""
        try:
            if self.staged is not None and not self.published:
                self.storage.abort(self.staged)
                self.staged = None
            if self.prepared is not None and not self.job_committed and not keep_prepared:
                self.storage.resolve(self.target, self.prepared, publish=False)
                self.prepared = None
        except Exception as exc:
            warnings.warn(f"rank {self.co.rank}: cleaning up the failed save of {self.target} "
                          f"failed too: {exc}", RuntimeWarning, stacklevel=2)

    def lost(self, lost: RanksLost, stage: str = "save") -> None:
        """An exchange failed: learn with the other survivors whether the job
        committed and which ranks are gone. Returns (after a warning) if it
        committed; otherwise cleans up and raises the job's one error."""
        # This rank may know (it passed the commit exchange), or know that
        # the job cannot have committed (the exchange lost came before
        # anyone could hold the manifest); otherwise it asks.
        outcome = COMMITTED if self.job_committed else (
            self._outcome() if self.committing else NOT_COMMITTED)
        verdict = post_mortem(self.store, stage, self.co.rank, self.co.size, lost.phase,
                              lost.cause, self.processes, self.grace, self.timeout)
        gone = verdict.describe()
        name = self.target.name
        if outcome == COMMITTED:
            self.job_committed = self.ranks_lost = True
            error = self._publish_part()
            if error is not None:
                warnings.warn(f"{self.target}: {error.error}; this node's part stays prepared, "
                              "in doubt, until fastpersist.distributed.settle publishes it",
                              RuntimeWarning, stacklevel=2)
            warnings.warn(f"distributed checkpoint {name} was committed, but {gone}",
                          RuntimeWarning, stacklevel=2)
            return
        self.clean_up(keep_prepared=outcome == IN_DOUBT)
        failures = {r: f"{what} (noticed in the {verdict.phase} exchange)"
                    for r, what in verdict.lost.items()}
        if outcome == IN_DOUBT:
            after = ("nodes other than rank 0's keep their part prepared and hidden until "
                     "fastpersist.distributed.settle decides it" if self.node_local else
                     "the fastpersistd that began the job commits or drops it; the target "
                     "shows which")
            raise DistributedCheckpointError(
                f"distributed checkpoint {name} is in doubt: {gone}, and whether rank 0 "
                "published it cannot be learned here (neither the job's c10d store nor "
                f"this rank's view of rank 0's storage tells; under torchrun the store "
                f"outlives rank 0); {after}", failures, committed=None) from lost
        raise DistributedCheckpointError(
            f"distributed checkpoint {name} failed: {gone}; nothing was committed",
            failures) from lost

    def _outcome(self) -> str:
        """COMMITTED, NOT_COMMITTED or IN_DOUBT, the same on every survivor
        (outcome.py, 1)."""
        sees = self.staging_ident is not None  # rank 0's storage (storage.fate)
        value = self.ballot.claim(ABANDONED)
        if value == PUBLISHING:
            # Rank 0 is at its publish: wait for it, unless it is gone; where
            # this rank cannot see its storage, also for the ranks that can.
            gone = sees and bool(self.processes and self.processes[0].gone())
            value = self.ballot.settle(0 if gone else self.grace if sees else 2 * self.grace)
        # Rank 0 lost at its publish (PUBLISHING), or no store (None): its
        # storage shows whether the publish happened. Node-local, only the
        # store can tell the other nodes what rank 0's node shows.
        if sees and (value == PUBLISHING or (value is None and not self.node_local)):
            assert self.staging_ident is not None
            fate = self.storage.fate(self.target, self.directory, self.staging_ident,
                                     self.grace)
            if fate is not None:
                found = COMMITTED if fate else ABANDONED
                value = found if value is None else self.ballot.decide(found)
        if value == PUBLISHING:
            # Nobody could tell: in doubt, and the same for all who ask after.
            value = self.ballot.decide(IN_DOUBT)
        if value == COMMITTED:
            return COMMITTED
        if value == ABANDONED or (value or "").startswith(FAILED):
            return NOT_COMMITTED
        return IN_DOUBT

    def check_in(self, stage: str) -> None:
        """This rank finished `stage` (for the post-mortems of the others)."""
        check_in(self.store, stage, self.co.rank)


__all__ = ["IN_DOUBT", "NOT_COMMITTED", "CommitPoint"]
