"""A Checkpointer's root mirrored to a tier: its step-N checkpoints, uploaded.

ROOT/step-N goes to TIER/step-N. At start every committed step-N under the
root is queued (upload.py: one already in the store costs a GET), so an
upload that a crash interrupted resumes. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..storage import dirs
from ..storage.retention import checkpoints, step_of
from .client import S3
from .upload import Uploaded
from .uploader import Events, Job, TierStatus, Uploader, log_event
from .url import TierURL


class Mirror:
    def __init__(self, root: Path, url: TierURL, s3: S3, *, keep_last: int | None = None,
                 on_uploaded: Callable[[Job, Uploaded], None] | None = None,
                 events: Events = log_event, compression: str | None = "zstd",
                 uploads: Callable[[int], bool] | None = None) -> None:
        self.root, self.url, self.s3 = root, url, s3
        self._uploads = uploads  # which steps go to the store (a Checkpointer's tier_every)
        self.uploader = Uploader(s3, url, keep_last=keep_last, events=events,
                                 on_uploaded=on_uploaded, compression=compression)

    def start(self) -> Mirror:
        """Queue the committed checkpoints already under the root; start uploading."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                for _, name in checkpoints(fd):
                    if self.due(name):
                        self.add(self.root / name)
            finally:
                os.close(fd)
        self.uploader.start()
        return self

    def add(self, path: Path) -> None:
        """Queue the checkpoint just committed at `path` (ROOT/step-N)."""
        def open_dir() -> int:
            parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                return dirs.open_dir(path.name, parent)
            finally:
                os.close(parent)

        self.uploader.add(Job(str(path), self.url.child(path.name), open_dir, group=self.url,
                              step=step_of(path.name)))

    def due(self, name: str) -> bool:
        """Whether ROOT/name goes to the store (tier_every passes over the others)."""
        step = step_of(name)
        return self._uploads is None or step is None or self._uploads(step)

    def is_pending(self, name: str) -> bool:
        """Whether ROOT/name is not in the store yet (local retention keeps it)."""
        return self.uploader.is_pending(str(self.root / name))

    def status(self) -> TierStatus:
        return self.uploader.status()
