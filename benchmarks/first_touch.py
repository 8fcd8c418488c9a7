"""What fresh memory costs here, with and without huge pages, and what that does to a cold load.

    python benchmarks/first_touch.py                   # 1 GiB, 7 rounds
    python benchmarks/first_touch.py --size-gib 4 --repeats 9 --json out.json

A load puts the tensors in new memory, and the kernel zeroes each page on its
first touch; fio's ceiling reuses one buffer and never pays that. Each
measurement is a fresh process, the modes alternate within each round:

- touch: map `--size-gib` of private anonymous memory, with MADV_HUGEPAGE
  ("huge") or without ("small"), and write every byte once (the first touch),
  then once more (the same memory, already in: the machine's memset speed);
- load: a cold fastpersist.load (page cache dropped) of the benchmarks'
  GPT-style state of that size, with FASTPERSIST_HUGE_PAGES=on and =off,
  fastpersist imported before the clock starts.

It also says whether this machine is a VM whose balloon reports free memory to
its host (anonmem.reports_free_pages), the case in which fastpersist's default
(FASTPERSIST_HUGE_PAGES=auto) does not ask for huge pages. Medians [min-max].
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TOUCH = r"""
import ctypes, mmap, sys, time
n, huge = int(sys.argv[1]), sys.argv[2] == "huge"
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if huge:
    m.madvise(mmap.MADV_HUGEPAGE)
buf = (ctypes.c_char * n).from_buffer(m)
t = time.perf_counter(); ctypes.memset(buf, 1, n); first = time.perf_counter() - t
t = time.perf_counter(); ctypes.memset(buf, 2, n); again = time.perf_counter() - t
print(first, again)
del buf
"""

LOAD = r"""
import resource, sys, time
import fastpersist, fastpersist.api, fastpersist.tensors.checkpoint  # imports off the clock
sys.path.insert(0, sys.argv[2])
from _system import drop_page_cache
drop_page_cache([__import__("pathlib").Path(sys.argv[1])])
r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter(); state = fastpersist.load(sys.argv[1]); seconds = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(seconds, r1.ru_stime - r0.ru_stime)
"""


def run(code: str, *args: str, env: dict[str, str] | None = None) -> list[float]:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, text=True,
                         capture_output=True, env=env).stdout
    return [float(x) for x in out.split()]


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    nbytes = int(args.size_gib * 2**30)

    from _state import build_state, make_spec

    import fastpersist
    from fastpersist.anonmem import reports_free_pages

    work = Path(tempfile.mkdtemp(prefix="fp-first-touch-", dir=args.dir))
    samples: dict[str, list[float]] = {k: [] for k in (
        "touch:huge", "touch:small", "again:huge", "again:small",
        "load:on", "load:off", "sys:on", "sys:off")}
    try:
        ckpt = work / "ckpt"
        fastpersist.save(build_state(make_spec(nbytes, seed=0)), ckpt)
        state_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
        for r in range(args.repeats):
            for mode in ("huge", "small") if r % 2 == 0 else ("small", "huge"):
                first, again = run(TOUCH, str(nbytes), mode)
                samples[f"touch:{mode}"].append(first)
                samples[f"again:{mode}"].append(again)
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                env = dict(os.environ, FASTPERSIST_HUGE_PAGES=mode)
                seconds, sys_cpu = run(LOAD, str(ckpt), str(HERE), env=env)
                samples[f"load:{mode}"].append(seconds)
                samples[f"sys:{mode}"].append(sys_cpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = nbytes / 1e9
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{args.size_gib:g} GiB, {args.repeats} rounds, medians [min-max]; this machine "
          f"{'reports' if reports_free_pages() else 'does not report'} free pages to a host")
    for mode in ("huge", "small"):
        rates = [gb / s for s in samples[f"touch:{mode}"]]
        again = [gb / s for s in samples[f"again:{mode}"]]
        print(f"  first touch, {mode:5s} pages  {statistics.median(rates):6.2f} GB/s "
              f"[{min(rates):.2f}-{max(rates):.2f}]   second write "
              f"{statistics.median(again):6.2f} GB/s")
    for mode in ("on", "off"):
        print(f"  cold load, FASTPERSIST_HUGE_PAGES={mode:3s} {summary(samples[f'load:{mode}'])} s"
              f"  ({state_bytes / med[f'load:{mode}'] / 1e9:.2f} GB/s; system CPU "
              f"{summary(samples[f'sys:{mode}'])} s)")
    print(f"  huge pages on / off: load time {med['load:on'] / med['load:off']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"size_bytes": nbytes, "state_bytes": state_bytes,
                                         "reports_free_pages": reports_free_pages(),
                                         "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
