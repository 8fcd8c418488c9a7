"""Checkpointer: asynchronous checkpoints of a training loop, with retention.

    ckpt = fastpersist.Checkpointer("ckpts", keep_last=3, keep_every=1000)
    start = ckpt.load_latest()["step"] if ckpt.latest() else 0
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
moment leaves `latest` naming a complete checkpoint.

Who does it: in-process, the writer thread after each commit. Through a
daemon, which owns everything under its --root (the trainer needs read access
only), the policy travels with each commit and the daemon applies it before it
reports the checkpoint committed, even if the trainer died after the hand-over.
Either way a failure there fails the save's future with PostCommitError: the
checkpoint itself is committed.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .api import check_local_compression, load
from .errors import CheckpointError, CheckpointNotFoundError
from .format.manifest import MANIFEST_NAME
from .knobs import current as current_knobs
from .saving.futures import SaveFuture
from .saving.saver import Saver
from .storage.retention import LATEST, AfterCommit, apply_at, step_of
from .tensors.checkpoint import read_manifest
from .tensors.factory import MapLocation

if TYPE_CHECKING:
    from .distributed.saver import DistributedSaver
    from .saving.remote import RemoteSaver


def _committed_at(path: Path) -> int:
    """When the checkpoint at path was committed: its manifest is written last."""
    try:
        return os.stat(path / MANIFEST_NAME).st_mtime_ns
    except OSError:
        return 0


def _is_committed(path: Path) -> bool:
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


class Checkpointer:
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
        and applies retention.
    compression: "zstd" to compress each checkpoint (fastpersist.save);
        in-process saves only.
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None,
                 keep_every: int | None = None, max_in_flight: int = 1,
                 allow_pickle: bool = False, daemon: str | None = None,
                 process_group: Any = None, compression: str | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be at least 1")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.after_commit = AfterCommit(True, keep_last, keep_every)
        self.allow_pickle = allow_pickle
        address = current_knobs().daemon if daemon is None else daemon
        check_local_compression(compression, address, process_group)
        self.compression = compression
        self._saver: Saver | DistributedSaver
        # The savers that take the policy along with the commit (to the daemon,
        # or to the distributed job's commit); the in-process Saver calls back.
        self._delegated: RemoteSaver | DistributedSaver | None = None
        if process_group is not None:
            from .distributed.saver import DistributedSaver

            self._saver = self._delegated = DistributedSaver(process_group, daemon=address)
        elif address:
            from .saving.remote import RemoteSaver

            self._saver = self._delegated = RemoteSaver(address, max_in_flight)
        else:
            self._saver = Saver(max_in_flight)
        self._lock = threading.Lock()  # latest pointer and retention

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def save(self, step: int, state: Any, *, wait_for_snapshot: bool = True) -> SaveFuture:
        """Start an asynchronous checkpoint of `state` for `step`.

        Returns once the snapshot is taken (see fastpersist.async_save); raises
        an earlier save's failure if nobody has looked at it yet.
        """
        if step < 0:
            raise ValueError("step must be >= 0")
        if self._delegated is not None:
            return self._delegated.save(state, self.path_for(step),
                                        allow_pickle=self.allow_pickle,
                                        wait_for_snapshot=wait_for_snapshot,
                                        after_commit=self.after_commit)
        assert isinstance(self._saver, Saver)  # the in-process one: not delegated
        return self._saver.save(state, self.path_for(step), allow_pickle=self.allow_pickle,
                                wait_for_snapshot=wait_for_snapshot,
                                on_commit=self._committed, compression=self.compression)

    def wait(self) -> None:
        """Block until every save so far is durable; raise if one failed."""
        self._saver.wait()
        self._saver.raise_unobserved_failure()

    def close(self, *, abort: bool = False) -> None:
        """Finish the in-flight save (or with abort=True abandon it cleanly) and
        free the staging memory; raises a save failure nobody looked at. From a
        SIGTERM handler: set a flag there and call close() from the loop."""
        self._saver.close(abort=abort)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: abandon the save on KeyboardInterrupt/SystemExit,
        # finish it otherwise, and let the original error propagate.
        try:
            self.close(abort=not issubclass(exc_type, Exception))
        except CheckpointError as close_error:
            warnings.warn(f"checkpoint save failed while leaving on an error: {close_error}",
                          RuntimeWarning, stacklevel=2)

    @property
    def staging_bytes(self) -> int:
        """Host memory held for snapshots (reused by the next save)."""
        return self._saver.staging_bytes

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) of every step-N entry under root, committed or not,
        by ascending step: names only, no manifest is read."""
        if not self.root.is_dir():
            return []
        return sorted((step, entry) for entry in self.root.iterdir()
                      if (step := step_of(entry.name)) is not None)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints under root, ascending."""
        return [step for step, entry in self._step_dirs() if _is_committed(entry)]

    def latest(self) -> Path | None:
        """The newest durable checkpoint, or None if there is none yet.

        ROOT/latest is trusted (an operator may point it back at an older step
        to roll back), except where a higher step was committed after the
        pointer was written: its pointer update failed (PostCommitError), or
        an older daemon committed it after the trainer that would have moved
        the pointer had died; it is the newest state there is. Reads only the
        manifests it needs: newest first, stopping at the answer."""
        dirs = self._step_dirs()
        pointer = self.root / LATEST
        try:
            name = pointer.read_text().strip()
            pointed_at = os.stat(pointer).st_mtime_ns
        except OSError:
            name, pointed_at = "", 0
        # Entries are returned as found: a checkpoint saved by hand as step-7 is
        # step-7, not path_for(7).
        pointed = next(((s, e) for s, e in dirs if e.name == name and _is_committed(e)), None)
        if pointed is None:
            # No pointer, or it names something gone: the highest committed step.
            return next((e for _, e in reversed(dirs) if _is_committed(e)), None)
        for step, entry in reversed(dirs):
            if step <= pointed[0]:
                break
            if _committed_at(entry) > pointed_at and _is_committed(entry):
                return entry
        return pointed[1]

    def load_latest(self, map_location: MapLocation = None, **kwargs: Any) -> Any:
        path = self.latest()
        if path is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}")
        return load(path, map_location, allow_pickle=self.allow_pickle, **kwargs)

    # -- runs on the writer thread, after a commit (in-process) -------------

    def _committed(self, path: Path) -> None:
        with self._lock:
            apply_at(self.root, path.name, self.after_commit)
