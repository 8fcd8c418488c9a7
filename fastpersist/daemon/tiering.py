"""fastpersistd --tier s3://BUCKET/PREFIX: committed checkpoints copied to a store.

ROOT/REL goes to PREFIX/REL. After the daemon commits a checkpoint (a save,
or a distributed job it publishes), it queues it with the tier's uploader
(tier/uploader.py), whose thread uploads it; nothing waits for that. The
queue is the disk: at start the daemon walks its root and queues every
committed checkpoint (one that the store holds already costs a GET), so a
daemon restarted after a crash or SIGKILL uploads what was left. Local
retention (after_commit.py) keeps a checkpoint until it is uploaded;
--tier-keep-last is retention in the store, per directory of step-N
checkpoints. Every upload, failure, retry and skip is a log line, counted in
the metrics and shown by Info (`fpctl daemon status`).

The daemon accepts only paths the tier can name (paths.py, at Begin). A
checkpoint found at start under a name it cannot (left by an older daemon,
or put there by hand) is logged (`tier-unnameable`) and counted, and the
walk goes on: one odd name never keeps the others from being queued.

Everything local is opened beneath the root held open, by descriptor
(rootfs.Root.open_dir), never by a path string; data files are read through
their descriptors.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from ..errors import TierError
from ..format.manifest import MANIFEST_NAME
from ..storage.names import path_problem
from ..storage.retention import step_of
from ..tier.client import S3
from ..tier.uploader import Job, TierStatus, Uploader
from ..tier.url import TierURL
from . import logs
from .metrics import Metrics
from .paths import PathError
from .rootfs import Root

_RESULTS = {"tier-uploaded": None, "tier-upload-failed": "failed",
            "tier-upload-dropped": "dropped", "tier-upload-skipped": "skipped",
            "tier-upload-corrupt": "corrupt", "tier-unnameable": "unnameable"}


class DaemonTier:
    def __init__(self, root: Root, url: TierURL, s3: S3, metrics: Metrics, *,
                 keep_last: int | None = None, compression: str | None = "zstd") -> None:
        self.root, self.url, self.metrics = root, url, metrics
        self.uploader = Uploader(s3, url, keep_last=keep_last, events=self._event,
                                 compression=compression)

    def start(self) -> DaemonTier:
        """Queue the committed checkpoints under the root, then start uploading."""
        found = 0
        try:
            for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=self.root.fd):
                dirnames[:] = [n for n in dirnames if not n.startswith(".")]  # leftovers
                if MANIFEST_NAME not in filenames or dirpath == ".":
                    continue
                dirnames[:] = []  # a checkpoint: nothing below it
                try:
                    mode = os.stat(MANIFEST_NAME, dir_fd=dir_fd, follow_symlinks=False).st_mode
                except OSError:
                    continue
                if not stat.S_ISREG(mode):
                    continue
                relpath = os.path.normpath(dirpath)
                try:
                    self.add(relpath)
                except Exception as exc:  # logged; the next checkpoint is queued
                    self._event("error", "tier-unnameable", path=relpath, error=str(exc))
                    continue
                found += 1
        finally:  # what was found is uploaded, whatever stopped the walk
            logs.info("tier-start", url=str(self.url), queued=found)
            self.uploader.start()
        return self

    def add(self, relpath: str) -> None:
        """Queue the checkpoint committed at ROOT/relpath; TierError if the
        store cannot name it (never for a path Begin accepted)."""
        problem = path_problem(relpath)
        if problem is not None:
            raise TierError(f"{relpath!r} cannot be uploaded: {problem}, which no object "
                            "key may hold; rename it to upload it")
        parts = relpath.split("/")

        def open_dir() -> int:
            try:
                return self.root.open_dir(parts)
            except PathError as exc:
                raise OSError(errno.ELOOP, str(exc)) from None

        name, parent = parts[-1], "/".join(parts[:-1])
        step = step_of(name)
        group = self.url.child(parent) if parent else self.url
        self.uploader.add(Job(relpath, self.url.child(relpath), open_dir,
                              group=group if step is not None else None, step=step))
        self._gauges()

    def is_pending(self, relpath: str) -> bool:
        return self.uploader.is_pending(relpath)

    def status(self) -> TierStatus:
        return self.uploader.status()

    def stop(self) -> list[str]:
        """Stop now (at shutdown); what is pending is queued again at the next start."""
        return self.uploader.close(drain=False)

    def _gauges(self) -> None:
        status = self.uploader.status()
        self.metrics.tier_pending.set(len(status.pending))
        self.metrics.tier_failing.set(len(status.failing))

    def _event(self, level: str, event: str, **fields: Any) -> None:
        getattr(logs, level, logs.info)(event, **fields)
        if event in _RESULTS:
            result = _RESULTS[event] or ("already" if fields.get("already") else "uploaded")
            self.metrics.tier_uploads.labels(result=result).inc()
            if event == "tier-uploaded":
                self.metrics.tier_bytes_uploaded.inc(int(fields.get("bytes", 0)))
        self._gauges()
