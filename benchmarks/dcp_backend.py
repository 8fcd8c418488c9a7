"""torch.distributed.checkpoint on fastpersist's storage vs DCP's own FileSystemWriter/Reader.

    python benchmarks/dcp_backend.py               # 1 GiB, 1 process and 4 ranks, 5 repeats
    python benchmarks/dcp_backend.py --size-gib 0.25 --world 1 --repeats 5
    python benchmarks/dcp_backend.py --json out.json --dir /mnt/nvme/bench
    python benchmarks/dcp_backend.py --daemon      # also FastPersistWriter through fastpersistd

The same DCP calls, only the storage differs:

- save: dcp.save(state, storage_writer=...) with FileSystemWriter(sync_files=True)
  (+ an fsync of the directory and its parent, the guarantee fastpersist gives)
  vs FastPersistWriter; wall time from a barrier before to one after;
- load: dcp.load into a preallocated state in place, page cache dropped first
  (drop_caches as root, posix_fadvise(DONTNEED) per file otherwise), with
  FileSystemReader vs FastPersistReader (CRC32C of every item checked);
- async_save stall: the time dcp.async_save takes to return (the trainer's
  stall: the snapshot), with FileSystemWriter as its own stager (DCP's
  BlockingAsyncStager: a new host copy per save) vs FastPersistWriter (staging
  buffers reused from the second save on); and the time until durable. Each
  repeat also copies the rank's tensors into one touched buffer, the least a
  snapshot costs (the "copy floor"); the report gives each stall / floor.

State: the benchmarks' GPT-style state (_state.py: bf16 weights, fp32 AdamW
moments, 0-d steps). With --world 4 each of 4 gloo ranks holds a quarter of
every tensor as a DTensor (Shard(0) on a CPU mesh; tensors too small to shard
replicated), as FSDP would, and the state size is the whole job's.

With one process, each repeat also measures, interleaved with the saves, a plain
fastpersist.save of the same state (no DCP) and the disk's write ceiling: the
best fio O_DIRECT write shape (_fio.WRITE_SHAPES, end_fsync) of the same bytes.
The report then says what "3x FileSystemWriter" would need against that ceiling.

With --daemon, a fastpersistd (root: the work directory) runs beside the job
and FastPersistWriter(daemon=...) is a third save and async method ("through
fastpersistd"; its checkpoints are the same files, so loads are not repeated).

Methods alternate within each repeat (order rotated each repeat); the report
gives median, min and max over repeats and the FileSystem/FastPersist ratio.
The first repeat's async saves allocate the staging buffers (both methods);
later repeats show the steady state, so the median is the steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _fio  # noqa: E402  (from HERE)

METHODS = ("fs", "fp")  # the loads' methods; saves add "fpd" with --daemon
NAMES = {"fs": "FileSystemWriter/Reader", "fp": "FastPersistWriter/Reader",
         "fpd": "FastPersistWriter, fastpersistd"}


def shard_state(state: Any, mesh: Any, rank: int, world: int) -> Any:
    """Each tensor as a DTensor sharded by rows over the mesh (replicated when too small)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(state, torch.Tensor):
        if state.dim() == 0 or state.shape[0] < world:
            return DTensor.from_local(state, mesh, [Replicate()], run_check=False)
        local = state.chunk(world)[rank].clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, dict):
        return {k: shard_state(v, mesh, rank, world) for k, v in state.items()}
    return state


class StorageClock:
    """Seconds spent inside the storage layer's methods (DCP's StorageWriter and
    StorageReader calls, a returned future waited for), on this rank, since the
    last reset: the rest of a save's or load's wall time is DCP's own
    (planning, collectives, pickling plans and metadata), which every storage pays."""

    WRITER = ("set_up_storage_writer", "prepare_local_plan", "prepare_global_plan",
              "write_data", "finish")
    READER = ("set_up_storage_reader", "read_metadata", "prepare_local_plan",
              "prepare_global_plan", "read_data")

    def __init__(self, classes: dict[type, tuple[str, ...]]) -> None:
        self.seconds = 0.0
        for cls, names in classes.items():
            for name in names:
                setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = method(*args, **kwargs)
                if hasattr(result, "wait"):  # write_data/read_data: a torch Future
                    result.wait()
                return result
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def worker(work: Path, nbytes: int, repeats: int, world: int, out: Path | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _state import (
        build_skeleton,
        build_state,
        copy_floor,
        local_tensors,
        make_spec,
        verify_nested,
    )
    from _system import drop_page_cache, fsync_path

    from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

    warnings.simplefilter("ignore")
    spec = make_spec(nbytes, seed=0)
    rank = 0
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
        state = shard_state(build_state(spec), mesh, rank, world)
        skeleton = shard_state(build_skeleton(spec), mesh, rank, world)
    else:
        state, skeleton = build_state(spec), build_skeleton(spec)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    clock = StorageClock({dcp.FileSystemWriter: StorageClock.WRITER,
                          FastPersistWriter: StorageClock.WRITER,
                          dcp.FileSystemReader: StorageClock.READER,
                          FastPersistReader: StorageClock.READER})

    def slowest(value: float) -> float:
        if world == 1:
            return value
        values = [0.0] * world
        dist.all_gather_object(values, value)
        return max(values)

    def timed(fn: Any, kind: str, method: str) -> float:
        barrier()
        clock.take()
        start = time.perf_counter()
        fn()
        barrier()
        seconds = time.perf_counter() - start
        # In the storage, on the rank that spent longest there.
        samples[f"storage_{kind}:{method}"].append(slowest(clock.take()))
        return seconds

    def fs_save(path: Path) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        if rank == 0:  # what fastpersist's commit makes durable too
            fsync_path(path)
            fsync_path(path.parent)

    daemon = os.environ.get("FP_BENCH_DAEMON", "")
    writers = {"fs": lambda p: dcp.FileSystemWriter(p, sync_files=True),
               "fp": lambda p: FastPersistWriter(p, daemon=""),
               "fpd": lambda p: FastPersistWriter(p, daemon=daemon)}
    readers = {"fs": dcp.FileSystemReader, "fp": FastPersistReader}
    saves = {"fs": fs_save, **{m: lambda p, m=m: dcp.save(state, storage_writer=writers[m](p))
                               for m in ("fp", "fpd")}}
    methods = (*METHODS, "fpd") if daemon else METHODS
    samples: dict[str, list[float]] = {f"{k}:{m}": [] for k in ("save", "stall", "async_total")
                                       for m in methods}
    samples.update({f"load:{m}": [] for m in METHODS})
    samples.update({f"storage_save:{m}": [] for m in methods})
    samples.update({f"storage_load:{m}": [] for m in METHODS})
    samples["stall:copy"] = []
    tensors = local_tensors(state)
    floor_buffer = torch.zeros(sum(t.numel() * t.element_size() for t in tensors),
                               dtype=torch.uint8)  # touched: the floor is the copy alone
    ceiling = world == 1 and _fio.available() is None
    if ceiling:
        samples["save:plain"] = []  # fastpersist.save, no DCP
        samples["save:fio"] = []  # the best fio write shape of this repeat
    cache = ""
    for r in range(repeats):
        order = methods if r % 2 == 0 else methods[::-1]
        paths = {m: work / f"{m}-{r}" for m in methods}
        if ceiling and r % 2:
            _ceiling(work, state, spec.nbytes, samples)
        for m in order:
            samples[f"save:{m}"].append(timed(lambda p=paths[m], m=m: saves[m](p), "save", m))
        if ceiling and not r % 2:
            _ceiling(work, state, spec.nbytes, samples)
        for m in (m for m in order if m in METHODS):
            barrier()
            if rank == 0:
                cache = drop_page_cache([paths[m]])
            samples[f"load:{m}"].append(timed(lambda p=paths[m], m=m: dcp.load(
                skeleton, storage_reader=readers[m](p)), "load", m))
            if world == 1 and r == 0:
                verify_nested(skeleton, spec)
        barrier()
        if rank == 0:
            for p in paths.values():
                shutil.rmtree(p)
        floor = copy_floor(tensors, floor_buffer)
        if world > 1:  # as the stall: the slowest rank's
            floors = [0.0] * world
            dist.all_gather_object(floors, floor)
            floor = max(floors)
        samples["stall:copy"].append(floor)
        for m in order:
            path = work / f"async-{m}-{r}"
            barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writers[m](path))
            stall = time.perf_counter() - start
            future.result()
            barrier()
            samples[f"async_total:{m}"].append(time.perf_counter() - start)
            if world > 1:  # the job's stall is its slowest rank's
                stalls = [0.0] * world
                dist.all_gather_object(stalls, stall)
                stall = max(stalls)
            samples[f"stall:{m}"].append(stall)
            barrier()
            if rank == 0:
                shutil.rmtree(path)
    result = {"samples": samples, "cache": cache, "tensors": len(spec.tensors),
              "state_bytes": spec.nbytes}
    if rank == 0 and out is not None:
        out.write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()
    return result


def _ceiling(work: Path, state: Any, nbytes: int, samples: dict[str, list[float]]) -> None:
    """One plain fastpersist.save of `state`, and the best fio write of its bytes."""
    import fastpersist

    start = time.perf_counter()
    fastpersist.save(state, work / "plain", daemon="")
    samples["save:plain"].append(time.perf_counter() - start)
    shutil.rmtree(work / "plain")
    best = float("inf")
    for shape in _fio.WRITE_SHAPES:
        (work / "fio.dat").unlink(missing_ok=True)  # a fresh file, as every save makes
        res = _fio.run(shape, work / "fio.dat", _fio.fio_size(nbytes))
        best = min(best, res.seconds * nbytes / res.nbytes)
    (work / "fio.dat").unlink(missing_ok=True)
    samples["save:fio"].append(best)


def run_job(work: Path, nbytes: int, repeats: int, world: int) -> dict[str, Any]:
    if world == 1:
        return worker(work, nbytes, repeats, 1, None)
    result_file = work / "result.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    threads = str(max(1, (os.cpu_count() or 1) // world))
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=threads)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--size-gib", str(nbytes / 2**30), "--repeats",
             str(repeats), "--worker", str(work), str(result_file), str(world)], env=env))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a rank exited with {proc.returncode}")
    return dict(json.loads(result_file.read_text()))


def summarize(job: dict[str, Any], world: int) -> list[str]:
    nbytes = job["state_bytes"]
    med = {k: statistics.median(v) for k, v in job["samples"].items()}
    lines = [f"{world} process{'es' if world > 1 else ''}: {nbytes / 2**30:.2f} GiB, "
             f"{job['tensors']} tensors, medians of {len(job['samples']['save:fp'])} "
             f"(min-max); page cache dropped by {job['cache']}"]
    methods = [m for m in NAMES if f"save:{m}" in med]
    for kind, what in (("save", "durable save"), ("load", "cold load"),
                       ("stall", "async_save stall"), ("async_total", "async_save until durable")):
        for m in (m for m in methods if f"{kind}:{m}" in med):
            v = job["samples"][f"{kind}:{m}"]
            rate = f"{nbytes / med[f'{kind}:{m}'] / 1e9:6.2f} GB/s" if kind in (
                "save", "load") else ""
            lines.append(f"  {what:26s} {NAMES[m]:26s} {med[f'{kind}:{m}']:7.3f} s "
                         f"({min(v):.3f}-{max(v):.3f}) {rate}")
        lines.append(f"  {'':26s} {'FileSystem / FastPersist':26s} "
                     f"{med[f'{kind}:fs'] / med[f'{kind}:fp']:6.2f}x")
        if f"storage_{kind}:fp" in med:
            lines += _split(job["samples"], kind, methods)
        if f"{kind}:fpd" in med:
            lines.append(f"  {'':26s} {'fastpersistd / in-process':26s} "
                         f"{med[f'{kind}:fpd'] / med[f'{kind}:fp']:6.2f}x")
    v = job["samples"].get("stall:copy")
    if v:  # results written before the floor was measured have none
        lines.append(f"  {'async_save stall':26s} {'copy floor':26s} {med['stall:copy']:7.3f} s "
                     f"({min(v):.3f}-{max(v):.3f})")
        lines.append(f"  {'':26s} {'stall / copy floor':26s} "
                     + "  ".join(f"{m} {med[f'stall:{m}'] / med['stall:copy']:.2f}x"
                                 for m in methods))
    if "save:fio" in med:
        for key, what in (("plain", "fastpersist.save (no DCP)"), ("fio", "fio write ceiling")):
            v, m = job["samples"][f"save:{key}"], med[f"save:{key}"]
            lines.append(f"  {'durable save':26s} {what:26s} {m:7.3f} s "
                         f"({min(v):.3f}-{max(v):.3f}) {nbytes / m / 1e9:6.2f} GB/s")
        fs, fp, fio = med["save:fs"], med["save:fp"], med["save:fio"]
        lines.append(f"  FastPersistWriter = {fio / fp:.2f}x the ceiling; 3x FileSystemWriter "
                     f"would be {fs / 3:.3f} s = {fio / (fs / 3):.2f}x the ceiling")
    return lines


def _split(samples: dict[str, list[float]], kind: str, methods: list[str]) -> list[str]:
    """Each method's time in the storage (its slowest rank) and the rest (DCP's
    own), per repeat, as medians; and what the storage's ratio target leaves."""
    lines = []
    rest: dict[str, float] = {}
    for m in (m for m in methods if samples.get(f"storage_{kind}:{m}")):
        inside = samples[f"storage_{kind}:{m}"]
        others = [total - s for total, s in zip(samples[f"{kind}:{m}"], inside, strict=True)]
        rest[m] = statistics.median(others)
        lines.append(f"  {'':26s} {NAMES[m] + ': storage':26s} {statistics.median(inside):7.3f} s"
                     f"  DCP's own {rest[m]:.3f} s ({min(others):.3f}-{max(others):.3f})")
    goal = {"save": 3.0, "load": 1.5}.get(kind)
    if goal and "fs" in rest and "fp" in rest:
        budget = statistics.median(samples[f"{kind}:fs"]) / goal
        lines.append(f"  {'':26s} {goal:g}x FileSystem would be {budget:.3f} s in all; DCP's own "
                     f"part of a FastPersist {kind} alone is {rest['fp']:.3f} s")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    p.add_argument("--daemon", action="store_true",
                   help="also save through a fastpersistd started for the run")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # WORK RESULT WORLD
    args = p.parse_args()
    nbytes = int(args.size_gib * 2**30)
    if args.worker:
        worker(Path(args.worker[0]), nbytes, args.repeats, int(args.worker[2]),
               Path(args.worker[1]))
        return 0
    from _system import machine_facts

    report: dict[str, Any] = {"machine": machine_facts(args.dir), "jobs": {}}
    print(json.dumps(report["machine"]))
    for world in args.world:
        work = Path(tempfile.mkdtemp(prefix="fp-dcp-bench-", dir=args.dir))
        shm_dir = Path(tempfile.mkdtemp(prefix="fp-dcp-bench-", dir="/dev/shm"))
        daemon = None
        try:
            if args.daemon:
                from daemon_save import DaemonProcess

                daemon = DaemonProcess(work, shm_dir, work)
                os.environ.update(FP_BENCH_DAEMON=daemon.address,
                                  FASTPERSIST_SHM_DIR=str(shm_dir))
            job = run_job(work, nbytes, args.repeats, world)
        finally:
            if daemon is not None:
                daemon.proc.terminate()
                daemon.proc.wait()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm_dir, ignore_errors=True)
        report["jobs"][str(world)] = job
        print("\n".join(summarize(job, world)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
