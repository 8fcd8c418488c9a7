"""A training loop that checkpoints every step and exits on SIGTERM through
fastpersist.exit_on_preemption (tests/test_preemption.py sends the signal).

argv: ROOT MARKERS GRACE. Through fastpersistd when FASTPERSIST_DAEMON is set.
Each step appends "entered N" to MARKERS before Checkpointer.save(N) and
"returned N" after it returns; the state of step N holds N in every element.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

import fastpersist

MIB = 1 << 20


def state_of(step: int) -> dict[str, object]:
    return {"step": step,
            "model": {f"w{i}": torch.full((4 * MIB // 4,), float(step)) for i in range(8)},
            "opt": {"lr": 0.1, "m": torch.full((1000,), float(step))}}


def main() -> None:
    root, markers, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fastpersist.exit_on_preemption(grace=grace)
    ckpt = fastpersist.Checkpointer(root, keep_last=3)
    fd = os.open(markers, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    print("ready", flush=True)
    rng = random.Random(os.getpid())
    step = 0
    while True:
        step += 1
        time.sleep(rng.uniform(0.0, 0.03))  # "training"
        os.write(fd, f"entered {step}\n".encode())
        ckpt.save(step, state_of(step))
        os.write(fd, f"returned {step}\n".encode())


if __name__ == "__main__":
    main()
