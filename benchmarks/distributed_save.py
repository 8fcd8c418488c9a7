"""A 4-rank data-parallel save: fastpersist vs torch.distributed.checkpoint vs rank 0 torch.save.

    python benchmarks/distributed_save.py                    # 1 GiB state, 4 ranks, 5 repeats
    python benchmarks/distributed_save.py --size-gib 2 --json out.json
    python benchmarks/distributed_save.py --methods fastpersist,fastpersist_daemon

Each rank runs with OMP_NUM_THREADS = the machine's cores / ranks (at least 1),
as torchrun sets it for several processes per node, unless the environment
sets it: four ranks each spinning two OpenMP threads on two cores measure the
oversubscription, not the save.

Every rank holds the same state (pure data parallelism, the benchmark state of
save_load.py). Within each repeat, interleaved, each method saves it durably
and the wall time is from a barrier before to a barrier after:

- fastpersist.save(state, path, process_group=WORLD): each unique byte written
  once, split over the ranks (2 simulated nodes x 2 ranks);
- the same through fastpersistd (one daemon, as on one node): each rank
  copies its pieces into shared memory and the daemon writes its part;
- fastpersist.async_save, in-process and through the daemon: the wall time
  until durable, and the caller's stall (until async_save returned);
- torch.distributed.checkpoint.save (its own dedup of replicated tensors,
  FileSystemWriter with sync_files);
- rank 0 alone: torch.save + fsync while the others wait (the common pattern);
- fio, O_DIRECT, the same bytes: the disk's ceiling, in the same run.

Reports medians, the bytes each rank wrote (fastpersist: balance target within
5%), the ratio to DCP (target >= 2x faster), and planning time for 1,024
simulated ranks x 2,000 tensors (target < 1 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORLD = 4
# (report key, slower method, faster method, line printed): each where both were measured.
RATIOS = (
    ("dcp_over_fastpersist", "dcp", "fastpersist",
     "fastpersist vs DCP          {:.2f}x faster (target >= 2)"),
    ("dcp_over_fastpersist_daemon", "dcp", "fastpersist_daemon",
     "through the daemon vs DCP   {:.2f}x faster"),
    ("fastpersist_daemon_over_in_process", "fastpersist_daemon", "fastpersist",
     "through the daemon vs in-process  {:.2f}x the time (target <= 1.15)"),
    ("rank0_over_fastpersist", "rank0_torch_save", "fastpersist",
     "fastpersist vs rank-0 save  {:.2f}x faster"),
    ("fio_over_fastpersist", "fio_direct", "fastpersist", "fastpersist vs fio ceiling  {:.2f}x"),
)
METHODS = ("fastpersist", "fastpersist_daemon", "fastpersist_async", "fastpersist_daemon_async",
           "dcp", "rank0_torch_save")


def planning_seconds(ranks: int = 1024, tensors: int = 2000, repeats: int = 5) -> dict[str, Any]:
    from fastpersist.distributed.planner import Item, RankInfo, layout_digest, make_plan

    rng = random.Random(0)
    items = tuple(Item.whole(f"layer{i}.weight", "BF16", (rng.randint(1, 8192),
                                                          rng.randint(1, 4096)))
                  for i in range(tensors))
    layout = layout_digest(items)  # each rank computes its own, in parallel
    infos = [RankInfo(r, f"node{r // 8:04d}", items, layout) for r in range(ranks)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = make_plan(infos)
        times.append(time.perf_counter() - start)
    per_rank = plan.bytes_per_rank().values()
    return {"ranks": ranks, "tensors": tensors, "seconds_median": statistics.median(times),
            "pieces": len(plan.pieces), "rank_bytes_max_over_min": max(per_rank) / min(per_rank)}


# --- one rank of the job -------------------------------------------------------------------


def _dir_bytes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.rglob("*") if p.is_file()}


def worker(work: Path, nbytes: int, repeats: int, out: Path, chosen: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _state import build_state, make_spec
    from _system import fsync_path

    import fastpersist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    state = build_state(make_spec(nbytes, seed=0))  # identical on every rank

    def fp(path: Path) -> None:
        fastpersist.save(state, path, process_group=dist.group.WORLD, daemon="")

    def fp_daemon(path: Path) -> None:
        fastpersist.save(state, path, process_group=dist.group.WORLD,
                         daemon=os.environ["FP_BENCH_DAEMON"])

    stalls: dict[str, list[float]] = {"fastpersist_async": [], "fastpersist_daemon_async": []}

    def fp_async(name: str, daemon: str) -> Any:
        def run(path: Path) -> None:
            future = fastpersist.async_save(state, path, process_group=dist.group.WORLD,
                                            daemon=daemon)
            stalls[name].append(future.snapshot_seconds)
            future.result()
        return run

    def dcp_save(path: Path) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))

    def rank0(path: Path) -> None:
        if rank == 0:
            torch.save(state, path)
            fsync_path(path)

    methods = {"fastpersist": fp, "fastpersist_daemon": fp_daemon,
               "fastpersist_async": fp_async("fastpersist_async", ""),
               "fastpersist_daemon_async": fp_async("fastpersist_daemon_async",
                                                    os.environ["FP_BENCH_DAEMON"]),
               "dcp": dcp_save, "rank0_torch_save": rank0}
    methods = {name: methods[name] for name in chosen}
    times: dict[str, list[float]] = {k: [] for k in methods}
    written: dict[str, dict[str, int]] = {}
    for r in range(repeats):
        for name, fn in methods.items():
            path = work / f"{name}-{r}"
            dist.barrier()
            start = time.perf_counter()
            fn(path)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            if rank == 0:
                written[name] = _dir_bytes(path) if path.is_dir() else {path.name:
                                                                           path.stat().st_size}
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            dist.barrier()
    if rank == 0:
        out.write_text(json.dumps({"times": times, "written": written, "stalls": stalls}))
    dist.destroy_process_group()


# --- the driver -------------------------------------------------------------------------------


def per_rank_bytes(name: str, files: dict[str, int]) -> dict[str, int]:
    """Bytes each rank wrote, from the file names each method gives its ranks' files."""
    from fastpersist.format.names import rank_of_part_file

    out: dict[str, int] = {}
    for f, n in files.items():
        if name.startswith("fastpersist") and rank_of_part_file(f) is not None:
            rank = str(rank_of_part_file(f))
        elif name == "dcp" and f.endswith(".distcp"):
            rank = f.split("_")[2].split(".")[0] if f.startswith("__") else "?"
        elif name == "rank0_torch_save":
            rank = "0"
        else:
            continue  # manifests and metadata
        out[rank] = out.get(rank, 0) + n
    return dict(sorted(out.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # WORK_DIR RESULT_FILE
    args = p.parse_args()
    chosen = [m for m in METHODS if m in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown or not chosen:
        p.error(f"--methods: choose from {', '.join(METHODS)} (got {args.methods!r})")
    nbytes = int(args.size_gib * 2**30)
    if args.worker:
        worker(Path(args.worker[0]), nbytes, args.repeats, Path(args.worker[1]), chosen)
        return 0

    sys.path.insert(0, str(HERE))
    import _fio
    from _system import machine_facts
    from daemon_save import DaemonProcess

    work = Path(tempfile.mkdtemp(prefix="fp-dist-bench-", dir=args.dir))
    shm_dir = Path(tempfile.mkdtemp(prefix="fp-dist-bench-", dir="/dev/shm"))
    result_file = work / "result.json"
    daemon = DaemonProcess(work, shm_dir, work)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // WORLD))
        for rank in range(WORLD):
            env = dict(os.environ, OMP_NUM_THREADS=threads, RANK=str(rank),
                       WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       FASTPERSIST_NODE=f"node{rank // 2}",
                       FP_BENCH_DAEMON=daemon.address, FASTPERSIST_SHM_DIR=str(shm_dir),
                       PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--size-gib", str(args.size_gib), "--repeats",
                 str(args.repeats), "--methods", ",".join(chosen), "--worker", str(work),
                 str(result_file)], env=env))
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a rank exited with {proc.returncode}")
        job = json.loads(result_file.read_text())
        fio_s = []
        if _fio.available() is None:
            for _ in range(args.repeats):
                res = _fio.run(_fio.WRITE_SHAPES[2], work / "fio.dat", _fio.fio_size(nbytes))
                fio_s.append(res.seconds * nbytes / res.nbytes)
    finally:
        daemon.proc.terminate()
        daemon.proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in job["times"].items()}
    if fio_s:
        med["fio_direct"] = statistics.median(fio_s)
    ranks = {k: per_rank_bytes(k, files) for k, files in job["written"].items()}
    stall = {k: statistics.median(v) for k, v in job["stalls"].items() if v}
    planning = planning_seconds()
    ratios = {key: med[slow] / med[fast] for key, slow, fast, _ in RATIOS
              if slow in med and fast in med}
    if "fastpersist" in ranks:
        fp_ranks = list(ranks["fastpersist"].values())
        ratios["fastpersist_rank_max_over_mean"] = max(fp_ranks) / (sum(fp_ranks) / len(fp_ranks))
    report = {
        "state_bytes": nbytes, "world": WORLD, "repeats": args.repeats,
        "omp_num_threads": int(threads), "machine": machine_facts(args.dir), "medians_s": med,
        "samples_s": job["times"], "fio_samples_s": fio_s, "bytes_per_rank": ranks,
        "async_stall_medians_s": stall, "async_stall_samples_s": job["stalls"],
        "ratios": ratios, "planning": planning,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"state {nbytes / 2**30:.2f} GiB, {WORLD} ranks (2 nodes x 2, OMP_NUM_THREADS "
          f"{threads}), {args.repeats} repeats, medians [min-max]")
    for k, v in med.items():
        samples = job["times"].get(k, fio_s)
        print(f"  {k:24s} {v:6.3f} s [{min(samples):.3f}-{max(samples):.3f}]  "
              f"{nbytes / v / 1e9:5.2f} GB/s")
    for k, v in stall.items():
        print(f"  {k:26s} caller stall {v:6.3f} s (rank 0)")
    for key, _, _, label in RATIOS:
        if key in ratios:
            print(f"  {label.format(ratios[key])}")
    for k, v in ranks.items():
        print(f"  bytes per rank, {k:16s} {v}")
    if "fastpersist_rank_max_over_mean" in ratios:
        print(f"  fastpersist busiest rank vs mean  {ratios['fastpersist_rank_max_over_mean']:.3f}"
              " (target <= 1.05)")
    print(f"  planning {planning['ranks']} ranks x {planning['tensors']} tensors: "
          f"{planning['seconds_median'] * 1e3:.0f} ms (target < 1 s), "
          f"{planning['pieces']} pieces, "
          f"busiest/idlest rank {planning['rank_bytes_max_over_min']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
