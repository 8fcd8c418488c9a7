"""Durable save through fastpersistd with the memory tier off vs on (issue 35, item 1:
the copy's cost): the same state, interleaved rounds (round 0 warms the staging and
is not counted), medians. From the repository root:

    PYTHONPATH=. python benchmarks/results/cpu-2026-12-04/memory_tier_save_cost.py 1 5
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


def main() -> None:
    size, rounds = float(sys.argv[1]), int(sys.argv[2])
    work = Path(tempfile.mkdtemp(prefix="fp-savecost-", dir="."))
    shm = Path(tempfile.mkdtemp(prefix="fp-savecost-", dir="/dev/shm"))
    os.environ["FASTPERSIST_SHM_DIR"] = str(shm)
    daemons = {}
    for name, count in (("tier_off", "0"), ("tier_on", "1")):
        root = work / name
        root.mkdir()
        sock = work / f"{name}.sock"
        p = subprocess.Popen(
            [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket",
             str(sock), "--shm-dir", str(shm), "--memory-tier-count", count,
             "--memory-tier-bytes", "8G", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not sock.exists():
            time.sleep(0.05)
        daemons[name] = (p, root, f"unix://{sock.resolve()}")
    state = build_state(make_spec(int(size * (1 << 30))))
    times: dict[str, list[float]] = {n: [] for n in daemons}
    try:
        for r in range(rounds + 1):
            for n in list(daemons) if r % 2 == 0 else list(reversed(daemons)):
                _, root, addr = daemons[n]
                t = time.perf_counter()
                fastpersist.save(state, root / f"step-{r}", daemon=addr)
                dt = time.perf_counter() - t
                if r:
                    times[n].append(dt)
                print(f"round {r} {n}: {dt:.3f} s", flush=True)
                shutil.rmtree(root / f"step-{r - 1}", ignore_errors=True)
    finally:
        for p, _, _ in daemons.values():
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    for n, v in times.items():
        m = statistics.median(v)
        print(f"{n}: median {m:.3f} s (min {min(v):.3f}, max {max(v):.3f}), "
              f"{size / m:.2f} GiB/s")
    on, off = (statistics.median(times[n]) for n in ("tier_on", "tier_off"))
    print(f"tier_on / tier_off: {on / off:.3f}x")


if __name__ == "__main__":
    main()
