"""Issue 35, every-step memory-only checkpoints: what fastpersistd's memory-only
save would still cost with no copy into the memory tier (the bound of the
ownership swap), against today's copy. Needs memory_swap_bound.patch applied
(an experiment, never committed: FP_EXP_NOCOPY=crc makes the tier's copy a
CRC32C of the trainer's segment and nothing else; =none skips even that).
From the repository root, with the patch applied:

    PYTHONPATH=. python benchmarks/results/cpu-2026-12-04/memory_swap_bound.py MODE [SAVES]

(MODE: copy, crc, none or floor.)

Prints the daemon's and the trainer's CPU time per save (saves 3..SAVES; the
first two warm the staging) and the median wall time of a save; floor: the
copy floor's (train_overhead.py's: the tensors copied into preallocated
buffers), no daemon.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
from _state import build_state, make_spec

import fastpersist


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        ticks = f.read().rpartition(")")[2].split()
    return (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")


def floor(saves: int) -> None:
    sys.path.insert(0, "examples")
    from gpt import tensors_of

    state = build_state(make_spec(313 << 20))
    tensors = tensors_of(state)
    buffers = [t.clone() for t in tensors]
    walls: list[float] = []
    trainer0 = 0.0
    for step in range(saves):
        if step == 2:
            trainer0 = time.process_time()
        t = time.perf_counter()
        for buf, src in zip(buffers, tensors, strict=True):
            buf.copy_(src)
        walls.append(time.perf_counter() - t)
    trainer = (time.process_time() - trainer0) / (saves - 2)
    print(f"floor: trainer CPU {trainer * 1000:.0f} ms/copy, "
          f"wall median {statistics.median(walls[2:]) * 1000:.0f} ms")


def main() -> None:
    exp = sys.argv[1]
    saves = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    if exp == "floor":
        floor(saves)
        return
    work = Path(tempfile.mkdtemp(prefix="fp-swapbound-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="fp-swapbound-", dir="/dev/shm"))
    os.environ["FASTPERSIST_SHM_DIR"] = str(shm)
    env = dict(os.environ, FP_EXP_NOCOPY="" if exp == "copy" else exp)
    root, sock = work / "root", work / "d.sock"
    root.mkdir()
    state = build_state(make_spec(313 << 20))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket", str(sock),
         "--shm-dir", str(shm), "--memory-tier-count", "2", "--memory-tier-bytes",
         str(1100 << 20), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not sock.exists():
            time.sleep(0.05)
        ck = fastpersist.Checkpointer(root / "run", daemon=f"unix://{sock}", memory_every=1,
                                      disk_every=1 << 62)
        walls: list[float] = []
        daemon0 = trainer0 = 0.0
        for step in range(saves):
            if step == 2:
                daemon0, trainer0 = cpu(proc.pid), time.process_time()
            t = time.perf_counter()
            ck.save(step, state).result()
            walls.append(time.perf_counter() - t)
        n = saves - 2
        daemon = (cpu(proc.pid) - daemon0) / n
        trainer = (time.process_time() - trainer0) / n
        ck.close()
        wall = statistics.median(walls[2:])
        print(f"{exp}: daemon CPU {daemon * 1000:.0f} ms/save, trainer CPU "
              f"{trainer * 1000:.0f} ms/save, wall median {wall * 1000:.0f} ms")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
