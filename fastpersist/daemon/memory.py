"""The memory tier (--memory-tier-count, --memory-tier-bytes): the newest
checkpoints the daemon committed, kept in memory for a trainer restarted on
this node (MemoryCopy; the client's tensors/memory_read.py).

What is kept: each data file, byte for byte as it is on disk, in a file of
a directory of the daemon's own in --shm-dir (a tmpfs), named
"fastpersistd-copy-<random>", 0750, its files 0640, both of the socket's
group: who may use the socket may read them, as the segments it hands in.
Only checkpoints whose every file came in shared memory, uncompressed and
not a part of a distributed job, are kept (their bytes are the segments').

Where the copy is made: on a thread of this module's, while the write
worker writes the same segment to disk (the client's staging is lent to
the daemon until the file is written, and reused after: the copy must be
the daemon's own). The engine writes it, from the same segments as the
disk file, through the page cache of --shm-dir; it costs a memory copy of
the checkpoint, which overlaps the disk write, and the file counts as
written once both are done. Each segment's CRC32C is computed as it is
copied and compared with the disk write's: a client that changed its
memory meanwhile leaves no copy.

Budget: the copies (and the ones being made) never hold more than
--memory-tier-bytes of files; the oldest committed copy is evicted to make
room (removed before the next byte is copied), and a checkpoint larger than
the budget is not kept. At most --memory-tier-count copies are held; the
oldest goes first. A copy is only ever unlinked, never written again nor
truncated: a client's tensors map its pages copy-on-write, and keep an
evicted copy's pages (outside the budget) until they go. Reusing an evicted
copy's pages for the next one would be faster, and would change those
tensors under the client.

Identity: a copy is keyed by the checkpoint's path and the bytes of the
manifest the daemon committed there. MemoryCopy reads the manifest under the
root again and serves the copy only if it is still that one; Delete,
retention and a newer save at the path drop the copy at once. Copies live
as long as the daemon: dropped at shutdown; a daemon that was SIGKILLed
held each copy's directory flocked, so the next one removes the directories
whose lock it can take at start (sweep). A client learns of a copy only
from the live daemon that made it, never from the directory's presence.

Memory-only checkpoints (Begin's durability "memory"): copies made with no
disk write beside them (copy_only), held as the only copy, evicted like any.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Engine, Segment
from ..errors import MemoryTierError
from ..protocol.shm import COPY_NAME, COPY_PREFIX
from ..storage import dirs
from . import logs
from .checkpoints import Checkpoint, PendingFile
from .metrics import Metrics
from .paths import RequestPath
from .registry import Registry
from .rootfs import Root, manifest_at

# Off unless asked for: the copy beside each disk write made a durable save
# through the daemon 2x slower on this project's 2-vCPU machine (docs/guides/daemon.md).
DEFAULT_COUNT = 0
# Threads that copy segments into the tier, beside the write workers.
COPIERS = 2


@dataclass
class Copy:
    """A checkpoint's copy: being made (manifest None) or held."""

    relpath: str
    name: str  # the directory's, in --shm-dir
    fd: int  # the directory, flocked (LOCK_EX) for the daemon's life
    reserved: int = 0  # bytes of its files, made or being made
    files: set[int] = field(default_factory=set)  # data files copied and checked
    manifest: bytes | None = None
    failed: str = ""
    busy: bool = False  # a file is being copied into it: prune leaves it alone
    memory_only: bool = False  # the only copy: nothing of it is on disk
    created: float = 0.0  # time.time() when held


class MemoryTier:
    """The copies; thread-safe (its own lock, never the registry's)."""

    def __init__(self, shm_dir: Path, count: int, budget: int, engine: Engine,
                 metrics: Metrics, group: int | None = None) -> None:
        self.count, self.budget = count, budget
        self.engine, self.metrics, self.group = engine, metrics, group
        self.shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._building: dict[str, Copy] = {}  # by checkpoint id
        self._held: OrderedDict[str, Copy] = OrderedDict()  # by path, oldest first
        self._used = 0
        self._copiers = ThreadPoolExecutor(COPIERS, thread_name_prefix="fpd-memcopy")

    @property
    def enabled(self) -> bool:
        return self.count > 0 and self.budget > 0

    def usage(self) -> tuple[int, int]:
        """(bytes held or being copied, copies held)."""
        with self._lock:
            return self._used, len(self._held)

    # -- making a copy (the write workers) -----------------------------------

    def start_file(self, ck: Checkpoint, job: PendingFile, name: str) -> Future[list[int]] | None:
        """Start copying data file `name` of ck (header and data, as on disk)
        while it is written; None when ck is not kept. finish_file must follow.
        Never raises: the tier must not fail a save."""
        if not self.enabled or ck.job is not None or ck.frame_bytes:
            return None
        try:
            return self._start(ck, job, name)
        except OSError as exc:  # a full or odd --shm-dir
            logs.error("memory-copy-failed", path=ck.relpath, error=str(exc))
            self.abandon(ck.id)
            return None

    def _start(self, ck: Checkpoint, job: PendingFile, name: str) -> Future[list[int]] | None:
        size = job.data_start + job.nbytes
        victims: list[Copy] = []
        with self._lock:
            c = self._building.get(ck.id)
            if c is not None and c.failed:
                return None
            if c is None:
                c = self._building[ck.id] = Copy(ck.relpath, "", -1)
                self._new(c)
            if c.reserved + size > self.budget:
                self._fail(c, f"it holds over --memory-tier-bytes ({self.budget})")
                victims.append(c)
            else:
                while self._used + size > self.budget and self._held:
                    victims.append(self._drop(next(iter(self._held))))
                if self._used + size > self.budget:
                    self._fail(c, "copies being made hold the rest of --memory-tier-bytes")
                    victims.append(c)
                else:
                    c.reserved += size
                    self._used += size
                    c.busy = True
        self._remove(victims)  # before a byte of the new copy is made
        if c.failed:
            return None
        return self._copiers.submit(self._copy_file, c, job, name, size)

    def copy_only(self, ck: Checkpoint, job: PendingFile, name: str) -> list[int]:
        """Data file `name` of memory-only checkpoint ck, copied with no disk
        write beside it; its CRC32Cs, header first (MemoryTierError: not kept)."""
        copying = self.start_file(ck, job, name)
        error = copying.exception() if copying is not None else None
        crcs = copying.result() if copying is not None and error is None else None
        if copying is not None:
            self.finish_file(ck, copying, job.index, crcs)
        with self._lock:
            c = self._building.get(ck.id)
            if crcs is not None and c is not None and job.index in c.files:
                return crcs
            why = str(error) if error else (c.failed if c is not None and c.failed else
                                            "its copy was dropped (see the daemon's log)")
        raise MemoryTierError(f"memory-only checkpoint {ck.relpath} is not kept in memory: {why}")

    def finish_file(self, ck: Checkpoint, copying: Future[list[int]], index: int,
                    written: list[int] | None) -> None:
        """The write of data file `index` is over (written: its CRC32Cs, header
        first; None if it failed): wait for its copy and check it."""
        try:
            crcs: list[int] | None = copying.result()
        except Exception as exc:
            crcs, why = None, f"copying data file {index} failed: {exc}"
        else:
            why = f"data file {index} changed while it was written"
        with self._lock:
            c = self._building.get(ck.id)
            if c is not None:
                c.busy = False
            if c is None or c.failed:
                return
            if written is not None and crcs == written:
                c.files.add(index)
                return
            self._fail(c, why if written is not None else "its write failed")
        self.abandon(ck.id)

    def _copy_file(self, c: Copy, job: PendingFile, name: str, size: int) -> list[int]:
        """The file as the disk write makes it (the same segments), written
        by the engine's threads through the page cache; its CRC32Cs. The
        engine reads the client's memory guarded: a client that truncates
        its segment fails the copy (EFAULT) instead of killing the daemon."""
        views = [job.data.view[e.begin:e.end] for e in job.entries]
        try:
            segments: list[Segment] = [(job.header, 0)]
            segments += [(v, job.data_start + e.begin)
                         for v, e in zip(views, job.entries, strict=True)]
            result = self.engine.write_file(name, segments, size, fsync=False, dir_fd=c.fd,
                                            buffered=True)
            del segments
        finally:
            for v in views:
                v.release()
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=c.fd)
        try:
            self._give_group(fd, 0o640)
        finally:
            os.close(fd)
        assert result.crcs is not None
        return result.crcs

    def committed(self, ck: Checkpoint, manifest: bytes, *, memory_only: bool = False) -> str:
        """ck was committed with `manifest` (memory_only: in memory alone):
        hold its copy, if every file is in it, as the newest; the oldest
        beyond --memory-tier-count go. Returns why it is not held ("": it is)."""
        with self._lock:
            c = self._building.pop(ck.id, None)
            if c is None:
                return "its copy was dropped"
            victims = []
            c.memory_only, c.created = memory_only, time.time()
            if c.failed or len(c.files) != ck.files_total:
                c.failed = c.failed or "not every data file came in shared memory"
                victims.append(self._release(c))
            else:
                c.manifest = manifest
                if ck.relpath in self._held:
                    victims.append(self._drop(ck.relpath))
                self._held[ck.relpath] = c
                while len(self._held) > self.count:
                    victims.append(self._drop(next(iter(self._held))))
        self._remove(victims)
        if not c.failed:
            logs.info("memory-copy", path=ck.relpath, bytes=c.reserved, memory_only=memory_only)
        self._gauges()
        return c.failed

    def abandon(self, ident: str) -> None:
        """Drop the copy being made for checkpoint `ident` (it failed, or ended)."""
        with self._lock:
            c = self._building.pop(ident, None)
            if c is None:
                return
            self._release(c)
        if c.failed:
            logs.info("memory-copy-dropped", path=c.relpath, reason=c.failed)
        self._remove([c])

    def prune(self, registry: Registry) -> None:
        """Housekeeping: drop the copies being made of checkpoints that ended
        without a commit."""
        with registry.cond:
            alive = {c.id for c in registry.checkpoints.values() if not c.terminal}
        with self._lock:
            gone = [i for i, c in self._building.items() if i not in alive and not c.busy]
        for ident in gone:
            self.abandon(ident)

    # -- serving and forgetting ------------------------------------------------

    def lookup(self, path: RequestPath, root: Root) -> tuple[bytes, str, bool] | str:
        """(the committed manifest, the copy's directory name, whether it is
        memory-only) for the checkpoint at `path` if the copy is still that
        checkpoint's; else why not. A memory-only copy is that checkpoint's
        while no checkpoint is committed on disk at the path."""
        with self._lock:
            c = self._held.get(path.text)
        if c is None:
            return "fastpersistd holds no copy of it in memory"
        if manifest_at(root, path) != (None if c.memory_only else c.manifest):
            with self._lock:
                victim = self._drop(path.text) if self._held.get(path.text) is c else None
            self._remove([victim] if victim else [])
            logs.info("memory-copy-dropped", path=path.text,
                      reason="the checkpoint was replaced or deleted")
            return "the checkpoint at the path is not the one held in memory any more"
        assert c.manifest is not None
        return c.manifest, c.name, c.memory_only

    def memory_only_under(self, directory: str) -> list[tuple[str, int, float]]:
        """(name, bytes, created) of the memory-only copies held directly
        in `directory` (a path relative to the root; "" for the root)."""
        with self._lock:
            return [(p.rpartition("/")[2], c.reserved, c.created) for p, c in self._held.items()
                    if c.memory_only and p.rpartition("/")[0] == directory]

    def forget(self, relpath: str, *, memory_only: bool = False) -> bool:
        """The checkpoint at relpath was deleted or replaced: drop its copy
        (memory_only: only a memory-only one). Whether one was dropped."""
        with self._lock:
            held = self._held.get(relpath)
            victim = (self._drop(relpath) if held is not None
                      and (held.memory_only or not memory_only) else None)
        if victim is not None:
            self._remove([victim])
            logs.info("memory-copy-dropped", path=relpath, reason="deleted or replaced")
        return victim is not None

    def close(self) -> None:
        """Shutdown: every copy goes."""
        self._copiers.shutdown(wait=True)
        with self._lock:
            victims = [self._release(c) for c in self._building.values()]
            victims += [self._drop(p) for p in list(self._held)]
            self._building.clear()
        self._remove(victims)

    def sweep(self) -> list[str]:
        """At start: remove the copies a dead daemon left (nobody holds their
        lock); a live daemon's (another root's, sharing --shm-dir) are kept."""
        return dirs.sweep_unlocked(self.shm_fd, COPY_NAME)

    # -- with the lock held --------------------------------------------------------

    def _new(self, c: Copy) -> None:
        """c's directory, made and locked (listed first, so that a failure
        here is abandoned like any other)."""
        c.name = COPY_PREFIX + secrets.token_hex(12)
        os.mkdir(c.name, 0o750, dir_fd=self.shm_fd)
        c.fd = dirs.open_dir(c.name, self.shm_fd)
        fcntl.flock(c.fd, fcntl.LOCK_EX)
        self._give_group(c.fd, 0o750)

    def _fail(self, c: Copy, why: str) -> None:
        """Give up c: it stays listed (its next files are not copied) until
        committed, abandon or prune forgets it."""
        c.failed = why
        self._release(c)

    def _release(self, c: Copy) -> Copy:
        self._used -= c.reserved
        c.reserved = 0
        return c

    def _drop(self, relpath: str) -> Copy:
        return self._release(self._held.pop(relpath))

    # -- without it ---------------------------------------------------------------------

    def _remove(self, victims: list[Copy]) -> None:
        for c in victims:
            if c.fd < 0:
                if c.name:  # made, not opened
                    with contextlib.suppress(OSError):
                        os.rmdir(c.name, dir_fd=self.shm_fd)
                continue
            try:
                dirs.remove_tree(c.name, self.shm_fd)
            except OSError as exc:
                logs.error("memory-copy-not-removed", directory=c.name, error=str(exc))
            os.close(c.fd)
            c.fd = -1
        self._gauges()

    def _give_group(self, fd: int, mode: int) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                os.fchown(fd, -1, self.group)
        os.fchmod(fd, mode)  # the umask may have taken bits away

    def _gauges(self) -> None:
        used, held = self.usage()
        self.metrics.memory_tier_bytes.set(used)
        self.metrics.memory_tier_copies.set(held)
