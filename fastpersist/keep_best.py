"""A Checkpointer's metrics and its keep-best-by-metric retention.

    ckpt = Checkpointer("ckpts", keep_last=2, keep_best=3, best_metric="val_loss")
    ckpt.save(step, state, metrics={"val_loss": val_loss})

metrics= (numbers by name) are recorded for each step in ROOT/metrics.json,
before the checkpoint's save begins, atomically (a temporary with a leftover
name, fsynced, renamed over it, the directory fsynced): every committed
checkpoint whose save was given metrics has them there, and a Checkpointer
started later on the same root (a restarted job) reads them. Entries of
steps no longer under the root are dropped at the next write.

A save with overwrite=True over a committed step records the new metrics
with the old ones and the SHA-256 of the old checkpoint's manifest
("replaces"): while that manifest is the one under the step (the overwrite
is in flight, failed, or was cut off by a crash), the old metrics rank it,
so a failed overwrite never re-ranks the checkpoint that stayed.

keep_best=N keeps the N committed checkpoints with the best `best_metric`
("min": lowest, "max": highest) besides what keep_last and keep_every keep
(keep_best alone keeps the newest checkpoint too: keep_last=1). Ties go to the
earlier step (the first to reach a value stays; Lightning's top-k does the
same); NaN ranks last. A checkpoint saved without the metric (before
keep_best was set, or a memory-only one) is never among the best; with
keep_best set, a disk save without it raises ValueError before anything is
written. Only committed checkpoints count: a better one still in flight
pushes nothing out until it is durable.

In-process: the trainer writes metrics.json, and the Checkpointer's writer
thread applies retention; in a distributed job, rank 0 does both (every rank
checks its metrics=, rank 0's are recorded). Through fastpersistd, which owns
the root (the trainer may only read it), metrics= and keep_best raise
ValueError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .format.manifest import MANIFEST_NAME
from .resume import step_dirs
from .storage.commit import write_durably
from .storage.leftovers import leftover_name

METRICS_NAME = "metrics.json"
MODES = ("min", "max")
MAX_METRICS_BYTES = 64 << 20


class Metrics:
    """The metrics of a Checkpointer's steps (ROOT/metrics.json), and keep_best."""

    def __init__(self, root: Path, keep_best: int | None, best_metric: str | None,
                 best_mode: str, *, recorded: bool = True) -> None:
        self.root = root
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.recorded = recorded  # False: through fastpersistd
        self.writes = True  # False: a distributed job's rank other than 0
        self._lock = threading.Lock()
        self._by_step, self._replaces = self._read() if recorded else ({}, {})

    @classmethod
    def create(cls, root: Path, keep_best: int | None, best_metric: str | None,
               best_mode: str, *, daemon: bool) -> Metrics:
        """The Checkpointer's Metrics; ValueError for settings that cannot work."""
        if keep_best is not None and (isinstance(keep_best, bool) or not isinstance(
                keep_best, int) or keep_best < 1):
            raise ValueError(f"keep_best must be a whole number >= 1 (or None), not {keep_best!r}")
        if best_mode not in MODES:
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if (keep_best is None) != (best_metric is None):
            raise ValueError("keep_best= and best_metric= go together: keep_best=3, "
                             "best_metric='val_loss' keeps the 3 checkpoints with the best "
                             "val_loss")
        if daemon:
            if keep_best is not None:
                raise ValueError("keep_best= is applied by this process (rank 0 of a "
                                 "distributed job): not through fastpersistd (daemon=)")
            return cls(root, None, None, best_mode, recorded=False)
        return cls(root, keep_best, best_metric, best_mode)

    # -- recording -------------------------------------------------------------

    def record(self, step: int, metrics: Mapping[str, Any] | None, *, disk: bool,
               in_flight: Iterable[int]) -> None:
        """Record step's metrics (durably, before its save begins). disk: the
        save goes to disk (retention counts it: keep_best needs its metric)."""
        if not self.recorded and metrics is not None:
            raise ValueError("metrics= are recorded by this process (rank 0 of a distributed "
                             "job): not through fastpersistd (daemon=)")
        values = _numbers(step, metrics)
        if self.best_metric is not None and disk and self.best_metric not in values:
            given = ", ".join(sorted(values)) or "none"
            raise ValueError(f"save of step {step}: keep_best ranks checkpoints by "
                             f"{self.best_metric!r}, which its metrics= do not give (given: "
                             f"{given}); pass metrics={{{self.best_metric!r}: value}}")
        if not values or not self.writes:
            return
        with self._lock:
            dirs = dict(step_dirs(self.root))
            present = set(dirs) | set(in_flight)
            kept = {s: m for s, m in self._by_step.items() if s in present and s != step}
            replaces = {s: r for s, r in self._replaces.items() if s in present and s != step}
            old = self._by_step.get(step)
            digest = _manifest_digest(dirs[step]) if step in dirs and old else None
            if digest is not None and old is not None:  # an overwrite: see the docstring
                replaces[step] = (digest, old)
            kept[step] = values
            self._write(kept, replaces)
            self._by_step, self._replaces = kept, replaces

    def _write(self, by_step: dict[int, dict[str, float]],
               replaces: dict[int, tuple[str, dict[str, float]]]) -> None:
        data = json.dumps({"format": "fastpersist-metrics", "version": 1,
                           "steps": {str(s): m for s, m in sorted(by_step.items())},
                           "replaces": {str(s): {"manifest_sha256": d, "metrics": m}
                                        for s, (d, m) in sorted(replaces.items())}},
                          indent=1, sort_keys=True).encode()
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            tmp = leftover_name(METRICS_NAME, "tmp")  # fpctl gc knows the name
            try:
                write_durably(tmp, data, dir_fd=fd)
                os.replace(tmp, METRICS_NAME, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read(self) -> tuple[dict[int, dict[str, float]],
                             dict[int, tuple[str, dict[str, float]]]]:
        path = self.root / METRICS_NAME
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_METRICS_BYTES + 1)
        except FileNotFoundError:
            return {}, {}
        try:
            if len(data) > MAX_METRICS_BYTES:
                raise ValueError(f"larger than {MAX_METRICS_BYTES} bytes")
            doc = json.loads(data)
            if doc.get("format") != "fastpersist-metrics":
                raise ValueError("not a fastpersist metrics file")
            return ({int(s): _floats(m) for s, m in doc["steps"].items()},
                    {int(s): (str(r["manifest_sha256"]), _floats(r["metrics"]))
                     for s, r in doc.get("replaces", {}).items()})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(
                f"{path} (the metrics keep_best ranks checkpoints by) cannot be read: {exc}; "
                "it is written atomically, so something else wrote it: move it away to "
                "start the ranking afresh") from exc

    # -- retention -------------------------------------------------------------

    def metrics(self) -> dict[int, dict[str, float]]:
        """The recorded metrics by step (a copy)."""
        with self._lock:
            return {s: dict(m) for s, m in self._by_step.items()}

    def best(self) -> list[Path]:
        """The checkpoints keep_best keeps now, best first: of the committed
        checkpoints under the root with the metric."""
        if self.keep_best is None or self.best_metric is None:
            return []
        sign = 1.0 if self.best_mode == "min" else -1.0
        with self._lock:
            ranked = [(math.isnan(v), 0.0 if math.isnan(v) else sign * v, step, entry)
                      for step, entry in step_dirs(self.root)
                      if (v := self._of(step, entry).get(self.best_metric)) is not None
                      and (entry / MANIFEST_NAME).is_file()]
        return [entry for *_, entry in sorted(ranked)[:self.keep_best]]

    def _of(self, step: int, entry: Path) -> dict[str, float]:
        """The metrics of the checkpoint now at `entry`: the old ones while an
        overwrite's predecessor is still the one there."""
        replaced = self._replaces.get(step)
        if replaced is not None and _manifest_digest(entry) == replaced[0]:
            return replaced[1]
        return self._by_step.get(step, {})


def _manifest_digest(entry: Path) -> str | None:
    try:
        return hashlib.sha256((entry / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError:  # no manifest (not committed) or gone meanwhile
        return None


def _floats(m: Mapping[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in m.items()}


def _numbers(step: int, metrics: Mapping[str, Any] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"save of step {step}: metrics= takes a mapping of names to numbers, "
                        f"not {type(metrics).__name__}")
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"save of step {step}: metric names are strings, not {name!r}")
        try:
            number = float(value)  # a Python or numpy number, a one-element tensor
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"save of step {step}: metric {name!r} is not a number: "
                            f"{value!r}") from exc
        if isinstance(value, bool) or math.isinf(number):
            raise ValueError(f"save of step {step}: metric {name!r} must be a finite number "
                             f"(or NaN), not {value!r}")
        values[name] = number
    return values


__all__ = ["METRICS_NAME", "MODES", "Metrics"]
