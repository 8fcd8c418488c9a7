"""A distributed save: every rank writes the bytes it was assigned, rank 0 commits.

    1 describe  each rank: its tensors as boxes of global tensors (describe.py)
                and a digest of that layout; all-gather (node, layout, target)
    2 plan      rank 0, only when some rank's layout changed: get the items of
                each layout from its first rank, make_plan (planner.py),
                scatter each rank its share; every rank caches its plan
    3 stage     the first rank of each storage domain (the job, or each node
                when files stay node-local) makes the staging directory
    4 write     each rank writes its pieces into data-rRRRRR-NNN files there,
                fsynced (itself, or through its node's daemon); gather the
                file and tensor records to rank 0
    5 commit    rank 0 builds the job manifest (schema 2) and broadcasts it,
                and publishes its domain: the commit point. Node-local, the
                other nodes prepare their part (durable, hidden) before it,
                and publish it after it (commit_point.py)

All of it runs over a gloo group of its own, made once per process group, so
checkpoint traffic never queues behind (or blocks) training collectives, and
with a timeout (FASTPERSIST_DIST_TIMEOUT), so a dead or hung rank makes the
others fail instead of hanging. Every phase ends in an exchange that carries
each rank's error, if any: a failure anywhere raises the same
DistributedCheckpointError on every rank, naming each failed rank and phase,
and the staging directories are removed (phases.py). An exchange that fails
itself (a rank died or hung) ends the save with one outcome on every rank
that survives, naming the lost ranks (commit_point.py, outcome.py).

Where the bytes go is a storage.Storage: written in-process, or handed to
each node's fastpersistd as parts of one job that the daemon commits.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import gcpause
from ..errors import (
    CheckpointAbortedError,
    CheckpointError,
    DistributedCheckpointError,
    PostCommitError,
)
from ..knobs import current as current_knobs
from ..saving.files import StagedFiles
from ..storage.local_path import checkpoint_path
from ..storage.retention import AfterCommit
from ..tensors import packed, state
from ..tensors.plan import StoredTensor
from .boxes import key_of
from .commit_point import CommitPoint
from .describe import (
    Held,
    describe,
    differing_keys,
    piece_source,
    replica_values,
    values_digest,
)
from .layout import (
    RankView,
    domains,
    target_conflict,
    tensor_bytes_by_rank,
    unaliased,
    within,
)
from .outcome import Ballot, SaveStore, forget, job_store, post_mortem, this_process
from .phases import Coordinator, Failure, Phase, RanksLost, coordinator_for, failure
from .plan import described
from .planner import Item, Plan, RankInfo, Share, keys_digest, layout_digest, make_plan
from .settling import has_prepared, settle_with
from .storage import Storage, ident_of
from .table import BoxTable
from .trees import joined, renumbered
from .written import Written, job_manifest, rendered


class Save(CommitPoint):
    """One distributed save, in two halves: prepare() (describe, plan, stage:
    quick, in the caller) and finish() (write, commit: in the caller for save,
    in the background for async_save). Every rank runs both halves of its
    saves in the same order; a finish must end before the next prepare."""

    def __init__(self, co: Coordinator, obj: Any, path: str | os.PathLike[str],
                 storage: Storage, *, node_local: bool, allow_pickle: bool,
                 aborted: Callable[[], bool] = lambda: False,
                 after_commit: AfterCommit | None = None,
                 compression: str | None = None, union: bool = False) -> None:
        self.co = co
        self.union = union  # ranks may hold different tensors (planner.py, trees.py)
        # A Checkpointer's policy: applied with rank 0's publish, the job's
        # commit point (never before it: other nodes' publishes may be undone).
        self.after_commit_policy = after_commit
        self.after_commit_error = ""  # what of it failed, as the storage reported
        self.aborted = aborted  # this rank gave the save up (the pipeline's close(abort=True))
        self.obj = obj
        self.storage = storage
        self.node_local = node_local
        self.allow_pickle = allow_pickle
        self.knobs = current_knobs()
        # compression="zstd": each rank's files are packed, in frames of this
        # many bytes (0: raw), by the rank or by its node's daemon.
        self.frame_bytes = self.knobs.frame_bytes if packed.check_compression(
            compression) else 0
        self.target = checkpoint_path(path)
        self.phase = Phase(co, self.clean_up)
        self.timeout = self.knobs.dist_timeout
        self.grace = min(self.timeout, 30)
        co.saves += 1
        self.store = SaveStore(job_store(), f"fastpersist/{co.token}/{co.saves}")
        self.ballot = Ballot(self.store)
        self.processes = co.processes  # until this save's describe exchange

    def prepare(self) -> None:
        try:
            self._prepare()
        except RanksLost as lost:
            self.lost(lost)  # before the commit window: raises

    def _prepare(self) -> None:
        co, phase, knobs = self.co, self.phase, self.knobs
        # 1 describe
        error = None
        self.held: list[Held] = []
        items: tuple[Item, ...] = ()
        values: list[tuple[str, str]] = []
        # Node-local: prepared parts left next to the target are settled first.
        prepared = self.node_local and has_prepared(self.target.parent)
        try:
            tree, leaves = state.encode(self.obj, allow_pickle=self.allow_pickle, sharded=True)
            self.tree = tree
            self.held = describe(unaliased(leaves))
            items = tuple(h.item for h in self.held)
            values = replica_values(self.obj)
            me = RankView(knobs.node, layout_digest(items), str(self.target),
                          values_digest(values), this_process(), prepared,
                          keys_digest(items) if self.union else "")
        except Exception as exc:
            error = failure(co.rank, "describe", exc)
            me = RankView(knobs.node, "", str(self.target), "", this_process(), prepared)
        self.obj = None  # the tensors live on in self.held; the rest is in the tree
        phase.agree("describe", error)
        everyone = phase.collective("describe", lambda: co.all_gather(me))
        self.processes = co.processes = [v.process for v in everyone]
        if co.saves > 1:
            # Every rank is past the save before: its keys in the store can go.
            forget(SaveStore(self.store.store, f"fastpersist/{co.token}/{co.saves - 1}"),
                   ["save", "after"], co.rank, co.size)
        self.nodes = [v.node for v in everyone]
        self.layouts = [v.layout for v in everyone]
        domain = domains(everyone, self.node_local)
        conflict = target_conflict(everyone, domain)
        if conflict is not None:
            raise conflict
        stages = [v.keys for v in everyone]  # all "" unless union=True
        if not co.warned_values and any(
                len({v.values for v in everyone if v.keys == k}) > 1 for k in set(stages)):
            self._warn_differing_values(values, stages)
        leaders = {d: min(r for r in range(co.size) if domain[r] == d) for d in set(domain)}
        if any(v.prepared for v in everyone):
            self._settle(leaders[domain[co.rank]] == co.rank)

        # 2 plan (cached while no rank's layout changes)
        plan = self._plan(everyone, items, knobs.piece_bytes)
        self.plan = plan
        # This rank's pieces, from its share and its own items (plan.py):
        # a rank's work, not the coordinator's.
        self.mine = (plan.share(co.rank) if isinstance(plan, Plan) else plan).pieces(items)
        if self.union:
            self._join_trees(stages)

        # 3 stage: the first rank of each domain makes the directory
        error, made_path = None, ""
        if leaders[domain[co.rank]] == co.rank:
            try:
                self.staged = made_path = self.storage.stage(self.target)
            except Exception as exc:
                error = failure(co.rank, "stage", exc)
        phase.agree("stage", error)
        paths = phase.collective("stage", lambda: co.all_gather(made_path))
        self.directory = paths[leaders[domain[co.rank]]]
        if domain[co.rank] == domain[0]:
            # What survivors look for if rank 0 is lost at its publish (storage.fate).
            self.staging_ident = ident_of(self.storage.place(self.target, self.directory))

    @gcpause.paused()  # rank 0 unpickles and plans 100,000s of boxes (see gcpause)
    def _plan(self, everyone: list[RankView], items: tuple[Item, ...], piece_bytes: int
              ) -> Plan | Share:
        """The job's plan on rank 0 and this rank's share elsewhere: from the
        cache while no rank's layout changes. The collector's passes over what
        rank 0 makes here come after it, as the ranks go on to stage and
        write, not while every other rank waits for the plan."""
        co, phase = self.co, self.phase
        key = [repr((v.node, v.layout)) for v in everyone] + [
            f"piece_bytes={piece_bytes}", f"union={self.union}"]
        plan = co.cache.get(key)
        if plan is None:
            # Ranks of one layout hold the same items: the first of each sends them.
            first: dict[str, int] = {}
            for r, v in enumerate(everyone):
                first.setdefault(v.layout, r)
            infos = phase.collective("plan", lambda: co.gather_bytes_from(
                described(items), sorted(first.values())))
            made: Plan | Failure | None = None
            if co.rank == 0:
                assert infos is not None
                try:
                    tables = {layout: BoxTable.received(infos[r], r) for layout, r in first.items()}
                    made = make_plan([RankInfo(r, v.node, tables[v.layout], v.layout)
                                      for r, v in enumerate(everyone)],
                                     min_piece_bytes=piece_bytes, union=self.union)
                except CheckpointError as exc:
                    made = failure(0, "plan", exc)
            # Each rank gets its share only (Plan.shares); rank 0 keeps the
            # whole plan for the manifest. A failure goes to every rank.
            shares: list[Any] | None = None
            if co.rank == 0:
                shares = [made] * co.size if isinstance(made, Failure) else (
                    made.shares() if isinstance(made, Plan) else None)
            sent = phase.collective("plan", lambda: co.scatter(shares))
            if isinstance(sent, Failure):
                phase.agree("plan", sent if co.rank == 0 else None)
            plan = made if isinstance(made, Plan) else Share.of(sent)
            co.cache.put(key, plan)
            co.plans_made += 1
        return plan

    def _settle(self, leader: bool) -> None:
        """settling.py for the target's directory. A failure there is not this
        save's: rank 0 warns of it, and the save goes on."""
        try:
            settle_with(self.co, self.target.parent, self.storage, leader, self.nodes)
        except DistributedCheckpointError as exc:
            if self.co.rank == 0:
                warnings.warn(f"{exc} (before the save of {self.target.name})",
                              RuntimeWarning, stacklevel=3)

    def _join_trees(self, stages: list[str]) -> None:
        """union=True, at every save (the non-tensor values change): rank 0
        joins the trees of the first rank of each stage (trees.py) into the
        job's; a conflict fails the save on every rank before any write."""
        co = self.co
        firsts = sorted({k: r for r, k in reversed(list(enumerate(stages)))}.values())
        trees = self.phase.collective("plan", lambda: co.gather_from(self.tree, firsts))
        error = None
        if co.rank == 0:
            assert trees is not None and isinstance(self.plan, Plan)
            order = {k: n for n, k in enumerate(self.plan.keys)}
            layouts = self.plan.layouts
            try:
                self.tree = joined([
                    (r, renumbered(trees[r], list(map(key_of, layouts[self.layouts[r]].items)),
                                   order)) for r in firsts])
            except CheckpointError as exc:
                error = failure(0, "plan", exc)
        self.phase.agree("plan", error)

    def _warn_differing_values(self, values: list[tuple[str, str]], stages: list[str]
                               ) -> None:
        """Once per process group (every rank takes this branch together): the
        values that differ between ranks of one stage (union=True; else
        between any ranks), named by rank 0."""
        co = self.co
        co.warned_values = True
        per_rank = self.phase.collective("describe", lambda: co.all_gather(values))
        if co.rank == 0:
            keys = sorted(set().union(*(
                differing_keys([v for v, k in zip(per_rank, stages, strict=True) if k == stage])
                for stage in sorted(set(stages)))))
            kept = "each stage's first rank" if self.union else "rank 0"
            warnings.warn(
                f"distributed checkpoint {self.target}: the ranks hold different values for "
                f"{len(keys)} key(s) that a job checkpoint stores once: {', '.join(keys[:8])}"
                f"{', ...' if len(keys) > 8 else ''}. It keeps {kept}'s non-tensor values and "
                "one rank's copy of each plain tensor; save per-rank values (RNG states, "
                "counters) with fastpersist.save to a path per rank. (Reported once.)",
                RuntimeWarning, stacklevel=3)

    def my_pieces(self) -> list[StoredTensor]:
        """This rank's pieces, as tensors to write (views of the live state)."""
        by_key = {h.item.key: h for h in self.held}
        stored = []
        for piece in self.mine:
            h = by_key[piece.key]
            if not within(piece, h):
                raise AssertionError(f"{piece.name}: planned from a box this rank does not hold")
            source = piece_source(h, piece)
            stored.append(StoredTensor(piece.name, piece.dtype, piece.shape, source,
                                       source.nbytes))
        return stored

    def finish(self, files: StagedFiles | BaseException) -> None:
        """Write this rank's files (or report why it has none) and commit."""
        try:
            self._finish(files)
        except RanksLost as lost:
            self.lost(lost)  # returns if the job committed anyway
            return
        self.check_in("save")

    def _finish(self, files: StagedFiles | BaseException) -> None:
        co, phase = self.co, self.phase
        self.held = []
        # 4 write this rank's pieces
        error, written = None, None
        try:
            if isinstance(files, BaseException):
                raise files
            self._raise_if_aborted()
            records = self.storage.write(self.target, self.directory, co.rank, files,
                                         self.nodes[co.rank] if self.node_local else None,
                                         self.frame_bytes)
            written = rendered(self.mine, records)
            self._raise_if_aborted()  # the last moment at which one rank can stop the job
        except Exception as exc:
            error = failure(co.rank, "write", exc)
        phase.agree("write", error)
        # From here on rank 0 may hold every record, build the manifest and
        # commit: a lost exchange no longer means that the job failed.
        self.committing = True
        # Every rank is past its writes (the write phase agreed), so nothing
        # here waits long unless a rank is lost (then up to the exchange's
        # timeout): the collector's passes over the records rank 0 gathers
        # and joins wait until the job is committed.
        with gcpause.paused():
            gathered = phase.collective("write", lambda: co.gather_bytes(
                b"" if written is None else written.sent()))
            # 5 commit (commit_point.py)
            manifest = None
            if co.rank == 0:
                assert gathered is not None
                # Every rank wrote (the write phase agreed), so every rank sent its records.
                assert isinstance(self.plan, Plan)
                manifest = job_manifest(self.plan, self.tree,
                                        [Written.received(w, r)
                                         for r, w in enumerate(gathered) if w])
            self.commit(manifest)

    def _raise_if_aborted(self) -> None:
        if self.aborted():
            raise CheckpointAbortedError(f"rank {self.co.rank} aborted the save of {self.target}")

    def after_commit(self, fn: Callable[[Path], None] | None) -> None:
        """Run fn(target) on rank 0 after the commit, and report a failure of
        the after-commit policy applied with the commit (Checkpointer: the
        `latest` pointer, retention); every rank returns when it is done, or
        raises its error. With ranks lost after the commit, it is done on rank
        0 alone and every rank returns: the checkpoint is committed either way."""
        error = None
        if self.co.rank == 0:
            try:
                if self.after_commit_error:
                    raise PostCommitError(self.after_commit_error)
                if fn is not None:
                    fn(self.target)
            except Exception as exc:
                error = failure(0, "after commit", exc)
        if self.ranks_lost:
            self._warn_after_commit(error)
            return
        try:
            self.phase.agree("after commit", error)
        except RanksLost as lost:
            verdict = post_mortem(self.store, "after", self.co.rank, self.co.size, lost.phase,
                                  lost.cause, self.processes, self.grace, self.timeout)
            warnings.warn(f"distributed checkpoint {self.target.name} was committed, but "
                          f"{verdict.describe()}", RuntimeWarning, stacklevel=2)
            self._warn_after_commit(error)
            return
        self.check_in("after")

    def _warn_after_commit(self, error: Failure | None) -> None:
        if error is not None:
            warnings.warn(f"{self.target}: {error.error} (after the commit; not raised, as the "
                          "other ranks cannot learn it)", RuntimeWarning, stacklevel=3)


__all__ = ["Save", "coordinator_for", "tensor_bytes_by_rank"]
