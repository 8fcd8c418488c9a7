"""The background uploader: committed checkpoints to the store, one at a time.

Whoever commits a checkpoint (a Checkpointer's writer thread, fastpersistd)
adds it here and goes on; a thread of its own uploads it (upload.py). The
queue is rebuilt from the disk when its owner starts (every committed
checkpoint is added; one whose remote manifest holds the same bytes is done
at the cost of one GET), so what a crash interrupted is uploaded after the
restart.

    order         newest step first: the checkpoint a lost node would be
                  restored from goes first.
    failures      a failed upload is retried after a backoff (1 s, doubling,
                  at most FASTPERSIST_TIER_RETRY_MAX, 60 s), for as long as
                  the uploader runs: every
                  failure is reported (events, status()); none stalls the
                  trainer or the daemon. Only what retrying cannot change
                  leaves the queue, and that is reported too:
                    gone      the checkpoint's directory does not exist
                              (ENOENT), seen twice, a backoff apart: dropped.
                    not uploadable  not committed, or a node-local part of
                              a distributed checkpoint: dropped.
                    corrupt   its bytes do not match its manifest (a CRC32C,
                              a size: checked.py): never uploaded; reported
                              (event tier-upload-corrupt, status().corrupt,
                              naming the file and tensor) and kept locally.
                  Any other error (the store; EMFILE, ENOMEM, EIO reading
                  the files) is retried.
    pending       a checkpoint stays pending from add() until its manifest is
                  in the store. Local retention keeps what is_pending says:
                  every checkpoint whose upload this uploader has not
                  confirmed (queued, failing, given up while draining,
                  corrupt, and any it was never given: a checkpoint a walk
                  at start could not reach is kept, not assumed uploaded).
                  Confirmed: uploaded, found in the store, superseded (see
                  keep_last) or not uploadable at all (a node-local part).
    keep_last     after each upload, remote retention in its directory
                  (retention.keep_last, counting up to the highest step
                  uploaded there); pending checkpoints older than the ones it
                  kept would be deleted from the store at once, so they are
                  dropped from the queue ("superseded") and local retention
                  may delete them.
    sweep         multipart uploads below the tier older than a day are
                  aborted when the uploader starts and hourly.
    compression   "zstd" (default): a raw checkpoint is compressed on the way
                  (upload.py, compress.py); None or "none": sent as it is.
    close         drain=True: each pending checkpoint gets up to 3 more tries;
                  returns those still not uploaded. drain=False: stop now (the
                  upload in progress may still finish).

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..background import lower_this_thread
from ..knobs import current as current_knobs
from .checked import LocalCorruption
from .client import S3
from .retention import keep_last, sweep_uploads
from .upload import NotUploadable, Uploaded, check_compression, upload_checkpoint
from .url import TierURL

DRAIN_ATTEMPTS = 3
_log = logging.getLogger("fastpersist.tier")
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def log_event(level: str, event: str, **fields: Any) -> None:
    """The default event sink: the `fastpersist.tier` logger."""
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    _log.log(_LEVELS.get(level, logging.INFO), "%s %s", event, text)


Events = Callable[..., None]  # events(level, event, **fields)


@dataclass
class Job:
    key: str  # the local checkpoint: a path (is_pending, messages)
    url: TierURL  # where it goes
    open_dir: Callable[[], int]  # opens the local directory (OSError: gone)
    group: TierURL | None = None  # the directory of its step-N siblings in the store
    step: int | None = None
    attempts: int = 0
    not_before: float = 0.0
    seq: int = 0
    error: str = ""  # of the last failed attempt
    vanished: bool = False  # its directory was missing at the last attempt


@dataclass(frozen=True)
class TierStatus:
    url: str
    pending: tuple[str, ...]  # not in the store yet (queued, uploading, retrying)
    uploading: str | None
    uploaded: int  # checkpoints uploaded (or found uploaded) since start
    bytes_uploaded: int
    failures: int  # failed attempts since start
    failing: tuple[str, ...]  # pending checkpoints whose last attempt failed
    last_error: str | None  # the most recent failure, if any
    corrupt: tuple[str, ...] = ()  # "KEY: why" of checkpoints never uploaded: corrupt

    @property
    def ok(self) -> bool:
        return not self.failing


class Uploader:
    def __init__(self, s3: S3, url: TierURL, *, keep_last: int | None = None,
                 events: Events = log_event,
                 on_uploaded: Callable[[Job, Uploaded], None] | None = None,
                 backoff: tuple[float, float] | None = None, sweep_every: float = 3600.0,
                 sweep_older_than: float = 86400.0, compression: str | None = "zstd") -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("tier_keep_last must be at least 1 (or None to keep everything)")
        self.s3, self.url, self.keep_last = s3, url, keep_last
        self.compression = check_compression(compression)
        self.events, self.on_uploaded = events, on_uploaded
        self.backoff = backoff or (1.0, float(current_knobs().tier_retry_max))
        self.sweep_every, self.sweep_older_than = sweep_every, sweep_older_than
        self._cond = threading.Condition()
        self._jobs: dict[str, Job] = {}
        self._given_up: dict[str, Job] = {}  # out of tries while draining: still pending
        self._corrupt: dict[str, Job] = {}  # do not match their manifest: kept, reported
        self._confirmed: set[str] = set()  # keys local retention may delete
        self._current: Job | None = None
        self._seq = 0
        self._high: dict[TierURL, int] = {}  # highest step uploaded per group
        self._uploaded = self._bytes = self._failures = 0
        self._last_error: str | None = None
        self._draining = self._stopping = False
        self._next_sweep = 0.0
        self._thread = threading.Thread(target=self._run, name="fp-tier-upload", daemon=True)

    def start(self) -> Uploader:
        self._thread.start()
        return self

    # -- what owners call ----------------------------------------------------

    def add(self, job: Job) -> None:
        """Queue `job` (replacing a queued one of the same key: saved again)."""
        with self._cond:
            self._seq += 1
            job.seq = self._seq
            self._jobs[job.key] = job
            self._given_up.pop(job.key, None)
            self._corrupt.pop(job.key, None)
            self._confirmed.discard(job.key)
            self._cond.notify_all()

    def is_pending(self, key: str) -> bool:
        """Whether the upload of checkpoint `key` is not confirmed (local
        retention keeps it): from add() until it is in the store, and for a
        key never added."""
        with self._cond:
            return key not in self._confirmed

    def status(self) -> TierStatus:
        with self._cond:
            pending = {**self._given_up, **self._jobs}
            return TierStatus(
                str(self.url), tuple(sorted(pending)),
                self._current.key if self._current else None, self._uploaded, self._bytes,
                self._failures, tuple(sorted(k for k, j in pending.items() if j.error)),
                self._last_error,
                tuple(f"{k}: {j.error}" for k, j in sorted(self._corrupt.items())))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs, timeout)

    def close(self, *, drain: bool = True, timeout: float | None = None) -> list[str]:
        """Stop; with drain, after up to DRAIN_ATTEMPTS more tries of each
        pending checkpoint. Returns the keys not uploaded (corrupt ones too)."""
        with self._cond:
            if drain:
                self._draining = True
                for job in self._jobs.values():
                    job.attempts, job.not_before = 0, 0.0
            else:
                self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout if drain else 0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            return sorted({*self._jobs, *self._given_up, *self._corrupt})

    # -- the thread ----------------------------------------------------------

    def _next(self) -> Job | None:
        with self._cond:
            while True:
                if self._stopping or (self._draining and not self._jobs):
                    return None
                now = time.monotonic()
                ready = [j for j in self._jobs.values() if j.not_before <= now]
                if ready:
                    job = max(ready, key=lambda j: (j.step if j.step is not None else -1, j.seq))
                    self._current = job
                    return job
                wake = min((j.not_before for j in self._jobs.values()), default=None)
                self._cond.wait(None if wake is None else max(0.0, wake - now))

    def _run(self) -> None:
        lower_this_thread()  # uploads yield the cores to training (background.py)
        while True:
            self._sweep_if_due()
            job = self._next()
            if job is None:
                return
            try:
                self._attempt(job)
            except Exception as exc:  # a bug here must not silently stop the uploader
                self.events("error", "tier-uploader-error", error=repr(exc))
                self._failed(job, repr(exc), drop=False)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _attempt(self, job: Job) -> None:
        seq = job.seq
        started = time.monotonic()
        try:
            fd = job.open_dir()
        except FileNotFoundError as exc:
            # Gone, or a moment's absence (a directory being replaced): only
            # a second look, a backoff later, may drop it.
            gone = job.vanished
            job.vanished = True
            self._failed(job, f"{job.key}: {'gone' if gone else 'not found; looking again'} "
                         f"({exc.strerror or exc})", drop=gone, seq=seq)
            return
        except OSError as exc:  # EMFILE, ENOMEM, EIO, a link on the path: not gone
            job.vanished = False
            self._failed(job, f"{job.key}: cannot open it ({exc.strerror or exc})",
                         drop=False, seq=seq)
            return
        job.vanished = False
        try:
            done = upload_checkpoint(self.s3, fd, job.key, job.url, self.compression)
        except (NotUploadable, LocalCorruption) as exc:
            if self._gone(job):  # deleted while it was read: not corrupt, gone
                self._failed(job, f"{job.key}: gone while it was uploaded ({exc})", drop=True,
                             seq=seq)
            elif isinstance(exc, LocalCorruption):
                self._corrupted(job, exc, seq)
            else:  # never uploadable (a node-local part): retention may have it
                with self._cond:
                    if self._jobs.get(job.key) is job and job.seq == seq:
                        self._confirmed.add(job.key)
                self._failed(job, str(exc), drop=True, seq=seq)
            return
        except Exception as exc:
            self._failed(job, str(exc), drop=False, seq=seq)
            return
        finally:
            os.close(fd)
        with self._cond:
            if self._jobs.get(job.key) is job and job.seq == seq:
                del self._jobs[job.key]  # else added again meanwhile: goes again
                self._confirmed.add(job.key)
            self._uploaded += 1
            self._bytes += done.bytes
        self.events("info", "tier-uploaded", path=job.key, url=str(job.url), bytes=done.bytes,
                    already=done.already, replaced=done.replaced,
                    seconds=round(time.monotonic() - started, 3))
        self._retention(job)
        if self.on_uploaded is not None:
            self.on_uploaded(job, done)

    def _gone(self, job: Job) -> bool:
        """Whether the checkpoint's directory is missing now (ENOENT)."""
        try:
            fd = job.open_dir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        os.close(fd)
        return False

    def _corrupted(self, job: Job, exc: LocalCorruption, seq: int) -> None:
        with self._cond:
            self._failures += 1
            self._last_error = job.error = str(exc)
            job.attempts += 1
            if self._jobs.get(job.key) is job and job.seq == seq:
                del self._jobs[job.key]
                self._corrupt[job.key] = job
        self.events("error", "tier-upload-corrupt", path=job.key, url=str(job.url),
                    file=exc.file or "", tensor=exc.tensor or "", error=str(exc))

    def _failed(self, job: Job, error: str, *, drop: bool, seq: int | None = None) -> None:
        with self._cond:
            self._failures += 1
            self._last_error = error
            job.attempts += 1
            job.error = error
            exhausted = self._draining and job.attempts >= DRAIN_ATTEMPTS
            current = self._jobs.get(job.key) is job and (seq is None or job.seq == seq)
            if current and (drop or exhausted):
                del self._jobs[job.key]
                if exhausted and not drop:
                    self._given_up[job.key] = job
            elif current:
                base, most = self.backoff
                job.not_before = time.monotonic() + min(most, base * 2 ** (job.attempts - 1))
        self.events("error" if drop else "warning",
                    "tier-upload-dropped" if drop else "tier-upload-failed",
                    path=job.key, url=str(job.url), attempt=job.attempts, error=error)

    def _retention(self, job: Job) -> None:
        if job.group is None or job.step is None:
            return
        with self._cond:
            high = self._high[job.group] = max(job.step, self._high.get(job.group, job.step))
        try:
            kept = keep_last(self.s3, job.group, high, self.keep_last)
        except Exception as exc:
            self.events("error", "tier-retention-failed", url=str(job.group), error=str(exc))
            return
        if kept.deleted:
            self.events("info", "tier-retention", url=str(job.group), deleted=list(kept.deleted))
        if self.keep_last is None or len(kept.kept) < self.keep_last:
            return
        oldest = min(kept.kept)
        with self._cond:
            stale = [j for j in self._jobs.values() if j.group == job.group and
                     j.step is not None and j.step < oldest and j is not self._current]
            for j in stale:
                del self._jobs[j.key]
                self._confirmed.add(j.key)  # the store would delete it at once
            self._cond.notify_all()
        for j in stale:
            self.events("info", "tier-upload-skipped", path=j.key, reason=(
                f"superseded: the store keeps the {self.keep_last} newest, all newer"))

    def _sweep_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep or self._stopping:
            return
        self._next_sweep = now + self.sweep_every
        try:
            aborted = sweep_uploads(self.s3, self.url, self.sweep_older_than)
        except Exception as exc:
            self.events("warning", "tier-sweep-failed", url=str(self.url), error=str(exc))
            return
        if aborted:
            self.events("info", "tier-sweep", url=str(self.url), aborted=aborted)
