"""A trainer process for tests/test_daemon_crash.py, killed by the test at a chosen moment.

    python daemon_crash_client.py JOB_JSON

It saves through the daemon named by FASTPERSIST_DAEMON, with its segments in
FASTPERSIST_SHM_DIR (both set by the test), and reports on stdout, one line each
(written with a single os.write, so the test reads whole lines):

  job "handover": async_save(make_state(step), target); "ready" before, then
                  "handed-over" once async_save returned (the daemon owns it), then
                  waits to be killed
  job "block":    the same save, but the snapshot of data file `block_at` (0-based)
                  never finishes: "staging N" as it starts, then waits to be killed
                  (run it with a small FASTPERSIST_STAGING_BUDGET: several files);
                  with "block_stream", the first streamed file (a tensor over half
                  the budget) stops halfway instead: "streaming", then waits
  job "begun":    async_save(make_state(step), target), killing itself (SIGKILL)
                  the moment the daemon's answer to Begin, the checkpoint's id,
                  is in the client's hands: before anything else is sent;
                  "ready" before
  job "segment":  creates a shared-memory segment of `size` bytes, "segment NAME",
                  waits to be killed
  job "loop":     a Checkpointer (daemon mode, keep_last) saving steps start,
                  start+1, ...; "ready", then "saved STEP" each time save() returned
                  (handed over), forever

It dies with the test process (PR_SET_PDEATHSIG) and gives up after LIFETIME
seconds, so a failed test leaves nothing running.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from daemon_crash_state import make_state

import fastpersist

LIFETIME = 120.0


def emit(msg: str) -> None:
    os.write(1, f"{msg}\n".encode())


def wait_for_kill() -> None:
    deadline = time.monotonic() + LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.5)
    emit("gave-up")
    os._exit(3)


def handover(job: dict[str, Any]) -> None:
    state = make_state(job["step"], job["tensors"], job["numel"])
    emit("ready")
    fastpersist.async_save(state, job["target"], compression=job.get("compression"))
    emit("handed-over")
    wait_for_kill()


def block(job: dict[str, Any]) -> None:
    import fastpersist.saving.pipeline as remote
    import fastpersist.saving.segments as segments

    real = remote.stage_file
    calls = [0]

    def stage_file(tensors: Any, buffer: torch.Tensor, pinned: bool) -> Any:
        n = calls[0]
        calls[0] += 1
        if n == job["block_at"]:
            emit(f"staging {n}")
            wait_for_kill()
        return real(tensors, buffer, pinned)

    real_chunks = segments._chunks

    def chunks(order: Any) -> Any:
        # An unstaged (streamed) file: send half of its first tensor, then hang.
        for chunk in real_chunks(order):
            if job.get("block_stream"):
                yield chunk[:len(chunk) // 2]
                emit("streaming")
                wait_for_kill()
            yield chunk

    remote.stage_file = stage_file
    segments._chunks = chunks
    state = make_state(job["step"], job["tensors"], job["numel"])
    emit("ready")
    fastpersist.async_save(state, job["target"])
    emit("handed-over")  # the test fails on this: the block did not happen
    wait_for_kill()


def begun(job: dict[str, Any]) -> None:
    from fastpersist.protocol.client import DaemonClient

    # Whichever call hands the client its checkpoint id: Begin, or Open (Begin
    # whose reply is the checkpoint's progress stream).
    for name in ("begin", "open"):
        real = getattr(DaemonClient, name, None)
        if real is None:
            continue

        def answered(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            _real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(DaemonClient, name, answered)
    state = make_state(job["step"], job["tensors"], job["numel"])
    emit("ready")
    fastpersist.async_save(state, job["target"])
    emit("handed-over")  # the test fails on this: the kill did not happen
    wait_for_kill()


def segment(job: dict[str, Any]) -> None:
    from fastpersist.protocol import shm

    seg = shm.Segment(shm.shm_dir(), job["size"])
    assert seg.map is not None
    seg.map[:4] = b"live"
    emit(f"segment {seg.name}")
    wait_for_kill()


def loop(job: dict[str, Any]) -> None:
    ckpt = fastpersist.Checkpointer(job["root"], keep_last=job["keep_last"])
    emit("ready")
    step = job["start"]
    while True:
        ckpt.save(step, make_state(step, job["tensors"], job["numel"]))
        emit(f"saved {step}")
        step += 1


def main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    job = json.loads(sys.argv[1])
    {"handover": handover, "block": block, "begun": begun, "segment": segment,
     "loop": loop}[job["kind"]](job)


if __name__ == "__main__":
    main()
