"""Fork server for the SIGKILL tests in tests/test_durability.py.

`python kill_saver.py` serves (forkserver.serve) one saver process per job;
its events, besides forkserver's:
  "ready", "start V", "done V SECONDS", "hook NAME"

A saver saves versions start, start+1, ... of a state over the same target
(forever unless the job has a count) and reports each version once save()
has returned. Tensor i of version v is filled with v + i * step.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import torch
from forkserver import emit, serve

import fastpersist
import fastpersist.storage.commit as commit


def hang(name: str) -> None:
    """Report that the save reached a hook, then wait for the SIGKILL."""
    emit(f"hook {name}")
    while True:
        time.sleep(60)


def _no_exchange(a: Path, b: Path) -> None:
    raise OSError(errno.EINVAL, "RENAME_EXCHANGE not supported (test)", str(a))


def install_hook(hook: str, target: Path, armed: list[bool]) -> None:
    """Make the save stop (and wait to be killed) at one moment of the commit."""
    if hook == "before_manifest":
        real_write = commit.write_durably

        def write_durably(path: Path, data: bytes) -> None:
            if armed[0]:
                hang(hook)
            real_write(path, data)

        commit.write_durably = write_durably
    elif hook == "before_publish":
        real_publish = commit.Staging._publish

        def publish(self: commit.Staging) -> bool:
            if armed[0]:
                hang(hook)
            return real_publish(self)

        commit.Staging._publish = publish  # type: ignore[method-assign]
    elif hook == "after_exchange":
        real_exchange = commit._exchange

        def exchange(a: Path, b: Path) -> None:
            real_exchange(a, b)
            if armed[0]:
                hang(hook)

        commit._exchange = exchange
    elif hook == "between_renames":
        real_rename = os.rename

        def rename(src: object, dst: object, *args: object, **kwargs: object) -> None:
            real_rename(src, dst, *args, **kwargs)  # type: ignore[arg-type]
            if armed[0] and Path(str(src)) == target and ".fp-old-" in str(dst):
                hang(hook)

        os.rename = rename  # type: ignore[assignment]
    elif hook == "during_rmtree":
        real_rmtree = shutil.rmtree

        def rmtree(path: object, *args: object, **kwargs: object) -> None:
            p = Path(str(path))
            if armed[0] and ".fp-" in p.name:
                # Half-deleted: the data file is gone, the manifest is still there.
                for f in p.iterdir():
                    if f.name != "manifest.json":
                        f.unlink()
                hang(hook)
            real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

        shutil.rmtree = rmtree  # type: ignore[assignment]
    elif hook:
        raise ValueError(f"unknown hook {hook!r}")


def run_job(job: dict) -> None:
    target = Path(job["target"])
    if job.get("no_exchange"):
        commit._exchange = _no_exchange
    armed = [False]
    install_hook(job.get("hook") or "", target, armed)
    step = float(job["step"])
    # zeros, not empty: the pages are faulted in before "ready", so the kill
    # delays, counted from "ready", fall on fills and saves alone.
    tensors = [torch.zeros(job["numel"], dtype=torch.float32) for _ in range(job["tensors"])]
    emit("ready")
    version = job["start"]
    count = job.get("count")
    while count is None or version < job["start"] + count:
        armed[0] = job.get("hook_from") is not None and version >= job["hook_from"]
        for i, t in enumerate(tensors):
            t.fill_(version + i * step)
        state = {
            "version": version,
            "weights": {f"w{i}": t for i, t in enumerate(tensors)},
            "meta": {"step": version * 10, "name": f"v{version}"},
        }
        emit(f"start {version}")
        t0 = time.perf_counter()
        fastpersist.save(state, target)
        emit(f"done {version} {time.perf_counter() - t0:.6f}")
        version += 1


if __name__ == "__main__":
    serve(run_job)
