"""Saving through fastpersistd against saving in-process, on the same state, in the same run.

    python benchmarks/daemon_save.py                      # 2 GiB state, 5 repeats
    python benchmarks/daemon_save.py --size-gib 1 --repeats 3 --json out.json
    python benchmarks/daemon_save.py --compression zstd   # every save compressed

Measures, interleaved within each repeat (medians reported):
1. throughput: durable fastpersist.save in-process vs through the daemon (target >= 0.9x),
   and the fio O_DIRECT write ceiling of the same size for scale;
2. client stall: async_save through the daemon (copy into shared memory + hand-over)
   vs a plain copy of the same bytes into an already-touched buffer (target <= 1.3x);
3. daemon memory: peak anonymous + file-backed RSS of the daemon process beyond its
   shared-memory staging (RssShmem), sampled every 20 ms (target <= 256 MiB);
4. four clients at once (4 processes, a quarter of the state each) vs one client with all
   of it: aggregate throughput (target: the same, >= ~0.9x). Each client's
   OMP_NUM_THREADS is its share of the cores, as torchrun sets it.
With --compression zstd every save above is compressed: in-process by the
caller (or its background thread), through the daemon by the daemon; the stall
target is then the same copy floor (the daemon, not the caller, compresses).
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
import threading
import time
from pathlib import Path
from typing import Any

import _fio
import torch
from _state import build_state, copy_floor, local_tensors, make_spec
from _system import GIB, machine_facts

import fastpersist
from fastpersist.protocol.client import DaemonClient
from fastpersist.tensors.checkpoint import read_manifest

HERE = Path(__file__).resolve().parent
MIB = 1 << 20

CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import fastpersist
from _state import build_state, make_spec
nbytes, seed, target, go = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
compression = sys.argv[6] or None
state = build_state(make_spec(nbytes, seed))
fastpersist.save(state, target + "-warm", compression=compression)  # staging made once
print("ready", flush=True)
while not __import__("os").path.exists(go):
    time.sleep(0.001)
start = time.time()
fastpersist.save(state, target, compression=compression)
print(json.dumps({"start": start, "end": time.time()}), flush=True)
"""


class DaemonProcess:
    def __init__(self, root: Path, shm_dir: Path, sockdir: Path) -> None:
        self.socket = sockdir / "fpd.sock"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastpersist.daemon", "--root", str(root), "--socket",
             str(self.socket), "--shm-dir", str(shm_dir), "--log-level", "warning"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.socket.exists():
                try:
                    if DaemonClient(self.address).health() == "SERVING":
                        break
                except fastpersist.CheckpointError:
                    pass
            time.sleep(0.05)
        else:
            raise RuntimeError("fastpersistd did not start")
        self.peak_private = 0
        self._sampling = False

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def _status_kib(self) -> dict[str, int]:
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(value.split()[0])
        return out

    def private_rss(self) -> int:
        """Resident bytes that are the daemon's own (not the clients' shared staging)."""
        s = self._status_kib()
        return (s["RssAnon"] + s["RssFile"]) * 1024

    def sample(self) -> None:
        self._sampling = True

        def loop() -> None:
            while self._sampling:
                self.peak_private = max(self.peak_private, self.private_rss())
                time.sleep(0.02)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop_sampling(self) -> None:
        self._sampling = False
        self._thread.join()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def concurrent(clients: int, total: int, root: Path, tag: str, env: dict[str, str],
               compression: str | None = None) -> float:
    """Aggregate bytes/s of `clients` processes saving total/clients bytes each at once."""
    go = root / f".go-{tag}"
    # Each client gets its share of the cores for torch's intra-op threads, as
    # torchrun arranges for several processes per node (OMP_NUM_THREADS=1):
    # four processes spinning two OpenMP threads each on two cores halve the
    # copy's speed, which measures the oversubscription, not the daemon.
    threads = str(max(1, (os.cpu_count() or 1) // clients))
    procs = [subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(HERE), str(total // clients), str(100 + c),
         str(root / f"{tag}-client{c}"), str(go), compression or ""],
        stdout=subprocess.PIPE, text=True,
        env=dict(env, OMP_NUM_THREADS=threads)) for c in range(clients)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    go.touch()
    spans = []
    for p in procs:
        assert p.stdout is not None
        spans.append(json.loads(p.stdout.readline()))
        if p.wait(600) != 0:
            raise RuntimeError(f"client exited with {p.returncode}")
    go.unlink()
    written = sum(t.length for c in range(clients)  # raw tensor bytes, even compressed
                  for t in read_manifest(root / f"{tag}-client{c}").tensors)
    t0 = min(s["start"] for s in spans)
    if os.environ.get("FP_BENCH_SPANS"):
        print([(round(s["start"] - t0, 3), round(s["end"] - t0, 3)) for s in spans])
    return written / (max(s["end"] for s in spans) - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path)
    p.add_argument("--compression", choices=("zstd",), default=None,
                   help="compress every save (default: raw)")
    args = p.parse_args()
    z = args.compression

    work = Path(tempfile.mkdtemp(prefix="fp-daemon-bench-", dir=args.dir))
    shm_dir = Path(tempfile.mkdtemp(prefix="fp-bench-", dir="/dev/shm"))
    sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
    os.environ["FASTPERSIST_SHM_DIR"] = str(shm_dir)
    root = work / "root"
    root.mkdir()
    daemon = DaemonProcess(root, shm_dir, sockdir)
    results: dict[str, list[float]] = {k: [] for k in (
        "inprocess_s", "daemon_s", "fio_s", "stall_s", "floor_s", "one_client_bps",
        "four_clients_bps")}
    try:
        state = build_state(make_spec(int(args.size_gib * GIB)))
        tensors = local_tensors(state)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        floor_buf = torch.empty(nbytes, dtype=torch.uint8)
        floor_buf.fill_(0)  # touched: the floor is the copy alone
        env = dict(os.environ, FASTPERSIST_DAEMON=daemon.address)
        fastpersist.save(state, root / "warm", daemon=daemon.address,
                         compression=z)  # segments made once
        daemon.sample()
        fio_reason = _fio.available()
        for r in range(args.repeats):
            results["inprocess_s"].append(
                timed(lambda: fastpersist.save(state, root / "inproc", daemon="",
                                               compression=z)))
            results["daemon_s"].append(
                timed(lambda: fastpersist.save(state, root / "via-daemon", daemon=daemon.address,
                                               compression=z)))
            started = time.perf_counter()
            future = fastpersist.async_save(state, root / "async", daemon=daemon.address,
                                            compression=z)
            results["stall_s"].append(time.perf_counter() - started)
            future.result()
            results["floor_s"].append(copy_floor(tensors, floor_buf))
            if fio_reason is None:
                shape = _fio.WRITE_SHAPES[1]
                res = _fio.run(shape, work / "fio.dat", _fio.fio_size(nbytes))
                results["fio_s"].append(res.seconds * nbytes / res.nbytes)
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in results.items()
                                              if v and k.endswith("_s")), flush=True)
        daemon.stop_sampling()
        for r in range(max(1, args.repeats // 2)):
            results["one_client_bps"].append(concurrent(1, nbytes, root, f"one{r}", env, z))
            results["four_clients_bps"].append(concurrent(4, nbytes, root, f"four{r}", env, z))
            for c in root.glob("one*"):
                shutil.rmtree(c, ignore_errors=True)
            for c in root.glob("four*"):
                shutil.rmtree(c, ignore_errors=True)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items() if v}
    gbps = {k: nbytes / med[k] / 1e9 for k in ("inprocess_s", "daemon_s", "fio_s") if k in med}
    report = {
        "state_bytes": nbytes, "repeats": args.repeats, "machine": machine_facts(args.dir),
        "compression": z,
        "medians": med, "samples": results, "daemon_peak_private_rss": daemon.peak_private,
        "throughput_GBps": gbps,
        "ratios": {
            "daemon_vs_inprocess": med["inprocess_s"] / med["daemon_s"],
            "stall_vs_copy": med["stall_s"] / med["floor_s"],
            "four_vs_one_client": med["four_clients_bps"] / med["one_client_bps"],
            **({"daemon_vs_fio": med["fio_s"] / med["daemon_s"]} if "fio_s" in med else {}),
        },
    }
    ratio = report["ratios"]
    print(f"\nstate {nbytes / GIB:.2f} GiB, {args.repeats} repeats, medians"
          + (f", compression={z}" if z else ""))
    for k, v in gbps.items():
        print(f"  {k.removesuffix('_s'):10s} {v:6.2f} GB/s")
    print(f"  daemon vs in-process save   {ratio['daemon_vs_inprocess']:.2f}x (target >= 0.9)")
    print(f"  async stall {med['stall_s'] * 1e3:.0f} ms vs copy {med['floor_s'] * 1e3:.0f} ms = "
          f"{ratio['stall_vs_copy']:.2f}x (target <= 1.3)")
    print(f"  daemon private RSS peak     {daemon.peak_private / MIB:.0f} MiB (target <= 256)")
    print(f"  4 clients vs 1: {med['four_clients_bps'] / 1e9:.2f} vs "
          f"{med['one_client_bps'] / 1e9:.2f} GB/s = {ratio['four_vs_one_client']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
