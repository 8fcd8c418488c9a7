"""A tensor streamed through fastpersistd (larger than the client's staging budget).

    python benchmarks/daemon_stream.py                        # 1 GiB, 5 repeats
    python benchmarks/daemon_stream.py --size-gib 0.5 --repeats 3 --json out.json
    python benchmarks/daemon_stream.py --writer-only          # the stream writer alone

Per repeat, interleaved (medians reported):
1. stream: a durable fastpersist.save of one SIZE tensor through the daemon with
   FASTPERSIST_STAGING_BUDGET=64 MiB, so the tensor goes over SubmitStream;
   the daemon's peak RSS above its idle RSS during it (VmHWM, reset before);
2. in-process: fastpersist.save of the same tensor without the daemon (the
   engine's write_file: the disk's speed through fastpersist), for scale.

--writer-only compares, without gRPC, the daemon's stream writer
(fastpersist/daemon/stream_file.py) fed the same bytes from memory in 1 MiB
pieces against the engine's write_file of them: whether the writer, in Python,
keeps up with the C engine.
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
from functools import partial
from pathlib import Path
from typing import Any

import torch

import fastpersist
from fastpersist.engine import get_engine
from fastpersist.format.safetensors_file import HeaderEntry, layout
from fastpersist.protocol.client import DaemonClient

MIB = 1 << 20
GIB = 1 << 30


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def start_daemon(root: Path, shm_dir: Path, sockdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = sockdir / "fpd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "fastpersist.daemon", "--root", str(root),
                             "--socket", str(sock), "--shm-dir", str(shm_dir),
                             "--log-level", "warning"])
    address = f"unix://{sock}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sock.exists():
            try:
                if DaemonClient(address).health() == "SERVING":
                    return proc, address
            except fastpersist.CheckpointError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fastpersistd did not start")


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def through_daemon(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shm_dir = Path(tempfile.mkdtemp(prefix="fp-bench-", dir="/dev/shm"))
    sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
    root = work / "root"
    root.mkdir()
    os.environ["FASTPERSIST_SHM_DIR"] = str(shm_dir)
    proc, address = start_daemon(root, shm_dir, sockdir)
    tensor = torch.randint(0, 255, (int(args.size_gib * GIB),), dtype=torch.uint8)
    state = {"w": tensor}
    results: dict[str, list[float]] = {"stream_s": [], "inprocess_s": [], "rss_rise": []}
    try:
        idle = status(proc.pid)["VmRSS"]
        for i in range(args.repeats):
            os.environ["FASTPERSIST_STAGING_BUDGET"] = str(64 * MIB)
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")
            target = root / f"s{i}"
            results["stream_s"].append(timed(partial(fastpersist.save, state, target,
                                                     daemon=address)))
            results["rss_rise"].append(status(proc.pid)["VmHWM"] - idle)
            del os.environ["FASTPERSIST_STAGING_BUDGET"]
            local = work / f"p{i}"
            results["inprocess_s"].append(timed(partial(fastpersist.save, state, local,
                                                        daemon="")))
            shutil.rmtree(target)
            shutil.rmtree(local)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    nbytes = tensor.nbytes
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "bytes": nbytes, "repeats": args.repeats, "runs": results,
        "stream_GBps": round(nbytes / med["stream_s"] / 1e9, 3),
        "inprocess_GBps": round(nbytes / med["inprocess_s"] / 1e9, 3),
        "stream_vs_inprocess": round(med["inprocess_s"] / med["stream_s"], 3),
        "idle_rss_MiB": round(idle / MIB, 1),
        "peak_rss_rise_MiB": round(max(results["rss_rise"]) / MIB, 1),
    }


def writer_only(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    # Here, not at the top: the daemon part runs against older trees too.
    from fastpersist.daemon.stream_file import Slot, StreamFile

    n = int(args.size_gib * GIB)
    lay = layout([HeaderEntry("w", "U8", (n,), n)], {"format": "pt"})
    data = memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy())
    slot = Slot(8 * MIB)
    engine = get_engine("native")
    results: dict[str, list[float]] = {"writer_s": [], "engine_s": []}
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)

    def stream(name: str) -> None:
        f = StreamFile(slot, fd, name, lay.header, [n])
        f.open()
        for start in range(0, n, MIB):
            f.feed(data[start:start + MIB])
        f.finish()

    try:
        segments = [(lay.header, 0), (data, lay.data_start)]
        for _ in range(args.repeats):
            results["writer_s"].append(timed(lambda: stream("w")))
            results["engine_s"].append(timed(lambda: engine.write_file(
                str(work / "e"), segments, lay.data_start + n)))
            os.unlink(work / "w")
            os.unlink(work / "e")
    finally:
        os.close(fd)
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"bytes": n, "repeats": args.repeats, "runs": results,
            "writer_GBps": round(n / med["writer_s"] / 1e9, 3),
            "engine_GBps": round(n / med["engine_s"] / 1e9, 3),
            "writer_vs_engine": round(med["engine_s"] / med["writer_s"], 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--writer-only", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fp-stream-bench-", dir=args.dir))
    try:
        out = writer_only(args, work) if args.writer_only else through_daemon(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
