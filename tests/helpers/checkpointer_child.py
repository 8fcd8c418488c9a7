"""Fork server for the Checkpointer kill / SIGTERM tests in tests/test_checkpointer.py.

Started once per test module (`python checkpointer_child.py`): it imports torch
and fastpersist, then forks one training-loop process per job it reads on
stdin, so a kill costs a fork instead of a fresh interpreter. It never runs a
torch operation itself, so the forks start clean.

stdin:  one JSON job per line (see run_job)
stdout: "<pid> <event> [args]" lines, each written with one os.write so that
        lines from the server and its children never interleave:
          server: "zygote-ready", "forked PID", "exited PID STATUS"
          child:  "ready", "saved STEP" (Checkpointer.save returned),
                  "done STEP" (future.result() returned: durable),
                  "term" (the SIGTERM handler ran), "closing STEP",
                  "closed STEP committed|aborted", "error JSON-TRACEBACK"

A child runs a Checkpointer loop over steps start, start+1, ...: it fills
tensor i with `step + i * STEP_FRACTION`, calls ckpt.save(step, state), then
overwrites every tensor with -1 (the next "training step" mutates the state
while the save persists), waits for the future, and reports "done STEP".
In "term" mode a SIGTERM handler only sets a flag; the loop then stops after
its next save() and calls ckpt.close(abort=job["abort"]).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

import torch

import fastpersist

STEP_FRACTION = 1 / 16


def emit(msg: str) -> None:
    os.write(1, f"{os.getpid()} {msg}\n".encode())


def run_job(job: dict) -> None:
    # Die with the server, so a crashed test leaves no child behind.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ.update(job.get("env", {}))
    stop = [False]
    if job["mode"] == "term":
        def on_term(signum: int, frame: object) -> None:
            stop[0] = True
            emit("term")

        signal.signal(signal.SIGTERM, on_term)
    # zeros, not empty: the pages are faulted in before "ready".
    tensors = [torch.zeros(job["numel"], dtype=torch.float32) for _ in range(job["tensors"])]
    ckpt = fastpersist.Checkpointer(job["root"], keep_last=job.get("keep_last"),
                                    keep_every=job.get("keep_every"))
    emit("ready")
    step = job["start"]
    while True:
        for i, t in enumerate(tensors):
            t.fill_(step + i * STEP_FRACTION)
        state = {"step": step, "weights": {f"w{i}": t for i, t in enumerate(tensors)},
                 "meta": {"name": f"step{step}"}}
        future = ckpt.save(step, state)
        emit(f"saved {step}")
        for t in tensors:
            t.fill_(-1.0)
        if stop[0]:
            break
        future.result()
        emit(f"done {step}")
        step += 1
    emit(f"closing {step}")
    ckpt.close(abort=bool(job.get("abort")))
    try:
        future.result()
    except fastpersist.CheckpointAbortedError:
        emit(f"closed {step} aborted")
    else:
        emit(f"closed {step} committed")


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
