"""Checkpointer("s3://BUCKET/PREFIX"): a training loop's checkpoints saved
straight to an object store, no local disk (Checkpointer() returns one of
these for an s3:// root).

    ckpt = fastpersist.Checkpointer("s3://bucket/run1", keep_last=3)
    start = ckpt.load_latest()["step"] + 1 if ckpt.latest() else 0

Checkpoints are PREFIX/step-NNNNNNNN, each saved by the store sink
(saving/store_sink.py: multipart from the staging memory, the manifest last
with a conditional put); a save's future resolves when that put returned.
After each commit, in the writer thread, retention runs in the store
(saving/store_retention.py: keep_last and keep_every as locally, manifests
deleted first so no reader sees half a step; leftovers of killed saves of
older steps removed). There is no `latest` object: latest() lists the store
and returns the newest step whose manifest reads and whose objects have the
sizes it names, passing over others with a warning (strict=True: raises).

The credentials and endpoint are the standard AWS configuration
(AWS_ENDPOINT_URL for an S3-compatible store). Not with a daemon, a
distributed job, a tier (the root is the store), the cadences or
compression: each raises ValueError saying so. One writer per prefix.
"""

from __future__ import annotations

from typing import Any

from .api import load, pipeline_for
from .checkpointer_base import CheckpointerBase
from .errors import CorruptCheckpointError, StoreURLError
from .resume import Judge, Skipped, not_found, refuse_existing
from .saving.futures import SaveFuture
from .storage.retention import AfterCommit
from .tensors.factory import MapLocation
from .tier.client import S3, client_for
from .tier.listing import entries
from .tier.remote import object_sizes, read_manifest
from .tier.url import TierURL

_REFUSED = {"daemon": "fastpersistd saves to a filesystem: give it --tier",
            "process_group": "a distributed job saves to a shared filesystem: use tier=",
            "union": "a distributed job saves to a shared filesystem: use tier=",
            "tier": "the root is in the store already",
            "tier_keep_last": "keep_last applies in the store",
            "tier_endpoint": "set AWS_ENDPOINT_URL",
            "compression": "checkpoints go to the store raw",
            **dict.fromkeys(("memory_every", "disk_every", "tier_every"),
                            "cadences need fastpersistd"),
            **dict.fromkeys(("keep_best", "best_metric"),
                            "keep-best retention is not kept in a store yet (keep_last, "
                            "keep_every are)")}


class StoreCheckpointer(CheckpointerBase):
    """Checkpointer's interface over checkpoints in a store; see the module
    docstring and Checkpointer for each method."""

    def __init__(self, root: str, *, keep_last: int | None = None,
                 keep_every: int | None = None, max_in_flight: int = 1,
                 allow_pickle: bool = False, strict: bool = False,
                 tier_compression: str = "zstd", save_every: int | None = None,
                 best_mode: str = "min", **others: Any) -> None:
        given = {k: v for k, v in others.items() if v not in (None, "")}
        for name, value in given.items():
            if name not in _REFUSED:
                raise TypeError(f"Checkpointer() got an unexpected keyword argument {name!r}")
            raise ValueError(f"Checkpointer({root!r}, {name}={value!r}): a root in an object "
                             f"store saves there from this process; {_REFUSED[name]}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be at least 1")
        if save_every is not None and (isinstance(save_every, bool)
                                       or not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a whole number of steps >= 1 (or None), "
                             f"not {save_every!r}")
        self.save_every = save_every
        self._saved: set[int] | None = None  # should_save's: listed once, then kept
        try:
            self.url = TierURL.parse(root)
        except ValueError as exc:
            raise StoreURLError(f"{exc}, as a Checkpointer's root") from None
        self.root = str(self.url)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.after_commit = AfterCommit(False, keep_last, keep_every)
        self.allow_pickle, self.strict = allow_pickle, strict
        self._skipped: list[Skipped] = []
        self._saving: dict[int, SaveFuture] = {}
        self._pipeline = pipeline_for(store=True, max_in_flight=max_in_flight, shared=False)

    @property
    def _s3(self) -> S3:
        return client_for(None)  # the sink's: the standard AWS configuration

    def path_for(self, step: int) -> str:
        return str(self.url.child(f"step-{step:08d}"))

    def save(self, step: int, state: Any, *, wait_for_snapshot: bool = True,
             overwrite: bool = False, durability: str | None = None) -> SaveFuture:
        """Start an asynchronous checkpoint of `state` for `step` (Checkpointer.save);
        its future resolves once the manifest's conditional put returned."""
        if step < 0:
            raise ValueError("step must be >= 0")
        if durability not in (None, "disk"):
            raise ValueError(f"durability={durability!r}: a checkpoint in a store is saved "
                             "there (memory-only saves are fastpersistd's)")
        if not overwrite:
            refuse_existing(step, self.path_for(step) if step in self.steps() else None,
                            self._saving.get(step), self.path_for(step))
        future = self._pipeline.save(state, self.path_for(step), allow_pickle=self.allow_pickle,
                                     wait_for_snapshot=wait_for_snapshot,
                                     after_commit=self.after_commit)
        self._saving = {s: f for s, f in self._saving.items() if not f.done()}
        self._saving[step] = future
        if self._saved is not None:
            self._saved.add(step)
        return future

    def should_save(self, step: int) -> bool:
        """Checkpointer.should_save: `step` is on save_every's interval (every
        step without one) and not saved yet, in the store or by this one."""
        if self.save_every is not None and step % self.save_every:
            return False
        if self._saved is None:  # one listing of the store, not one per step
            self._saved = set(self.steps()) | set(self._saving)
        return step not in self._saved

    def close(self, *, abort: bool = False) -> None:
        """Finish the in-flight save (abort=True: abandon it; its upload is
        aborted, nothing becomes visible) and free the staging memory."""
        self._pipeline.close(abort=abort)

    def steps(self) -> list[int]:
        """Steps of the checkpoints committed under the root (manifest put), ascending."""
        return sorted(e.step for e in entries(self._s3, self.url)
                      if e.committed and e.step is not None)

    def memory_steps(self) -> list[int]:
        return []

    def tier_status(self) -> None:
        return None  # no tier: the root is the store

    def wait_for_tier(self, timeout: float | None = None) -> bool:
        self._pipeline.wait()
        return True

    @property
    def skipped(self) -> list[Skipped]:
        return list(self._skipped)

    def _problem(self, url: str) -> str | None:
        """Why the checkpoint at `url` cannot be used, or None."""
        target = TierURL.parse(url)
        try:
            manifest, _ = read_manifest(self._s3, target)
            sizes = object_sizes(self._s3, target)
        except CorruptCheckpointError as exc:
            return str(exc)
        wrong = [f"{f.name} is {sizes.get(f.name, 'missing')} bytes, not {f.size}"
                 for f in manifest.files if sizes.get(f.name) != f.size]
        return "; ".join(wrong) or None

    def _latest(self, judge: Judge, exclude: set[str]) -> str | None:
        for step in reversed(self.steps()):
            url = self.path_for(step)
            if url in exclude:
                continue
            reason = self._problem(url)
            if reason is None:
                return url
            judge.skip(url, reason)
            exclude.add(url)
        return None

    def latest(self) -> str | None:
        """The s3:// URL of the newest usable checkpoint, or None."""
        judge = Judge(self.strict)
        try:
            return self._latest(judge, set())
        finally:
            self._skipped = judge.skipped

    def load_latest(self, map_location: MapLocation = None, **kwargs: Any) -> Any:
        """Load latest(); one whose load finds it corrupt is passed over (strict: raises)."""
        judge = Judge(self.strict)
        tried: set[str] = set()
        try:
            while True:
                url = self._latest(judge, tried)
                if url is None:
                    raise not_found(self.root, judge.skipped)
                try:
                    return load(url, map_location, allow_pickle=self.allow_pickle, **kwargs)
                except CorruptCheckpointError as exc:
                    judge.skip(url, str(exc), exc)
                    tried.add(url)
        finally:
            self._skipped = judge.skipped


__all__ = ["StoreCheckpointer"]
