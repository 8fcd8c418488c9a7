"""The load ring's cost per tensor: many small tensors read to a device.

    python benchmarks/ring_tensors.py                       # 100,000 tensors, CPU, 7 repeats
    python benchmarks/ring_tensors.py --device cuda:0       # on a GPU

tensors/device_load.read_to_device of a state of many small tensors (the
443 MiB, 100,000-tensor state of save_load.py --tensors), with small tensors
that lie together sharing one device allocation and one copy (the default)
vs one allocation and one copy per tensor (SHARED_BELOW=0, the path before),
alternating, page cache warm: what is measured is the per-tensor work, not
the disk. On the CPU the ring's copies are synchronous memcpys, so the CPU
figure is a floor on what a GPU saves (there each copy is also a launch).
Medians [min-max] of --repeats.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _state import SMALL_TENSOR_BYTES, build_state, many_spec

import fastpersist
from fastpersist.engine import get_engine
from fastpersist.tensors import checkpoint, device_load


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ring-bytes", type=int, default=256 << 20)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    args = p.parse_args()
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="fp-ring-", dir=args.dir))
    try:
        fastpersist.save(build_state(many_spec(args.tensors, SMALL_TENSOR_BYTES)), work / "c")
        manifest = checkpoint.read_manifest(work / "c")
        default = device_load.SHARED_BELOW
        times: dict[str, list[float]] = {"shared": [], "each": []}
        for r in range(args.repeats):
            for mode in ("shared", "each") if r % 2 == 0 else ("each", "shared"):
                device_load.SHARED_BELOW = default if mode == "shared" else 0
                start = time.perf_counter()
                out = device_load.read_to_device(work / "c", manifest, get_engine(), device,
                                                 verify=True, ring_bytes=args.ring_bytes)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[mode].append(time.perf_counter() - start)
                del out
        device_load.SHARED_BELOW = default
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.tensors} tensors to {device}, medians of {args.repeats} [min-max]:")
    for mode, what in (("shared", "shared runs (default)"), ("each", "one copy per tensor")):
        v = times[mode]
        print(f"  {what:24s} {statistics.median(v):.3f} s [{min(v):.3f}-{max(v):.3f}] "
              f"= {statistics.median(v) / args.tensors * 1e6:.1f} us a tensor")
    print(f"  one copy per tensor / shared: "
          f"{statistics.median(times['each']) / statistics.median(times['shared']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
