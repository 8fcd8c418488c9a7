"""The caller's stall of the first few async_saves in a fresh process, against a plain copy.

    python benchmarks/async_stall.py                         # 1.08 GB in 83 tensors, 5 processes
    python benchmarks/async_stall.py --bytes 4e9 --tensors 300 --saves 6 --repeats 7
    python benchmarks/async_stall.py --prepare both          # with and without prepare_staging

Each repeat is a fresh process (staging starts cold, as in a new training job)
that builds the state and then, per save: the copy floor, a plain torch copy of
the same tensors into preallocated buffers that were touched when they were
made (the better of one just before and one just after the save); then
fastpersist.async_save (its stall: the time until it returns) and a
wait for the save to finish, so that no save waits for the one before it. It
also counts, per save, the staging buffers the saver allocated and the minor
page faults of the calling thread during the stall. The report gives, per
save index, the median over processes with min and max, and the ratio
stall / floor (target: <= 1.1x from the second save on, issue 14).
--prepare yes calls fastpersist.prepare_staging(state) before the first save
(timed apart); --prepare both alternates processes without and with it and
reports each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 1.1  # stall / floor, from the second save on


def thread_minor_faults() -> int:
    with open("/proc/thread-self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def child(args: argparse.Namespace) -> None:
    """One fresh process: the measurements of each save, as one JSON line."""
    import torch

    import fastpersist
    from fastpersist.api import pipeline_for

    gen = torch.Generator().manual_seed(0)
    per = max(1, int(args.bytes) // args.tensors // 4)
    state = {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(args.tensors)}
    floor_buffers = [torch.empty_like(t) for t in state.values()]
    for buf in floor_buffers:
        buf.fill_(0)  # touched: the floor pays no page faults
    saver = pipeline_for()  # the pipeline async_save uses
    pool: Any = saver.pool
    allocations = [0]
    allocate = pool._allocate

    def counting(nbytes: int, pinned: bool) -> Any:
        allocations[0] += 1
        return allocate(nbytes, pinned)

    pool._allocate = counting  # counted the same way for any version of the pool
    prepare_s = None
    if args.prepare == "yes":
        start = time.perf_counter()
        fastpersist.prepare_staging(state)
        prepare_s = time.perf_counter() - start
    def copy_floor() -> float:
        start = time.perf_counter()
        for buf, t in zip(floor_buffers, state.values(), strict=True):
            buf.copy_(t)
        return time.perf_counter() - start

    rows = []
    for k in range(args.saves):
        floor = copy_floor()
        before_alloc, before_faults = allocations[0], thread_minor_faults()
        start = time.perf_counter()
        future = fastpersist.async_save(state, Path(args.dir) / f"ckpt-{k}")
        stall = time.perf_counter() - start
        faults = thread_minor_faults() - before_faults
        future.result()
        durable = time.perf_counter() - start
        floor = min(floor, copy_floor())  # the better of the copies just before and after
        rows.append({"save": k, "stall": stall, "durable": durable, "floor": floor,
                     "faults": faults,
                     "allocations": allocations[0] - before_alloc})
        shutil.rmtree(Path(args.dir) / f"ckpt-{k}")
    print(json.dumps({"rows": rows, "staging": saver.staging_bytes, "prepare": prepare_s,
                      "state": sum(t.nbytes for t in state.values())}))


def spread(values: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    med = statistics.median(values) * scale
    return f"{med:{fmt}} [{min(values) * scale:{fmt}}-{max(values) * scale:{fmt}}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bytes", type=float, default=1.08e9, help="state bytes (default 1.08e9)")
    p.add_argument("--tensors", type=int, default=83, help="tensors in the state (default 83)")
    p.add_argument("--saves", type=int, default=4, help="saves per process (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes (default 5)")
    p.add_argument("--dir", help="checkpoint directory (default: a new one under /var/tmp)")
    p.add_argument("--json", type=Path, help="write every measurement to this file")
    p.add_argument("--prepare", choices=("no", "yes", "both"), default="no",
                   help="call prepare_staging before the first save (both: alternate)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    base = Path(args.dir or tempfile.mkdtemp(prefix="fp-stall-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"command: {' '.join(sys.argv)}")
    print(f"state: {args.bytes / 1e9:.2f} GB in {args.tensors} fp32 tensors; {args.saves} saves "
          f"per fresh process, {args.repeats} processes; dir {base}", flush=True)
    variants = ["no", "yes"] if args.prepare == "both" else [args.prepare]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for r in range(args.repeats):
            for variant in variants:
                cmd = [sys.executable, __file__, "--child", "--bytes", str(args.bytes),
                       "--tensors", str(args.tensors), "--saves", str(args.saves), "--dir",
                       str(base), "--prepare", variant]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1")).stdout
                run = json.loads(out.strip().splitlines()[-1])
                results[variant].append(run)
                label = " prepared" if variant == "yes" else ""
                print(f"  [{r + 1}/{args.repeats}]{label} stall ms " + "  ".join(
                    f"{row['stall'] * 1000:.0f} (floor {row['floor'] * 1000:.0f}, "
                    f"{row['allocations']} alloc, {row['faults']} faults)"
                    for row in run["rows"]), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    for variant, runs in results.items():
        report(args, runs, prepared=variant == "yes")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "runs": results["no"] if
                                         args.prepare == "no" else results}, indent=1))
    return 0


def report(args: argparse.Namespace, runs: list[dict[str, Any]], prepared: bool) -> None:
    if prepared:
        print("\n== after fastpersist.prepare_staging(state), which took "
              f"{spread([run['prepare'] for run in runs], 1000)} ms")
    print("\n== async_save stall per save in a fresh process: median [min-max] over processes")
    print(f"  {'save':>4} {'stall ms':>18} {'floor ms':>18} {'stall / floor':>20} "
          f"{'allocations':>12} {'caller faults':>22}")
    for k in range(args.saves):
        rows = [run["rows"][k] for run in runs]
        ratios = [row["stall"] / row["floor"] for row in rows]
        print(f"  {k + 1:>4} {spread([x['stall'] for x in rows], 1000):>18} "
              f"{spread([x['floor'] for x in rows], 1000):>18} {spread(ratios, 1, '.2f'):>20} "
              f"{spread([x['allocations'] for x in rows]):>12} "
              f"{spread([x['faults'] for x in rows]):>22}")
    later = [run["rows"][k]["stall"] / run["rows"][k]["floor"] for run in runs
             for k in range(1, args.saves)]
    if later:
        med = statistics.median(later)
        verdict = "PASS" if med <= TARGET else "MISS"
        print(f"  {verdict}  saves 2..{args.saves}: stall / floor median {med:.2f} "
              f"[{min(later):.2f}-{max(later):.2f}], target <= {TARGET}x")
    staging = statistics.median(run["staging"] / run["state"] for run in runs)
    print(f"  staging memory: {staging:.2f}x the state")


if __name__ == "__main__":
    raise SystemExit(main())
