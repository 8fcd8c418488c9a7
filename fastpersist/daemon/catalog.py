"""List and Delete: the committed checkpoints under the daemon's root.

Both read or change the disk without the service lock, by descriptors beneath
the root (rootfs.py). A Delete claims its target in the registry while it
works, so that no Begin of the same path starts meanwhile.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import os

from ..storage.commit import delete_checkpoint
from . import logs
from .checkpoints import Checkpoint
from .memory import MemoryTier
from .paths import RequestPath
from .registry import Registry
from .requests import RequestError
from .rootfs import Entry, Root, list_entries


class Catalog:
    def __init__(self, registry: Registry, root: Root, memory: MemoryTier | None = None
                 ) -> None:
        self.registry = registry
        self.root = root
        self.memory = memory

    def list(self, path: RequestPath) -> tuple[list[Entry],
                                               list[Checkpoint]]:
        """The checkpoints in the directory `path` (rootfs.list_entries) and the
        ones in flight anywhere under it."""
        try:
            fd = self.root.open_dir(path.parts)
        except (FileNotFoundError, NotADirectoryError):
            raise RequestError("NOT_FOUND", f"{path.text or '.'} is not a directory") from None
        try:
            entries = list(list_entries(fd))
        finally:
            os.close(fd)
        directory = path.under(self.root.path)
        with self.registry.cond:
            in_flight = [c for c in self.registry.in_flight() if directory in c.target.parents]
        return entries, in_flight

    def delete(self, path: RequestPath) -> None:
        """Delete the committed checkpoint at `path` (commit.delete_checkpoint),
        by its name in its directory, held open."""
        not_found = RequestError("NOT_FOUND", f"{path.text} is not a committed checkpoint")
        if self.memory is not None and self.memory.forget(path.text, memory_only=True):
            logs.info("deleted", path=path.text, memory_only=True)
            return  # a memory-only checkpoint: nothing of it is on disk
        try:
            parent_fd = self.root.open_dir(path.parts[:-1])
        except FileNotFoundError:
            raise not_found from None
        try:
            try:
                os.close(self.root.checkpoint_dir(parent_fd, path.parts[-1]))
            except FileNotFoundError:
                raise not_found from None
            target = path.under(self.root.path)
            r = self.registry
            with r.cond:
                if r.busy_at(target):
                    raise RequestError("FAILED_PRECONDITION",
                                       f"a checkpoint of {path.text} is in flight")
                r.claims[target] += 1
            try:
                delete_checkpoint(target, dir_fd=parent_fd)
            finally:
                with r.cond:
                    r.claims[target] -= 1
                    if not r.claims[target]:
                        del r.claims[target]
        finally:
            os.close(parent_fd)
        if self.memory is not None:
            self.memory.forget(path.text)
        logs.info("deleted", path=path.text)
