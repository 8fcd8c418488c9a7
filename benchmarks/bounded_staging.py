"""async_save of a state larger than half of RAM through a bounded staging budget.

    python benchmarks/bounded_staging.py                   # 16 GiB state, 2 GiB budget, 5 repeats
    python benchmarks/bounded_staging.py --gib 4 --budget-gib 0.5 --repeats 3

Each repeat is a fresh process that builds the state (fp32 tensors), then,
alternating which goes first: fastpersist.async_save with
FASTPERSIST_STAGING_BUDGET set (the caller's stall, the time until the save is
durable, and the process's peak RSS beyond the state), and a blocking
fastpersist.save of the same state (no staging: written from the tensors), the
reference for "durable". With staging much smaller than the state, the caller
waits for the writes of all but the last files (it cannot copy ahead of them
without more memory): the point is that memory stays at the budget and the
save runs at disk speed, not that the stall is short. Target (issue 14, part 4):
peak RSS <= budget + 256 MiB; durable within 1.2x the blocking save.
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

from _system import peak_rss_bytes, reset_peak_rss, rss_bytes
from async_stall import spread

GIB = 1 << 30
MIB = 1 << 20


def child(args: argparse.Namespace) -> None:
    """One fresh process: one async_save and one save, as one JSON line."""
    os.environ["FASTPERSIST_STAGING_BUDGET"] = str(int(args.budget_gib * GIB))
    import torch

    import fastpersist

    per = int(args.gib * GIB) // args.tensors // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.empty(per).normal_(generator=gen) for i in range(args.tensors)}
    base = Path(args.dir)
    row: dict[str, float] = {}

    def bounded() -> None:
        if not reset_peak_rss():  # VmHWM := VmRSS: the peak of this save alone
            raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs)")
        before = rss_bytes()
        start = time.perf_counter()
        future = fastpersist.async_save(state, base / "async")
        row["stall"] = time.perf_counter() - start
        future.result()
        row["durable"] = time.perf_counter() - start
        row["peak_mib"] = (peak_rss_bytes() - before) / MIB
        shutil.rmtree(base / "async")

    def blocking() -> None:
        start = time.perf_counter()
        fastpersist.save(state, base / "sync")
        row["save"] = time.perf_counter() - start
        shutil.rmtree(base / "sync")

    for step in ((bounded, blocking) if args.first == "async" else (blocking, bounded)):
        step()
    print(json.dumps(row))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=16.0, help="state size in GiB (default 16)")
    p.add_argument("--budget-gib", type=float, default=2.0,
                   help="FASTPERSIST_STAGING_BUDGET in GiB (default 2)")
    p.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes (default 5)")
    p.add_argument("--dir", help="checkpoint directory (default: a new one under /var/tmp)")
    p.add_argument("--json", type=Path, help="write every measurement to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", default="async", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    work = Path(args.dir or tempfile.mkdtemp(prefix="fp-bounded-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for k in range(args.repeats):
            first = "async" if k % 2 == 0 else "sync"  # alternate, for drift on a shared disk
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--gib", str(args.gib), "--budget-gib",
                 str(args.budget_gib), "--tensors", str(args.tensors), "--dir", str(work),
                 "--first", first], check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            print(f"  [{k + 1}/{args.repeats}] stall {row['stall']:.2f} s, durable "
                  f"{row['durable']:.2f} s, blocking save {row['save']:.2f} s, peak "
                  f"+{row['peak_mib']:.0f} MiB", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    nbytes = int(args.gib * GIB) // args.tensors // 4 * 4 * args.tensors
    budget_mib = args.budget_gib * GIB / MIB
    durable = [r["durable"] for r in rows]
    save = [r["save"] for r in rows]
    peak = [r["peak_mib"] for r in rows]
    ratio = statistics.median(durable) / statistics.median(save)
    print(f"\n{nbytes / GIB:.3g} GiB state, staging budget {budget_mib:.0f} MiB, medians of "
          f"{len(rows)} fresh processes [min-max]:")
    print(f"  async_save stall            {spread([r['stall'] for r in rows], fmt='.2f')} s")
    print(f"  async_save until durable    {spread(durable, fmt='.2f')} s "
          f"({nbytes / statistics.median(durable) / 1e9:.2f} GB/s)")
    print(f"  blocking save (reference)   {spread(save, fmt='.2f')} s")
    print(f"  peak RSS beyond the state   {spread(peak)} MiB")
    print(f"  {'PASS' if max(peak) <= budget_mib + 256 else 'MISS'}  peak RSS <= budget + 256 MiB")
    print(f"  {'PASS' if ratio <= 1.2 else 'MISS'}  durable / blocking save "
          f"{ratio:.2f}x (target <= 1.2x)")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
