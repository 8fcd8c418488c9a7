"""A distributed save: every rank writes the bytes it was assigned, rank 0 commits.

    1 describe  each rank: its tensors as boxes of global tensors (describe.py)
                and a digest of that layout; all-gather (node, layout, target)
    2 plan      rank 0, only when some rank's layout changed: gather the items,
                make_plan (planner.py), broadcast; every rank caches the plan
    3 stage     the first rank of each storage domain (the job, or each node
                when files stay node-local) makes the staging directory
    4 write     each rank writes its pieces into data-rRRRRR-NNN files there,
                fsynced (itself, or through its node's daemon); gather the
                file and tensor records to rank 0
    5 commit    rank 0 builds the job manifest (schema 2) and broadcasts it;
                node-local: other nodes publish their part first, then rank 0
                publishes its own, last, so a crash before that leaves no
                checkpoint under the name on rank 0's node

All of it runs over a gloo group of its own, made once per process group, so
checkpoint traffic never queues behind (or blocks) training collectives, and
with a timeout (FASTPERSIST_DIST_TIMEOUT), so a dead or hung rank makes the
others fail instead of hanging. Every phase ends in a collective that carries
each rank's error, if any: a failure anywhere raises the same
DistributedCheckpointError on every rank, naming each failed rank and phase,
and the staging directories are removed.

Where the bytes go is a storage.Storage: written in-process, or handed to
each node's fastpersistd as parts of one job that the daemon commits.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from .. import state
from .._version import __version__
from ..errors import (
    CheckpointAbortedError,
    CheckpointError,
    DistributedCheckpointError,
    PostCommitError,
)
from ..format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    Chunk,
    FileRecord,
    GlobalTensor,
    Manifest,
    TensorRecord,
)
from ..format.names import rank_of_part_file
from ..knobs import current as current_knobs
from ..plan import StoredTensor
from ..retention import AfterCommit
from ..snapshot import StagedFile, group_into_files
from ..state import TensorLeaf
from .describe import (
    Held,
    describe,
    differing_keys,
    piece_source,
    replica_values,
    values_digest,
)
from .planner import Item, Piece, Plan, PlanCache, RankInfo, layout_digest, make_plan
from .storage import InProcess, Storage

T = TypeVar("T")


class _Coordinator:
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

    def all_gather(self, value: T) -> list[T]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def gather(self, value: T) -> list[T] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=self.ranks[0], group=self.group)
        return out

    def broadcast(self, value: T | None) -> T:
        box = [value]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.group)
        return box[0]  # type: ignore[return-value]


_coordinators: dict[Any, _Coordinator] = {}


def coordinator_for(group: dist.ProcessGroup | None) -> _Coordinator:
    key = group if group is not None else "world"
    if key not in _coordinators:
        _coordinators[key] = _Coordinator(group)
    return _coordinators[key]


@dataclass
class _Failure:
    rank: int
    phase: str
    error: str


class _Phase:
    """Runs one phase's local work, then agrees with every rank on the outcome."""

    def __init__(self, co: _Coordinator, on_failure: Callable[[], None]) -> None:
        self.co = co
        self.on_failure = on_failure

    def collective(self, phase: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # a peer died, hung, or the group broke
            self.on_failure()
            raise DistributedCheckpointError(
                f"rank {self.co.rank}: the checkpoint's {phase} exchange with the other ranks "
                f"failed ({exc}); a rank may have died or hung (FASTPERSIST_DIST_TIMEOUT="
                f"{current_knobs().dist_timeout} s)") from exc

    def agree(self, phase: str, error: _Failure | None) -> None:
        """Every rank learns every failure of this phase; all raise the same error."""
        failures = [f for f in self.collective(phase, lambda: self.co.all_gather(error)) if f]
        if failures:
            self.on_failure()
            raise DistributedCheckpointError(
                "distributed checkpoint failed: " + "; ".join(
                    f"rank {f.rank} ({f.phase}): {f.error}" for f in failures),
                {f.rank: f"{f.phase}: {f.error}" for f in failures})


def _failure(rank: int, phase: str, exc: BaseException) -> _Failure:
    if isinstance(exc, CheckpointError | OSError | ValueError | TypeError):
        return _Failure(rank, phase, f"{type(exc).__name__}: {exc}")
    return _Failure(rank, phase, "".join(traceback.format_exception_only(exc)).strip())


def tensor_bytes_by_rank(manifest: Manifest) -> dict[int, int]:
    """Tensor bytes each rank wrote into a distributed checkpoint, by rank."""
    out: dict[int, int] = {}
    for t in manifest.tensors:
        rank = rank_of_part_file(t.file)
        if rank is not None:
            out[rank] = out.get(rank, 0) + t.length
    return dict(sorted(out.items()))


def save(obj: Any, path: str | os.PathLike[str], group: dist.ProcessGroup | None, *,
         node_local: bool = False, allow_pickle: bool = False) -> None:
    """fastpersist.save(..., process_group=...) in-process: see the module docstring.

    Shared storage (default): every rank passes the same `path`, on a
    filesystem they all see. node_local=True: each rank passes its node's local
    path (ranks of one node the same); each node keeps the files its ranks
    wrote, and every node's directory carries the job manifest.
    (Through a daemon, saver.DistributedSaver stages the pieces in shared memory.)
    """
    storage = InProcess()
    job = Save(coordinator_for(group), obj, path, storage, node_local=node_local,
               allow_pickle=allow_pickle)
    job.prepare()
    try:
        files: list[StagedFile] | BaseException = [
            StagedFile(f.tensors, None)
            for f in group_into_files(job.my_pieces(), 0, current_knobs().file_bytes)]
    except Exception as exc:
        files = exc  # reported in the write phase, so that every rank fails together
    job.finish(files)


class Save:
    """One distributed save, in two halves: prepare() (describe, plan, stage:
    quick, in the caller) and finish() (write, commit: in the caller for save,
    in the background for async_save). Every rank runs both halves of its
    saves in the same order; a finish must end before the next prepare."""

    def __init__(self, co: _Coordinator, obj: Any, path: str | os.PathLike[str],
                 storage: Storage, *, node_local: bool, allow_pickle: bool,
                 aborted: Callable[[], bool] = lambda: False,
                 after_commit: AfterCommit | None = None) -> None:
        self.co = co
        # A Checkpointer's policy: applied with rank 0's publish, the job's
        # commit point (never before it: other nodes' publishes may be undone).
        self.after_commit_policy = after_commit
        self.after_commit_error = ""  # what of it failed, as the storage reported
        self.aborted = aborted  # this rank gave the save up (DistributedSaver.close(abort=True))
        self.obj = obj
        self.storage = storage
        self.node_local = node_local
        self.allow_pickle = allow_pickle
        self.knobs = current_knobs()
        self.target = Path(os.path.abspath(os.fspath(path)))
        self.staged: str | None = None  # this rank staged its domain (storage.stage)
        self.published = False
        self.phase = _Phase(co, self._clean_up)

    def _clean_up(self) -> None:
        """After a failure. Its own errors are warned about, not raised: every
        rank must raise the job's one error."""
        try:
            if self.staged is not None and not self.published:
                self.storage.abort(self.staged)
            elif self.staged is not None and self.published and self.co.rank != 0:
                # node-local: the job failed after this node published
                self.storage.unpublish(self.target)
        except Exception as exc:
            warnings.warn(f"rank {self.co.rank}: cleaning up the failed save of {self.target} "
                          f"failed too: {exc}", RuntimeWarning, stacklevel=2)

    def prepare(self) -> None:
        co, phase, knobs = self.co, self.phase, self.knobs
        # 1 describe
        error = None
        self.held: list[Held] = []
        items: tuple[Item, ...] = ()
        values: list[tuple[str, str]] = []
        try:
            tree, leaves = state.encode(self.obj, allow_pickle=self.allow_pickle, sharded=True)
            self.tree = tree
            self.held = describe(_unaliased(leaves))
            items = tuple(h.item for h in self.held)
            values = replica_values(self.obj)
            me = _RankView(knobs.node, layout_digest(items), str(self.target),
                           values_digest(values))
        except Exception as exc:
            error = _failure(co.rank, "describe", exc)
            me = _RankView(knobs.node, "", str(self.target), "")
        self.obj = None  # the tensors live on in self.held; the rest is in the tree
        phase.agree("describe", error)
        everyone = phase.collective("describe", lambda: co.all_gather(me))
        self.nodes = [v.node for v in everyone]
        domain = _domains(everyone, self.node_local)
        _check_targets(everyone, domain, phase)
        if len({v.values for v in everyone}) > 1 and not co.warned_values:
            self._warn_differing_values(values)

        # 2 plan (cached while no rank's layout changes)
        key = [repr((v.node, v.layout)) for v in everyone] + [
            f"piece_bytes={knobs.piece_bytes}"]
        plan = co.cache.get(key)
        if plan is None:
            infos = phase.collective("plan", lambda: co.gather(items))
            made: Plan | _Failure | None = None
            if co.rank == 0:
                assert infos is not None
                try:
                    made = make_plan([RankInfo(r, v.node, tuple(infos[r]), v.layout)
                                      for r, v in enumerate(everyone)],
                                     min_piece_bytes=knobs.piece_bytes)
                except CheckpointError as exc:
                    made = _failure(0, "plan", exc)
            result = phase.collective("plan", lambda: co.broadcast(made))
            if isinstance(result, _Failure):
                phase.agree("plan", result if co.rank == 0 else None)
            assert isinstance(result, Plan)
            plan = result
            co.cache.put(key, plan)
            co.plans_made += 1
        self.plan = plan

        # 3 stage: the first rank of each domain makes the directory
        leaders = {d: min(r for r in range(co.size) if domain[r] == d) for d in set(domain)}
        error, made_path = None, ""
        if leaders[domain[co.rank]] == co.rank:
            try:
                self.staged = made_path = self.storage.stage(self.target)
            except Exception as exc:
                error = _failure(co.rank, "stage", exc)
        phase.agree("stage", error)
        paths = phase.collective("stage", lambda: co.all_gather(made_path))
        self.directory = paths[leaders[domain[co.rank]]]

    def _warn_differing_values(self, values: list[tuple[str, str]]) -> None:
        """Once per process group (every rank takes this branch together): the
        values that differ, named by rank 0."""
        co = self.co
        co.warned_values = True
        per_rank = self.phase.collective("describe", lambda: co.all_gather(values))
        if co.rank == 0:
            keys = differing_keys(per_rank)
            warnings.warn(
                f"distributed checkpoint {self.target}: the ranks hold different values for "
                f"{len(keys)} key(s) that a job checkpoint stores once: {', '.join(keys[:8])}"
                f"{', ...' if len(keys) > 8 else ''}. It keeps rank 0's non-tensor values and "
                "one rank's copy of each plain tensor; save per-rank values (RNG states, "
                "counters) with fastpersist.save to a path per rank. (Reported once.)",
                RuntimeWarning, stacklevel=3)

    def my_pieces(self) -> list[StoredTensor]:
        """This rank's pieces, as tensors to write (views of the live state)."""
        by_key = {h.item.key: h for h in self.held}
        stored = []
        for piece in self.plan.for_rank(self.co.rank):
            h = by_key[piece.key]
            if not _within(piece, h):
                raise AssertionError(f"{piece.name}: planned from a box this rank does not hold")
            stored.append(StoredTensor(piece.name, piece.dtype, piece.shape,
                                       piece_source(h, piece)))
        return stored

    def finish(self, files: list[StagedFile] | BaseException) -> None:
        """Write this rank's files (or report why it has none) and commit."""
        co, phase = self.co, self.phase
        self.held = []
        # 4 write this rank's pieces
        error, written = None, None
        try:
            if isinstance(files, BaseException):
                raise files
            self._raise_if_aborted()
            written = self.storage.write(self.target, self.directory, co.rank, files,
                                         self.nodes[co.rank] if self.node_local else None)
            self._raise_if_aborted()  # the last moment at which one rank can stop the job
        except Exception as exc:
            error = _failure(co.rank, "write", exc)
        phase.agree("write", error)
        gathered = phase.collective("write", lambda: co.gather(written))

        # 5 commit
        manifest: bytes | None = None
        if co.rank == 0:
            assert gathered is not None
            manifest = _manifest(self.plan, self.tree, gathered)
        manifest = phase.collective("commit", lambda: co.broadcast(manifest))
        assert manifest is not None
        # Other domains publish first; rank 0's domain publishes last: the commit point.
        phase.agree("commit", self._publish(manifest) if co.rank != 0 else None)
        # Returns only once the checkpoint is durable everywhere (or raises everywhere).
        phase.agree("commit", self._publish(manifest) if co.rank == 0 else None)

    def _raise_if_aborted(self) -> None:
        if self.aborted():
            raise CheckpointAbortedError(f"rank {self.co.rank} aborted the save of {self.target}")

    def _publish(self, manifest: bytes) -> _Failure | None:
        """Commit this domain's staging directory, if this rank made it."""
        if self.staged is None:
            return None
        try:
            self.after_commit_error = self.storage.publish(
                self.staged, manifest, self.nodes[self.co.rank] if self.node_local else None,
                self.after_commit_policy if self.co.rank == 0 else None)
        except Exception as exc:
            return _failure(self.co.rank, "commit", exc)
        self.published = True
        return None

    def after_commit(self, fn: Callable[[Path], None] | None) -> None:
        """Run fn(target) on rank 0 after the commit, and report a failure of
        the after-commit policy applied with the commit (Checkpointer: the
        `latest` pointer, retention); every rank returns when it is done, or
        raises its error."""
        error = None
        if self.co.rank == 0:
            try:
                if self.after_commit_error:
                    raise PostCommitError(self.after_commit_error)
                if fn is not None:
                    fn(self.target)
            except Exception as exc:
                error = _failure(0, "after commit", exc)
        self.phase.agree("after commit", error)


def _unaliased(leaves: list[TensorLeaf]) -> list[TensorLeaf]:
    """Number the tree's tensors (node["e"]); a tensor that appears under several
    keys (tied weights) is stored once, under its first key, and every key
    refers to it, so load gives back one tensor. (Different views of one
    storage are stored separately, each its own bytes.)"""
    first: dict[tuple[Any, ...], int] = {}
    unique: list[TensorLeaf] = []
    for leaf in leaves:
        t = leaf.tensor
        same = None if leaf.node.get("sharded") or t.numel() == 0 else (
            str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if same is not None and same in first:
            leaf.node["e"] = first[same]
            continue
        leaf.node["e"] = len(unique)
        if same is not None:
            first[same] = len(unique)
        unique.append(leaf)
    return unique


class _RankView(NamedTuple):
    """What each rank tells all the others in the describe phase."""

    node: str
    layout: str  # planner.layout_digest of its items
    target: str  # the checkpoint path it saves to
    values: str  # describe.values_digest of the values saved once for the job


def _domains(everyone: list[_RankView], node_local: bool) -> list[str]:
    """Storage domain of each rank: its node's disk, or the one shared filesystem."""
    return [v.node if node_local else "shared" for v in everyone]


def _check_targets(everyone: list[_RankView], domain: list[str],
                   phase: _Phase) -> None:
    """Ranks that share storage must name the same checkpoint directory."""
    first: dict[str, tuple[int, str]] = {}
    for r, target in enumerate(v.target for v in everyone):
        d = domain[r]
        if d in first and first[d][1] != target:
            other, path = first[d]
            msg = (f"rank {r} saves to {target} but rank {other}, which shares its storage "
                   f"({'node ' + d if d != 'shared' else 'shared filesystem'}), saves to {path}")
            phase.on_failure()
            raise DistributedCheckpointError(f"distributed checkpoint failed: {msg}",
                                             {r: f"describe: {msg}"})
        first.setdefault(d, (r, target))


def _within(piece: Piece, held: Held) -> bool:
    """Pieces are row ranges of the box a writer holds."""
    item = held.item
    if not piece.shape:
        return not item.shape
    return (item.offsets[0] <= piece.offsets[0]
            and piece.offsets[0] + piece.shape[0] <= item.offsets[0] + item.shape[0]
            and piece.offsets[1:] == item.offsets[1:] and piece.shape[1:] == item.shape[1:])


def _manifest(plan: Plan, tree: Any, gathered: list[Any]) -> bytes:
    files: list[FileRecord] = []
    records: list[TensorRecord] = []
    index_of: dict[str, int] = {}
    for per_rank in gathered:
        for record, tensors in per_rank:
            files.append(record)
            for t in tensors:
                index_of[t.name] = len(records)
                records.append(t)
    chunks: dict[str, list[Chunk]] = {k: [] for k in plan.keys}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for piece in plan.pieces:
        chunks[piece.key].append(Chunk(index_of[piece.name], piece.offsets))
        meta[piece.key] = (piece.dtype, piece.global_shape)
    globals_ = tuple(GlobalTensor(k, meta[k][0], meta[k][1], tuple(chunks[k])) for k in plan.keys)
    return Manifest(files=tuple(files), tensors=tuple(records), tree=tree,
                    fastpersist_version=__version__, created_unix=time.time(),
                    schema_version=DISTRIBUTED_SCHEMA_VERSION, globals=globals_).to_json()



__all__ = ["Save", "coordinator_for", "save", "tensor_bytes_by_rank"]
