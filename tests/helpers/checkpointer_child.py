"""Fork server for the Checkpointer kill / SIGTERM tests in tests/test_checkpointer.py.

`python checkpointer_child.py` serves (forkserver.serve) one training-loop
process per job; its events, besides forkserver's:
  "ready", "saved STEP" (Checkpointer.save returned),
  "done STEP" (future.result() returned: durable),
  "term" (the SIGTERM handler ran), "closing STEP",
  "closed STEP committed|aborted"

A child runs a Checkpointer loop over steps start, start+1, ...: it fills
tensor i with `step + i * STEP_FRACTION`, calls ckpt.save(step, state), then
overwrites every tensor with -1 (the next "training step" mutates the state
while the save persists), waits for the future, and reports "done STEP".
In "term" mode a SIGTERM handler only sets a flag; the loop then stops after
its next save() and calls ckpt.close(abort=job["abort"]).
"""

from __future__ import annotations

import signal

import torch
from forkserver import emit, serve

import fastpersist

STEP_FRACTION = 1 / 16


def run_job(job: dict) -> None:
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


if __name__ == "__main__":
    serve(run_job)
