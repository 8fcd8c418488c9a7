"""Fork server for the SIGKILL tests in tests/test_durability.py.

Started once per test module (`python kill_saver.py`): it imports torch and
fastpersist, then forks one saver process per job it reads on stdin, so a kill
costs a fork instead of a fresh interpreter. It never runs a torch operation
itself, so the forks start clean.

stdin:  one JSON job per line (see run_job)
stdout: "<pid> <event> [args]" lines, each written with one os.write so that
        lines from the server and its savers never interleave:
          server: "zygote-ready", "forked PID", "exited PID STATUS"
          saver:  "ready", "start V", "done V SECONDS", "hook NAME", "error JSON-TRACEBACK"

A saver saves versions start, start+1, ... of a state over the same target
(forever unless the job has a count) and reports each version once save()
has returned. Tensor i of version v is filled with v + i * step.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

import fastpersist
import fastpersist.commit as commit


def emit(msg: str) -> None:
    os.write(1, f"{os.getpid()} {msg}\n".encode())


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
    # Die with the server, so a crashed test leaves no saver hanging in a hook.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ.update(job.get("env", {}))
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


def main() -> None:
    emit("zygote-ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(0)
                run_job(job)
            except BaseException:
                emit("error " + json.dumps(traceback.format_exc()))
                code = 1
            os._exit(code)
        emit(f"forked {pid}")
        _, status = os.waitpid(pid, 0)
        emit(f"exited {pid} {status}")


if __name__ == "__main__":
    main()
