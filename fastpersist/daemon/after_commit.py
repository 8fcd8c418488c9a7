"""A Checkpointer's policy, applied by the daemon after it commits a checkpoint.

The daemon owns everything under its --root, so a Checkpointer saving through
it hands over its policy (move `latest`, apply retention) with the commit
(CommitRequest.after_commit, CommitJobRequest.after_commit), and the daemon
applies it in the checkpoint's directory after the commit and before it
reports COMMITTED: so it happens even if the trainer is gone by then. The
rules are retention.py's, the same as in-process. A failure does not undo
the commit; it is logged, counted and reported with the COMMITTED status.

With a tier (tiering.py), every checkpoint the daemon commits is queued for
upload here (committed()), and retention keeps those not uploaded yet. With
peer replication (replication.py), it is queued to be sent to the peers, as
is a node-local job's part that this node publishes (published()).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PostCommitError
from ..storage.commit import Staging
from ..storage.retention import AfterCommit, apply, step_of
from . import logs
from .metrics import Metrics
from .requests import invalid

if TYPE_CHECKING:
    from .memory import MemoryTier
    from .replication import Replicator
    from .tiering import DaemonTier


def check_target(target: Path, relpath: str) -> None:
    """A Checkpointer's checkpoints are step-N: retention and the pointer rely on it."""
    if step_of(target.name) is None:
        raise invalid(f"after_commit applies to a Checkpointer's checkpoints, named step-N; "
                      f"not {relpath}")


@contextlib.contextmanager
def held_parent(staging: Staging, policy: AfterCommit | None) -> Iterator[int | None]:
    """The directory the checkpoint was begun in (beneath the root, opened
    without following links at Begin), held across its commit, which releases
    the staging's own descriptors: the policy is applied there, never by path.
    None without a policy."""
    if policy is None:
        yield None
        return
    assert staging.fds is not None  # the daemon's stagings are held open
    fd = os.dup(staging.fds.parent)
    try:
        yield fd
    finally:
        os.close(fd)


class AfterCommits:
    """Applies policies, one at a time per directory (two checkpoints of one
    root may finish at once on two write workers), never under the service lock."""

    def __init__(self, metrics: Metrics, tier: DaemonTier | None = None,
                 memory: MemoryTier | None = None) -> None:
        self.metrics = metrics
        self.tier = tier
        self.memory = memory
        self.replicator: Replicator | None = None  # set by the daemon's main, with --replicas
        self._mutex = threading.Lock()
        self._locks: dict[tuple[int, int], threading.Lock] = {}

    def _lock(self, dir_fd: int) -> threading.Lock:
        st = os.fstat(dir_fd)
        with self._mutex:
            return self._locks.setdefault((st.st_dev, st.st_ino), threading.Lock())

    def committed(self, relpath: str, *, upload: bool = True) -> None:
        """ROOT/relpath was just committed: queue its upload (with a tier;
        not when a Checkpointer's tier_every passes it: upload=False).
        Never raises: the checkpoint is committed, and whoever asked must hear
        so; a checkpoint not queued is logged, and the next start queues it.
        The memory tier's copy of a checkpoint it replaced goes."""
        if self.memory is not None:
            self.memory.forget(relpath)
        self.published(relpath)
        if self.tier is None:
            return
        if not upload:
            logs.info("tier-not-asked", path=relpath)
            return
        try:
            self.tier.add(relpath)
        except Exception as exc:  # reported, never a failed commit
            self.metrics.tier_uploads.labels(result="not-queued").inc()
            logs.error("tier-not-queued", path=relpath, error=str(exc))

    def published(self, relpath: str) -> None:
        """ROOT/relpath holds this node's committed files: queue them for the
        peers (with --replicas). Never raises, as committed()."""
        if self.replicator is None:
            return
        try:
            self.replicator.add(relpath)
        except Exception as exc:  # reported, never a failed commit
            self.metrics.replication_failures.labels(reason="not-queued").inc()
            logs.error("replication-not-queued", path=relpath, error=repr(exc))

    def apply(self, dir_fd: int, target: Path, relpath: str, policy: AfterCommit,
              since: float | None = None) -> str:
        """Apply `policy` in `dir_fd` (held_parent) now that `target` is
        committed; returns what failed ("": nothing). since: when the
        checkpoint began (time.time()). Checkpoints not uploaded to the
        tier yet are kept."""
        tier, parent = self.tier, relpath.rpartition("/")[0]

        def protected(name: str) -> bool:
            return tier is not None and tier.is_pending(f"{parent}/{name}" if parent else name)

        try:
            with self._lock(dir_fd):
                done = apply(dir_fd, target.parent, target.name, policy, since, protected)
        except PostCommitError as exc:
            self.metrics.after_commit_failures.inc()
            logs.error("after-commit-failed", path=relpath, error=str(exc))
            return str(exc)
        if self.memory is not None:
            for name in done.deleted:
                self.memory.forget(f"{parent}/{name}" if parent else name)
        # What retention deleted is worth a line: the operator's record of it.
        logs.info("after-commit", path=relpath, latest=done.pointed, deleted=list(done.deleted))
        return ""
