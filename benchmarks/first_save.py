"""A process's first fastpersist.save against fio, as a new user measures it.

    python benchmarks/first_save.py                       # 2 GiB, 64 float32 tensors, 5 rounds
    python benchmarks/first_save.py --rounds 3 --no-peers --dir /mnt/nvme0/bench

Each round runs, in an order that rotates from round to round:

- fastpersist: a fresh Python process builds a state dict of `--tensors` float32
  tensors (`--size-gib` in all), imports fastpersist, then times the plain
  `fastpersist.save(state, new_dir)`: its first save, with nothing prepared
  (no warm staging, no warm engine). Durable on return: data, manifest and
  directories fsynced, committed by rename.
- fio: sequential O_DIRECT writes of the same number of bytes into a new file
  in the same directory, `--end_fsync=1` (durable too), in the shapes of
  benchmarks/_fio.py; the round's fio figure is its best shape. Its time is
  fio's own runtime (no process start-up, no file layout), a strict reference.
- peers (unless --no-peers): torch.save and safetensors.torch.save_file in a
  fresh process each, then the file and its directory fsynced, inside the clock.

Everything written is deleted after each measurement, then sync(2) and a
second's pause. fastpersist is imported after torch, before the clock, as a
user's script does. The report gives, per
method, the median time and GB/s with [min-max] over the rounds, and each
method's median throughput as a ratio of fio's (the goal: fastpersist >= 0.95).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _fio import WRITE_SHAPES, available, fio_size  # noqa: E402
from _fio import run as run_fio  # noqa: E402

# The child builds the state, then times only the save (and, for peers, the fsyncs).
CHILD = r"""
import os, sys, time
import torch
method, target, count, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
state = {f"layer{i:03d}.weight": torch.full((per // 4,), float(i), dtype=torch.float32)
         for i in range(count)}
def fsync(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
if method == "fastpersist":
    import fastpersist
    t = time.perf_counter()
    fastpersist.save(state, target)
elif method == "torch.save":
    t = time.perf_counter()
    torch.save(state, target)
    fsync(target); fsync(os.path.dirname(target), True)
elif method == "safetensors":
    from safetensors.torch import save_file
    t = time.perf_counter()
    save_file(state, target)
    fsync(target); fsync(os.path.dirname(target), True)
print(time.perf_counter() - t)
"""

PEERS = ("torch.save", "safetensors")


def child(method: str, target: Path, count: int, per: int) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, method, str(target), str(count), str(per)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed: {done.stderr.strip()[-800:]}")
    return float(done.stdout.split()[-1])


def remove(path: Path) -> None:
    """Delete what a measurement wrote, and let the filesystem settle: on a mount
    with `discard` (this one), ext4 sends the freed blocks' discards at its next
    journal commit, which would otherwise land on whatever runs next."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()
    time.sleep(1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--no-peers", action="store_true", help="fastpersist and fio only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if (why := available()) is not None:
        print(why, file=sys.stderr)
        return 2
    per = int(args.size_gib * 2**30) // args.tensors // 4096 * 4096
    nbytes = per * args.tensors
    methods = ["fastpersist", "fio"] + ([] if args.no_peers else list(PEERS))
    if not args.no_peers:
        try:
            import safetensors  # noqa: F401
        except ImportError:
            methods.remove("safetensors")
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    fio_shapes: dict[str, list[float]] = {s.label: [] for s in WRITE_SHAPES}
    work = Path(tempfile.mkdtemp(prefix="fp-first-save-", dir=args.dir))
    try:
        for r in range(args.rounds):
            k = r % len(methods)
            for method in methods[k:] + methods[:k]:
                target = work / f"{method}-{r}"
                try:
                    if method == "fio":
                        best = None
                        for shape in WRITE_SHAPES:
                            res = run_fio(shape, target, fio_size(nbytes))
                            s = res.seconds * nbytes / res.nbytes
                            fio_shapes[shape.label].append(s)
                            best = s if best is None else min(best, s)
                            remove(target)
                        assert best is not None
                        seconds[method].append(best)
                    else:
                        seconds[method].append(child(method, target, args.tensors, per))
                finally:
                    remove(target)
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(
                f"{m} {seconds[m][-1]:.3f} s" for m in methods), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = nbytes / 1e9
    fio_rate = gb / statistics.median(seconds["fio"])
    print(f"\n{nbytes / 2**30:g} GiB in {args.tensors} float32 tensors, {args.rounds} interleaved "
          f"rounds under {args.dir}, {os.cpu_count()} CPUs; median [min-max]")
    for m in methods:
        s = seconds[m]
        rates = sorted(gb / x for x in s)
        rate = gb / statistics.median(s)
        print(f"  {m:12s} {statistics.median(s):6.3f} s [{min(s):.3f}-{max(s):.3f}]  "
              f"{rate:5.2f} GB/s [{rates[0]:.2f}-{rates[-1]:.2f}]  {rate / fio_rate:4.2f}x fio")
    for label, s in fio_shapes.items():
        print(f"    {label:40s} {statistics.median(s):6.3f} s [{min(s):.3f}-{max(s):.3f}]")
    per_round = [f / x for f, x in zip(seconds["fio"], seconds["fastpersist"], strict=True)]
    print(f"  fastpersist / fio per round: {' '.join(f'{x:.2f}' for x in per_round)} "
          f"(median {statistics.median(per_round):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "tensors": args.tensors,
                                         "seconds": seconds, "fio_shapes": fio_shapes},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
