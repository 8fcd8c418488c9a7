"""Peak host memory of every save and load path against a staging budget (issue 37, part 2).

    python benchmarks/memory_ceiling.py                          # 2 GiB state, 256 MiB budget
    python benchmarks/memory_ceiling.py --size-gib 1 --budget 256MiB --json out.json
    python benchmarks/memory_ceiling.py --size-gib 8 --budget 1GiB   # the issue's figure
    python benchmarks/memory_ceiling.py --paths inproc,inproc-zstd   # a subset
    python benchmarks/memory_ceiling.py --repeats 5 --json out.json  # medians of 5 runs

The state is S GiB of float32 in --tensors tensors (default 64). Every path runs in a
fresh process that builds the state, resets its peak (VmHWM := VmRSS, by writing "5"
to /proc/self/clear_refs; the run fails if that is refused) and then makes the one
call; the trainer's figure is VmHWM minus VmRSS at the reset, read from
/proc/self/status: the kernel's exact peak, not a sample. For the daemon, the parent
resets the daemon's VmHWM the same way (/proc/PID/clear_refs) before the path and
reads VmHWM minus VmRSS after it; the daemon's private memory (RssAnon + RssFile, i.e.
not the trainers' shared-memory pages it maps) is also sampled every 5 ms. Shared
memory is the sum of the allocated blocks of the files in a private --shm-dir
(FASTPERSIST_SHM_DIR for the trainer, the daemon's --shm-dir), sampled every 5 ms,
beyond what was there before the path.

Budgets: the trainer runs with FASTPERSIST_STAGING_BUDGET=B; the daemon with
--staging-budget B --client-budget B. A trainer's shared-memory staging pages are
resident in the trainer (it wrote them) and mapped by the daemon: they count in both
processes' peaks and in the shm column, once each; they are the same pages.

Goal: the trainer's and the daemon's peak <= B + 64 MiB above baseline for a save.
A load returns the state, so its figure is the peak beyond the bytes it returned
(load(into=) returns them in the caller's tensors: nothing beyond them). A path the
daemon refuses (a save over its budget: RESOURCE_EXHAUSTED) is reported "refused".

Paths:
  inproc            fastpersist.save in-process (written from the tensors)
  async2            async_save, and a second async_save queued behind the first
  inproc-zstd       fastpersist.save(compression="zstd") in-process
  async-zstd        async_save(compression="zstd"), waited for
  daemon            fastpersist.save through fastpersistd (shared memory)
  daemon-zstd       the same, compressed by the daemon
  daemon-stream     through fastpersistd with tensors larger than half the budget
                    (those are streamed over gRPC: SubmitStream)
  daemon-async2     async_save through the daemon with a second queued
  daemon-default    through the daemon, the trainer without FASTPERSIST_STAGING_BUDGET
                    (the daemon's --client-budget B is the only budget; refused today
                    for a state over it)
  dist2             2 gloo ranks, in-process (each rank's peak; the worst shown)
  dist2-daemon      2 gloo ranks through the daemon
  dist2-async       2 gloo ranks, in-process async_save, waited for
  load              fastpersist.load (peak beyond the returned bytes)
  load-into         fastpersist.load(into=state)
  open-get          fastpersist.open(...).get_tensor of every tensor, one at a time
                    (peak beyond the largest tensor)
  load-tier         fastpersist.load(daemon=...) from the daemon's memory tier
                    (--memory-tier-count 1), after a save through it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MIB = 1 << 20
GIB = 1 << 30
SLACK = 64 * MIB  # the allowance above the budget

SAVES = ("inproc", "async2", "inproc-zstd", "async-zstd", "daemon", "daemon-zstd",
         "daemon-stream", "daemon-async2", "daemon-default", "dist2", "dist2-daemon",
         "dist2-async")
LOADS = ("load", "load-into", "open-get", "load-tier")
PATHS = SAVES + LOADS
DAEMON_PATHS = {"daemon", "daemon-zstd", "daemon-stream", "daemon-async2", "daemon-default",
                "dist2-daemon", "load-tier"}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256MiB, 1GiB)")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": MIB, "G": GIB}[unit])


def status_kib(pid: int | str, *fields: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int | str) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5\n")


def shm_bytes(shm_dir: Path) -> int:
    total = 0
    for root, _, names in os.walk(shm_dir):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # unlinked since the listing
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


# -- the child: one path in a fresh process -------------------------------------------


def build(nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    per = nbytes // tensors // 4
    gen = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.empty(per).normal_(generator=gen) for i in range(tensors)}


def child(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    import fastpersist

    path, work = args.path, Path(args.dir)
    daemon = args.daemon or ""
    rank = int(os.environ.get("RANK", "0"))
    group = None
    if path.startswith("dist2"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = dist.group.WORLD
    returned = 0
    if path in ("load", "open-get", "load-tier"):
        state: dict[str, Any] = {}
    else:
        state = build(args.nbytes, args.tensors)
        if path == "load-into":
            for t in state.values():
                t.zero_()
    if group is not None:
        torch.distributed.barrier()
    gc.collect()
    reset_peak("self")
    before = status_kib("self", "VmRSS")["VmRSS"]
    start = time.perf_counter()
    error = None
    try:
        if path in ("inproc", "inproc-zstd", "daemon", "daemon-zstd", "daemon-stream",
                    "daemon-default"):
            fastpersist.save(state, work / "out", daemon=daemon,
                             compression="zstd" if path.endswith("zstd") else None)
        elif path in ("async2", "daemon-async2", "async-zstd"):
            z = "zstd" if path == "async-zstd" else None
            first = fastpersist.async_save(state, work / "out-a", daemon=daemon, compression=z)
            futures = [first]
            if path != "async-zstd":  # the second waits (MAX_IN_FLIGHT) for the first's room
                futures.append(fastpersist.async_save(state, work / "out-b", daemon=daemon))
            for f in futures:
                f.result()
        elif path == "dist2-async":
            fastpersist.async_save(state, work / "out", daemon=daemon,
                                   process_group=group).result()
        elif path.startswith("dist2"):
            fastpersist.save(state, work / "out", daemon=daemon, process_group=group)
        elif path in ("load", "load-tier"):
            loaded = fastpersist.load(work / "ref", daemon=daemon if path == "load-tier" else "")
            returned = sum(t.numel() * t.element_size() for t in loaded.values())
            del loaded
        elif path == "load-into":
            fastpersist.load(work / "ref", into=state)
        elif path == "open-get":
            with fastpersist.open(work / "ref") as f:
                for key in f:
                    t = f.get_tensor(key)
                    returned = max(returned, t.numel() * t.element_size())
                    del t
        else:
            raise SystemExit(f"unknown path {path}")
    except fastpersist.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    peak = status_kib("self", "VmHWM")["VmHWM"]
    if group is not None:
        torch.distributed.destroy_process_group()
    return {"path": path, "rank": rank, "trainer_peak": peak - before, "baseline": before,
            "returned": returned, "seconds": seconds, "error": error}


# -- the parent -------------------------------------------------------------------------


class Daemon:
    def __init__(self, root: Path, shm_dir: Path, budget: int, tier: bool) -> None:
        from fastpersist.protocol.client import DaemonClient

        self.sockdir = Path(tempfile.mkdtemp(prefix="fpd-mem-"))
        self.address = f"unix://{self.sockdir / 'fpd.sock'}"
        cmd = [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket",
               str(self.sockdir / "fpd.sock"), "--shm-dir", str(shm_dir),
               "--staging-budget", str(budget), "--client-budget", str(budget),
               "--log-level", "warning"]
        if tier:
            cmd += ["--memory-tier-count", "1"]
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if DaemonClient(self.address).health() == "SERVING":
                    return
            except Exception:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("fastpersistd did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.sockdir, ignore_errors=True)


class Sampler:
    """Every 5 ms: the shm dir's allocated bytes and the daemon's private RSS."""

    def __init__(self, shm_dir: Path, daemon_pid: int | None) -> None:
        self.shm_dir, self.pid = shm_dir, daemon_pid
        self.shm_base = shm_bytes(shm_dir)
        self.shm_peak = self.private_peak = 0
        self.private_base = self._private() if daemon_pid else 0
        self._on = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _private(self) -> int:
        s = status_kib(self.pid or 0, "RssAnon", "RssFile")
        return s["RssAnon"] + s["RssFile"]

    def _loop(self) -> None:
        while self._on:
            self.shm_peak = max(self.shm_peak, shm_bytes(self.shm_dir) - self.shm_base)
            if self.pid:
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    self.private_peak = max(self.private_peak, self._private() - self.private_base)
            time.sleep(0.005)

    def stop(self) -> None:
        self._on = False
        self._thread.join()


def run_children(args: argparse.Namespace, path: str, work: Path, shm_dir: Path,
                 address: str | None) -> list[dict[str, Any]]:
    env = dict(os.environ, FASTPERSIST_STAGING_BUDGET=str(args.budget),
               FASTPERSIST_SHM_DIR=str(shm_dir), PYTHONPATH=os.pathsep.join(
                   filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    env.pop("FASTPERSIST_DAEMON", None)
    if path == "daemon-default":
        env.pop("FASTPERSIST_STAGING_BUDGET")
    tensors = args.tensors
    if path == "daemon-stream":  # every tensor over half the budget: streamed, not staged
        tensors = max(1, min(args.tensors, args.nbytes // (args.budget // 2 + MIB)))
    ranks = 2 if path.startswith("dist2") else 1
    procs = []
    port = free_port()
    for rank in range(ranks):
        out = work / f"result-{rank}.json"
        cmd = [sys.executable, __file__, "--child", path, "--nbytes", str(args.nbytes),
               "--tensors", str(tensors), "--dir", str(work), "--result", str(out)]
        if address:
            cmd += ["--daemon", address]
        renv = dict(env, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1)
                                                                   // ranks)))
        procs.append((subprocess.Popen(cmd, env=renv), out))
    rows = []
    for proc, out in procs:
        if proc.wait(3600) != 0:
            rows.append({"path": path, "error": f"child exited with {proc.returncode}"})
        else:
            rows.append(json.loads(out.read_text()))
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_reference(args: argparse.Namespace, work: Path, shm_dir: Path,
                   address: str | None) -> None:
    """The checkpoint the loads read, written by a child of its own (not measured)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import fastpersist, memory_ceiling as m;"
            "fastpersist.save(m.build(int(sys.argv[2]), int(sys.argv[3])), sys.argv[4], "
            "daemon=sys.argv[5])")
    subprocess.run([sys.executable, "-c", code, str(HERE), str(args.nbytes), str(args.tensors),
                    str(work / "ref"), address or ""], check=True,
                   env=dict(os.environ, FASTPERSIST_STAGING_BUDGET=str(args.budget),
                            FASTPERSIST_SHM_DIR=str(shm_dir)))


def measure(args: argparse.Namespace, path: str, base: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{path}-", dir=base))
    shm_dir = Path(tempfile.mkdtemp(prefix="fp-mem-", dir="/dev/shm"))
    daemon = None
    try:
        if path in DAEMON_PATHS:
            daemon = Daemon(work, shm_dir, args.budget, tier=path == "load-tier")
        if path in LOADS:
            make_reference(args, work, shm_dir, daemon.address if daemon else None)
        dpid = daemon.proc.pid if daemon else None
        if dpid:
            reset_peak(dpid)
            d_before = status_kib(dpid, "VmRSS")["VmRSS"]
        sampler = Sampler(shm_dir, dpid)
        rows = run_children(args, path, work, shm_dir, daemon.address if daemon else None)
        sampler.stop()
        d_peak = status_kib(dpid, "VmHWM")["VmHWM"] - d_before if dpid else None
    finally:
        if daemon:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    errors = [r["error"] for r in rows if r.get("error")]
    worst = max(rows, key=lambda r: r.get("trainer_peak", -1))
    trainer = worst.get("trainer_peak")
    over = None if trainer is None else trainer - worst.get("returned", 0)
    limit = args.budget + SLACK
    refused = any("RESOURCE_EXHAUSTED" in e or "budget" in e for e in errors)
    verdict = ("refused" if refused else "error" if errors else
               "PASS" if over <= limit and (d_peak is None or d_peak <= limit) else "FAIL")
    return {"path": path, "trainer_peak": trainer, "trainer_over": over,
            "returned": worst.get("returned", 0), "daemon_peak": d_peak,
            "daemon_private_peak": sampler.private_peak if dpid else None,
            "shm_peak": sampler.shm_peak, "verdict": verdict, "errors": errors, "ranks": rows}


def fmt(v: int | None) -> str:
    return "-" if v is None else f"{v / MIB:.0f}"


COLUMNS = ("trainer_over", "daemon_peak", "daemon_private_peak", "shm_peak")


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's runs: each column's median and [min-max]; the worst verdict."""
    out: dict[str, Any] = {"path": runs[0]["path"], "runs": len(runs)}
    for column in COLUMNS:
        values = sorted(r[column] for r in runs if r[column] is not None)
        out[column] = ({"median": statistics.median(values), "min": values[0],
                        "max": values[-1]} if values else None)
    verdicts = {r["verdict"] for r in runs}
    out["verdict"] = next((v for v in ("error", "FAIL", "refused") if v in verdicts), "PASS")
    return out


def fmt_spread(v: dict[str, float] | None) -> str:
    if v is None:
        return "-"
    if v["min"] == v["max"]:
        return fmt(int(v["median"]))
    return f"{fmt(int(v['median']))} [{fmt(int(v['min']))}-{fmt(int(v['max']))}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--budget", type=parse_size, default=256 * MIB,
                   help="staging budget B (e.g. 256MiB, 1GiB; default 256MiB)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every path, interleaved (path by path, then again)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--daemon", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.path = args.child
        args.result.write_text(json.dumps(child(args)))
        return 0
    args.nbytes = int(args.size_gib * GIB)
    paths = [x for x in args.paths.split(",") if x]
    unknown = set(paths) - set(PATHS)
    if unknown:
        p.error(f"unknown paths: {sorted(unknown)}")
    base = Path(tempfile.mkdtemp(prefix="fp-memceil-", dir=args.dir))
    results = []
    try:
        for path in [path for _ in range(args.repeats) for path in paths]:
            r = measure(args, path, base)
            results.append(r)
            print(f"  {path:<14} trainer +{fmt(r['trainer_over'])} MiB, daemon "
                  f"+{fmt(r['daemon_peak'])} MiB, shm {fmt(r['shm_peak'])} MiB: {r['verdict']}"
                  + (f"  ({r['errors'][0][:160]})" if r["errors"] else ""), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    limit = args.budget + SLACK
    print(f"\n{args.nbytes / GIB:.3g} GiB state ({args.tensors} float32 tensors), staging "
          f"budget B = {args.budget / MIB:.0f} MiB, limit B + 64 MiB = {limit / MIB:.0f} MiB")
    summaries = [summary([r for r in results if r["path"] == path]) for path in paths]
    print(f"  medians of {args.repeats} run(s) [min-max]")
    print(f"  {'path':<14} {'trainer +MiB':>16} {'daemon +MiB':>16} {'daemon priv':>16} "
          f"{'shm MiB':>16}  verdict (worst run)")
    for r in summaries:
        print(f"  {r['path']:<14} " + " ".join(f"{fmt_spread(r[c]):>16}" for c in COLUMNS)
              + f"  {r['verdict']}")
    print("  (loads: trainer beyond the bytes returned; open-get: beyond the largest tensor)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"argv": sys.argv, "state_bytes": args.nbytes,
                                         "budget": args.budget, "tensors": args.tensors,
                                         "repeats": args.repeats, "summary": summaries,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
