"""Checkpointer: asynchronous checkpoints of a training loop, with retention.

    ckpt = fastpersist.Checkpointer("ckpts", keep_last=3, keep_every=1000)
    start = ckpt.load_latest()["step"] + 1 if ckpt.latest() else 0
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                             "step": step})
    ckpt.close()

Checkpoints are ROOT/step-NNNNNNNN. After each one is durable, and only then,
ROOT/latest is updated (atomically) to name it, for tools and people, and
retention deletes the checkpoints that are neither among the newest keep_last
nor a multiple of keep_every (retention.py has the rules). A crash at any
moment leaves `latest` naming a complete checkpoint. A step is saved once:
save() of a step that exists raises CheckpointExistsError unless
overwrite=True. latest() and load_latest() pass over a newer checkpoint that
cannot be used only with a warning, recorded in `skipped` (resume.py), or
with strict=True not at all: they raise.

Who does it: in-process, the writer thread after each commit. Through a
daemon, which owns everything under its --root (the trainer needs read access
only), the policy travels with each commit and the daemon applies it before it
reports the checkpoint committed, even if the trainer died after the hand-over.
Either way a failure there fails the save's future with PostCommitError: the
checkpoint itself is committed.

With tier="s3://BUCKET/PREFIX", each checkpoint is also copied to the object
store, ROOT/step-N to PREFIX/step-N, by a background thread (tier/uploader.py)
once it is committed locally: the save's future resolves at local durability
and the trainer never waits for the upload. Until its upload has finished a
checkpoint is the only copy, and local retention keeps it; tier_keep_last is
retention in the store. Failed uploads are retried with backoff, logged
(logger `fastpersist.tier`) and shown by tier_status(); close() waits for the
uploads (a few more tries each) and raises TierError naming what is not
uploaded. Checkpoints committed but not uploaded when the process died are
uploaded by the next Checkpointer on the same root and tier. In a distributed
job (process_group) rank 0 does all of this, from the shared root.

Cadences (cadence.py): memory_every, disk_every, tier_every; should_save().
latest() and load_latest() pick the newest step of the memory-only and disk
checkpoints. keep_best and metrics= (keep_best.py): keep the best by a metric.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .api import load, load_from_tier, pipeline_for
from .cadence import MEMORY, Cadence, load_memory_only, memory_steps
from .checkpointer_base import CheckpointerBase
from .errors import (
    CorruptCheckpointError,
    MemoryTierError,
    PostCommitError,
    TierError,
)
from .keep_best import Metrics
from .knobs import current as current_knobs
from .resume import (
    Judge,
    Skipped,
    newest_anywhere,
    newest_local,
    not_found,
    problem,
    refuse_existing,
    step_dirs,
)
from .saving.futures import SaveFuture
from .storage.local_path import checkpoint_path
from .storage.retention import AfterCommit, apply_at, step_of
from .tensors import packed
from .tensors.factory import MapLocation
from .tier.url import is_tier_url

if TYPE_CHECKING:
    from .tier.mirror import Mirror
    from .tier.upload import Uploaded
    from .tier.uploader import Job, TierStatus


class Checkpointer(CheckpointerBase):
    """Asynchronous, retained checkpoints under `root`; see the module docstring.

    keep_last: keep this many newest checkpoints (None: keep all).
    keep_every: also keep every checkpoint whose step is a multiple of this.
    max_in_flight: saves persisting at once; the next save() waits for room
        (backpressure), so staging memory is at most max_in_flight snapshots.
    daemon: save through fastpersistd at this address (None: FASTPERSIST_DAEMON
        if set; "": in-process). `root` must lie under the daemon's --root.
    process_group: a torch.distributed job (call save() on every rank; `root`
        on storage they all see): distributed saves, each unique byte written
        once; whoever commits the job (rank 0, or its daemon) moves `latest`
        and applies retention. union=True: ranks may hold different tensors
        (pipeline stages), as in fastpersist.save.
    tier: "s3://BUCKET/PREFIX": copy each checkpoint there in the background
        (see the module docstring). Not through fastpersistd: give the daemon
        the tier (fastpersistd --tier). With process_group, rank 0 uploads
        (every rank's files are on the shared storage) and applies retention;
        its tier_status()/wait_for_tier() tell of the uploads, the other
        ranks' report nothing pending; every rank's latest()/load_latest()
        falls back to the store.
    tier_keep_last: keep this many newest checkpoints in the store (None: all).
    tier_endpoint: the store's endpoint URL (default: the standard AWS
        configuration, e.g. AWS_ENDPOINT_URL).
    tier_compression: "zstd" (default): a raw checkpoint is compressed on its
        way to the store (the local one stays raw); "none": uploaded as it is.
        A checkpoint saved with compression="zstd" is uploaded as it is.
    compression: "zstd" to compress each checkpoint (fastpersist.save), in
        this process, on each rank, or in the daemon.
    strict: latest() and load_latest() raise CorruptCheckpointError when the
        newest checkpoint cannot be used (a manifest unreadable, a data file
        missing or short, a checksum mismatch), instead of falling back to an
        older one with a warning (logger fastpersist.checkpointer) and a
        record in `skipped`.
    memory_every, disk_every, tier_every: the cadences (cadence.py): steps
        kept in fastpersistd's memory only, written to disk, and uploaded.
    save_every: should_save()'s interval, without memory_every/disk_every.
    keep_best, best_metric, best_mode ("min"/"max"): also keep the keep_best
        checkpoints with the best metrics=[best_metric] (keep_best.py).
    """

    def __new__(cls, root: str | os.PathLike[str], **kwargs: Any) -> Any:
        if cls is Checkpointer and is_tier_url(root):  # saved straight to the store
            from .store_checkpointer import StoreCheckpointer
            return StoreCheckpointer(str(root), **kwargs)
        return super().__new__(cls)

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_every: int | None = None, max_in_flight: int = 1,
                 allow_pickle: bool = False, daemon: str | None = None,
                 process_group: Any = None, tier: str | None = None,
                 tier_keep_last: int | None = None,
                 tier_endpoint: str | None = None, compression: str | None = None,
                 tier_compression: str = "zstd", strict: bool = False,
                 memory_every: int | None = None, disk_every: int | None = None,
                 tier_every: int | None = None, save_every: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", union: bool = False) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be at least 1")
        self.root = checkpoint_path(root, "a Checkpointer's root")
        self.keep_last = keep_last
        self.keep_every = keep_every
        # keep_best alone keeps the newest checkpoint too (keep_last=1).
        self.after_commit = AfterCommit(True, keep_last or (keep_best and 1), keep_every)
        self.allow_pickle = allow_pickle
        self.strict = strict
        self._skipped: list[Skipped] = []
        self._saving: dict[int, SaveFuture] = {}  # steps whose save may be in flight
        address = current_knobs().daemon if daemon is None else daemon
        self._daemon = address  # load_latest reads its memory copies (api.load)
        self.cadence = Cadence(memory_every, disk_every, tier_every, save_every)
        self.cadence.check(daemon=bool(address), distributed=process_group is not None,
                           tier=tier is not None)
        self.metrics = Metrics.create(self.root, keep_best, best_metric, best_mode,
                                      daemon=bool(address))
        self._saved: set[int] | None = None  # should_save's steps saved, once it is asked
        self.compression = packed.check_compression(compression)
        self._mirror: Mirror | None = None
        self._last_committed: str | None = None
        if tier is not None and address:
            raise ValueError("tier= uploads what this process commits; with fastpersistd "
                             "give the daemon the tier (fastpersistd --tier)")
        self._pipeline = pipeline_for(address, process_group, max_in_flight=max_in_flight,
                                      shared=False, union=union)
        self.metrics.writes = self._pipeline.sink.leader  # rank 0 records, applies retention
        if tier is not None:
            # In a distributed job, rank 0 uploads (every rank's files are on
            # the shared storage); the others serve latest() from the store.
            self._mirror = self._start_tier(tier, tier_keep_last, tier_endpoint,
                                            tier_compression, uploads=self._pipeline.sink.leader)
        self._lock = threading.Lock()  # latest pointer and retention

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def save(self, step: int, state: Any, *, wait_for_snapshot: bool = True,
             overwrite: bool = False, durability: str | None = None,
             metrics: Mapping[str, Any] | None = None) -> SaveFuture:
        """Start an asynchronous checkpoint of `state` for `step`.

        Returns once the snapshot is taken (see fastpersist.async_save); raises
        an earlier save's failure if nobody has looked at it yet. A step that
        is already saved (or being saved) raises CheckpointExistsError, before
        anything is copied: a loop that resumed from step N starts at N + 1.
        overwrite=True replaces it instead (atomically, as fastpersist.save).
        Where it goes (disk, or fastpersistd's memory only) is the cadences'
        choice, or `durability`'s ("disk" or "memory"). The future of a
        memory-only save resolves once the daemon holds the whole copy;
        steps saved in memory only are not checked for existing. metrics: numbers
        by name, recorded for keep_best (keep_best.py) before the save begins.
        """
        if step < 0:
            raise ValueError("step must be >= 0")
        where = self.cadence.durability(step, durability)
        if not overwrite:
            existing = [e for s, e in step_dirs(self.root) if s == step]
            refuse_existing(step, existing[0] if existing else None, self._saving.get(step),
                            self.path_for(step))
        self.metrics.record(step, metrics, disk=where != MEMORY, in_flight=self._saving)
        if where == MEMORY:  # no `latest`, retention or upload: those are the disk's
            future = self._pipeline.save(state, self.path_for(step), durability=MEMORY,
                                         allow_pickle=self.allow_pickle,
                                         wait_for_snapshot=wait_for_snapshot)
        else:
            future = self._save(step, state, wait_for_snapshot)
        self._saving = {s: f for s, f in self._saving.items() if not f.done()}
        self._saving[step] = future
        if self._saved is not None:
            self._saved.add(step)
        return future

    def should_save(self, step: int) -> bool:
        """Whether to save `step`: it is on the interval (save_every, or either
        cadence: cadence.py) and not saved yet (under the root, in fastpersistd's
        memory, or by this Checkpointer), so that save() would take it."""
        if not self.cadence.due(step):
            return False
        if self._saved is None:
            self._saved = ({s for s, _ in step_dirs(self.root)} | set(self.memory_steps())
                           | set(self._saving))
        return step not in self._saved

    def _save(self, step: int, state: Any, wait_for_snapshot: bool) -> SaveFuture:
        if self._mirror is None and not self.metrics.keep_best:  # whoever commits applies it
            return self._pipeline.save(state, self.path_for(step), allow_pickle=self.allow_pickle,
                                       wait_for_snapshot=wait_for_snapshot,
                                       after_commit=self.after_commit if self.cadence.uploads(
                                           step) else replace(self.after_commit, upload=False),
                                       compression=self.compression)
        # With a tier, this process (rank 0) applies it: retention must keep
        # what is not in the store yet (_committed).
        return self._pipeline.save(state, self.path_for(step), allow_pickle=self.allow_pickle,
                                   wait_for_snapshot=wait_for_snapshot,
                                   on_commit=self._committed, compression=self.compression)

    def close(self, *, abort: bool = False) -> None:
        """Finish the in-flight save (or with abort=True abandon it cleanly) and
        free the staging memory; raises a save failure nobody looked at. From a
        SIGTERM handler: set a flag there and call close() from the loop.
        With a tier, then wait for the uploads (abort=True: stop them; they
        resume with the next Checkpointer) and raise TierError naming the
        checkpoints still not uploaded."""
        left: list[str] = []
        try:
            self._pipeline.close(abort=abort)
        finally:  # the uploads stop (or drain) whether or not the save failed
            if self._mirror is not None:
                left = self._mirror.uploader.close(drain=not abort)
        if left and not abort and self._mirror is not None:
            raise TierError(
                f"not uploaded to {self._mirror.url} (the local copies are kept, and the next "
                f"Checkpointer uploads them): {', '.join(left)}; last error: "
                f"{self._mirror.status().last_error}")

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints under root that look whole (a
        valid manifest, every data file at its size), ascending."""
        return [step for step, entry in step_dirs(self.root) if problem(entry) is None]

    def memory_steps(self) -> list[int]:
        """Steps of the memory-only checkpoints that fastpersistd holds in the
        root now, ascending ([] without memory_every, or if it cannot say)."""
        return memory_steps(self._daemon, self.root) if self.cadence.memory_every else []

    @property
    def skipped(self) -> list[Skipped]:
        """The checkpoints that the last latest() or load_latest() passed over
        (newer than its answer, and unusable), each with the reason."""
        return list(self._skipped)

    def latest(self) -> Path | str | None:
        """The newest durable checkpoint, or None if there is none yet. With a
        tier, when no committed checkpoint is left under the root (a new
        node), or when the step that ROOT/latest names is gone from here but
        is in the store, that one in the store: its s3:// URL (load_latest and
        fastpersist.load take either). load_latest reads a local checkpoint
        that fails its checks from the store's copy, with a warning. A newer
        checkpoint that cannot be used is passed over with a warning and
        recorded in `skipped` (strict=True: CorruptCheckpointError).
        """
        judge = Judge(self.strict)
        try:
            return self._latest(judge, set())
        finally:
            self._skipped = judge.skipped

    def _latest(self, judge: Judge, exclude: set[Path | str]) -> Path | str | None:
        local = newest_local(self.root, judge.usable, exclude)
        newer = [s for s in self.memory_steps() if self.path_for(s) not in exclude
                 and (local is None or s > (step_of(local.name) or -1))]
        if newer:  # memory-only, newer than any usable disk checkpoint
            return self.path_for(newer[-1])
        mirror = (self._mirror.s3, self._mirror.url) if self._mirror is not None else None
        return newest_anywhere(self.root, local, exclude, mirror, self._daemon)

    def load_latest(self, map_location: MapLocation = None, **kwargs: Any) -> Any:
        """Load latest(). A checkpoint whose load finds it corrupt (a checksum
        mismatch, a short file) is passed over as latest() passes over one, and
        the next older one is loaded; strict=True raises instead. Other errors
        (a pickle not allowed, into= not matching) are raised as they are."""
        judge = Judge(self.strict)
        tried: set[Path | str] = set()
        try:
            while True:
                path = self._latest(judge, tried)
                if path is None:
                    where = f" or in {self._mirror.url}" if self._mirror is not None else ""
                    raise not_found(self.root, judge.skipped, where)
                try:
                    return self._load(path, map_location, kwargs)
                except (CorruptCheckpointError, MemoryTierError) as exc:
                    judge.skip(path, str(exc), exc)
                    tried.add(path)
        finally:
            self._skipped = judge.skipped

    def _load(self, path: Path | str, map_location: MapLocation, kwargs: dict[str, Any]) -> Any:
        if isinstance(path, str):  # the store's (latest() says when)
            endpoint = self._mirror.s3.endpoint_url if self._mirror is not None else None
            return load_from_tier(path, map_location, allow_pickle=self.allow_pickle,
                                  endpoint_url=endpoint, **kwargs)
        if self.cadence.memory_every and step_of(Path(path).name) in self.memory_steps():
            return load_memory_only(self._daemon, Path(path), map_location,
                                    {"allow_pickle": self.allow_pickle, **kwargs})
        if self._mirror is not None:  # the store's copy behind a corrupt local one
            kwargs = {"tier": str(self._mirror.url.child(Path(path).name)), **kwargs}
        return load(path, map_location, allow_pickle=self.allow_pickle,
                    **{"daemon": self._daemon, **kwargs})

    # -- the object-store tier ---------------------------------------------

    def _start_tier(self, tier: str, keep_last: int | None, endpoint: str | None,
                    compression: str, *, uploads: bool = True) -> Mirror:
        """The mirror of the root in the store; it uploads only where `uploads`
        (elsewhere it serves latest() and load_latest() from the store)."""
        from .tier.client import client_for
        from .tier.mirror import Mirror
        from .tier.url import TierURL

        mirror = Mirror(self.root, TierURL.parse(tier), client_for(endpoint),
                        keep_last=keep_last, on_uploaded=self._uploaded,
                        compression=compression, uploads=self.cadence.uploads)
        return mirror.start() if uploads else mirror

    def tier_status(self) -> TierStatus | None:
        """The uploads: pending, failing, the last error (None without a tier)."""
        return self._mirror.status() if self._mirror is not None else None

    def wait_for_tier(self, timeout: float | None = None) -> bool:
        """Wait until every checkpoint committed so far is in the store (failed
        uploads keep being retried meanwhile); False on timeout."""
        self._pipeline.wait()
        return self._mirror is None or self._mirror.uploader.wait(timeout)

    def _protected(self, name: str) -> bool:
        return self._mirror is not None and self._mirror.is_pending(name)

    def _protector(self) -> Callable[[str], bool]:
        """Retention's `protected`: pending uploads and the best (keep_best)."""
        best = frozenset(p.name for p in self.metrics.best())
        return lambda name: name in best or self._protected(name)

    def _uploaded(self, job: Job, done: Uploaded) -> None:
        """On the uploader's thread: what retention kept for the upload may go now."""
        if self.after_commit.keep_last is None:
            return
        with self._lock:
            newest = self._last_committed
            if newest is None:
                return
            try:
                apply_at(self.root, newest, replace(self.after_commit, point_latest=False),
                         protected=self._protector())
            except PostCommitError as exc:
                warnings.warn(f"retention after an upload failed: {exc}", RuntimeWarning,
                              stacklevel=1)

    # -- runs on the writer thread after a commit (in-process; rank 0 of a
    # -- distributed job with a tier) -----------------------------------------

    def _committed(self, path: Path) -> None:
        with self._lock:
            if self._mirror is not None and self._mirror.due(path.name):
                self._mirror.add(path)  # pending from now: retention keeps it
            self._last_committed = path.name
            apply_at(self.root, path.name, self.after_commit, protected=self._protector())
