"""How the memory an O_DIRECT read lands in changes the disk's requests and speed.

    python benchmarks/read_memory.py                  # a 1 GiB file, 7 rounds
    python benchmarks/read_memory.py --size-gib 2 --repeats 9 --json out.json

In one process, the engine reads the same file with O_DIRECT (FASTPERSIST_THREADS
reads of FASTPERSIST_BLOCK_SIZE, as a load reads a file), page cache dropped
before each read, into memory of three kinds, alternating within each round:

- reused: 4 KiB pages mapped and written before the first round and reused
  every round (as fio's ceiling reads into one buffer allocated once);
- fresh: 4 KiB pages mapped and written (MAP_POPULATE) right before the read,
  as a load's new tensors are, after the drop of the page cache freed memory;
- huge: a fresh mapping with MADV_HUGEPAGE (2 MiB pages), written before the read.

Whether 4 KiB pages lie together in physical memory depends on what the kernel
had free when they were mapped, so "reused" and "fresh" can come out either
way; huge pages are contiguous by construction.

For each read it records the time and, from /sys/block/DEV/stat, the requests
the block device completed and their average size. A read is split into
requests of at most max_sectors_kb and of at most max_segments runs of
physically contiguous memory; pages scattered in physical memory make one run
each. Medians [min-max]. Needs root (drop_caches) and a file system that takes
O_DIRECT.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KINDS = ("reused", "fresh", "huge")
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def device_of(path: Path) -> Path | None:
    """/sys/block/DEV of the disk that holds `path` (its whole disk for a partition)."""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sys_dev.exists():
        return None
    real = sys_dev.resolve()
    return real if (real / "queue").exists() else real.parent


def reads_done(dev: Path) -> tuple[int, int]:
    """(read requests completed, 512-byte sectors read) so far."""
    fields = (dev / "stat").read_text().split()
    return int(fields[0]), int(fields[2])


def mapping(kind: str, nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if kind != "huge":
        return mmap.mmap(-1, nbytes, flags=flags | getattr(mmap, "MAP_POPULATE", 0))
    m = mmap.mmap(-1, nbytes, flags=flags)
    m.madvise(_MADV_HUGEPAGE)
    memoryview(m)[:] = bytes(nbytes)  # fault every page in now, off the clock
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from _system import drop_page_cache

    from fastpersist.engine import get_engine

    nbytes = int(args.size_gib * 2**30) // 2**20 * 2**20
    engine = get_engine()
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="fp-read-memory-"))
    try:
        target = work / "data"
        data = mapping("fresh", nbytes)
        memoryview(data)[:] = os.urandom(1 << 20) * (nbytes >> 20)
        engine.write_file(str(target), [(memoryview(data), 0)], nbytes)
        data.close()
        dev = device_of(target)
        queue = {k: (dev / "queue" / k).read_text().strip()
                 for k in ("max_sectors_kb", "max_segments")} if dev else {}
        reused = mapping("fresh", nbytes)  # mapped once, before every round
        rows: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
        for r in range(args.repeats):
            for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                memory = reused if kind == "reused" else mapping(kind, nbytes)
                drop_page_cache([target])
                before = reads_done(dev) if dev else (0, 0)
                start = time.perf_counter()
                result = engine.read_file(str(target), [(memoryview(memory), 0)], checksum=False,
                                          region=(memoryview(memory), 0))
                seconds = time.perf_counter() - start
                after = reads_done(dev) if dev else (0, 0)
                requests = after[0] - before[0]
                kib = (after[1] - before[1]) / 2 / max(requests, 1)
                rows[kind].append({"seconds": seconds, "requests": requests,
                                   "direct": result.direct, "kib_per_request": kib})
                if memory is not reused:
                    memory.close()
        print(f"{nbytes / 2**30:.2f} GiB file on {dev.name if dev else '?'} {queue}; "
              f"{args.repeats} rounds; medians [min-max]")
        print(f"{'memory':6} {'GB/s':>22} {'requests':>18} {'KiB per request':>24}")
        summary: dict[str, Any] = {}
        for kind, runs in rows.items():
            speeds = [nbytes / x["seconds"] / 1e9 for x in runs]
            reqs = [x["requests"] for x in runs]
            sizes = [x["kib_per_request"] for x in runs]
            summary[kind] = {"gbps": statistics.median(speeds), "requests": statistics.median(reqs),
                             "kib_per_request": statistics.median(sizes)}
            print(f"{kind:6} {statistics.median(speeds):6.2f} [{min(speeds):.2f}-{max(speeds):.2f}]"
                  f"{statistics.median(reqs):8.0f} [{min(reqs)}-{max(reqs)}]"
                  f"{statistics.median(sizes):10.0f} [{min(sizes):.0f}-{max(sizes):.0f}]")
        if not all(x["direct"] for runs in rows.values() for x in runs):
            print("note: the file system refused O_DIRECT; these reads were buffered")
        if args.json:
            args.json.write_text(json.dumps({"argv": sys.argv, "bytes": nbytes, "queue": queue,
                                             "runs": rows, "summary": summary}, indent=2))
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
