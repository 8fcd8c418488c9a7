"""GPU checks for a CUDA machine: run as one short script, `python benchmarks/gpu_check.py`.

1. round trip: a CUDA state dict (bf16/fp32/int, a tied pair, a view) saved
   with fastpersist.save and async_save, loaded back to the GPU and to the
   CPU, bit-exact.
2. snapshot consistency: async_save(wait_for_snapshot=False), wait_snapshot(),
   then in-place GPU mutation; the checkpoint holds the values from before.
3. stall vs D2H: the trainer-visible stall of six consecutive async_saves of
   a ~1 GiB CUDA state against a plain D2H copy of the same bytes into pinned
   memory (the floor), and the pinned D2H bandwidth; then the first save of a
   fresh pipeline without and with prepare_staging beforehand.
4. overlap: GPU compute (matmuls) running while the persist writes; the
   compute's time with and without a concurrent persist.
5. through a locally started fastpersistd (unless --no-daemon): snapshot
   consistency and the stall of a CUDA state copied into registered shared memory.

Prints one line per check and exits non-zero if a correctness check fails.
Performance lines are informational.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import fastpersist
from fastpersist.api import pipeline_for
from fastpersist.protocol.client import DaemonClient


def cuda_state(nbytes: int) -> dict[str, object]:
    n = nbytes // 4 // 4
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, device="cuda", generator=g)
    emb = torch.randn(4096, 256, device="cuda", generator=g).to(torch.bfloat16)
    return {
        "model": {"w": w, "emb": emb, "head": emb, "bias_view": w[:1000]},
        "optim": {"exp_avg": torch.randn(n, device="cuda", generator=g),
                  "exp_avg_sq": torch.rand(n, device="cuda", generator=g),
                  "step": torch.tensor(7.0, device="cuda")},
        "ints": torch.arange(1000, device="cuda", dtype=torch.int64),
        "iteration": 7,
    }


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def clone(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    return obj


def check(name: str, ok: bool, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)
    if not ok:
        failures.append(name)


def check_daemon(root: Path, big: dict[str, object], floor: float, failures: list[str]) -> None:
    """5. through fastpersistd: the CUDA state is copied into shared memory that is
    page-locked with cudaHostRegister; stall against the same D2H floor."""
    sockdir = Path(tempfile.mkdtemp(prefix="fpd-"))
    droot = root / "daemon"
    droot.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "fastpersist.daemon", "--root", str(droot),
                             "--socket", str(sockdir / "s"), "--log-level", "warning"])
    address = f"unix://{sockdir / 's'}"
    try:
        client = DaemonClient(address)
        deadline = time.monotonic() + 60
        while True:
            try:
                if client.health() == "SERVING":
                    break
            except fastpersist.CheckpointError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        before = clone(big)
        fut = fastpersist.async_save(big, droot / "ck", wait_for_snapshot=False, daemon=address)
        fut.wait_snapshot()
        for t in (big["model"]["w"], big["optim"]["exp_avg"]):  # type: ignore[index]
            t.mul_(-1).add_(1)
        fut.result()
        check("daemon: async_save of a CUDA state, consistent under GPU mutation",
              same(before, fastpersist.load(droot / "ck")), failures)
        stalls, persists = [], []
        for i in range(3):
            t0 = time.perf_counter()
            fut = fastpersist.async_save(big, droot / f"stall-{i}", daemon=address)
            stalls.append(time.perf_counter() - t0)
            fut.result()
            persists.append(fut.persist_seconds or 0.0)
            shutil.rmtree(droot / f"stall-{i}")
        stall = statistics.median(stalls)
        print(f"INFO  daemon: async_save stall {stall * 1000:.1f} ms = {stall / floor:.2f}x the "
              f"D2H floor (samples {', '.join(f'{s * 1000:.0f}' for s in stalls)} ms); "
              f"persist {statistics.median(persists):.2f} s")
    finally:
        proc.terminate()
        proc.wait(120)
        shutil.rmtree(sockdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default=None)
    p.add_argument("--gib", type=float, default=1.0, help="state size for the stall check")
    p.add_argument("--no-daemon", action="store_true",
                   help="skip the checks through a locally started fastpersistd")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="fp-gpu-"))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; dir {root}")
    failures: list[str] = []

    state = cuda_state(64 << 20)
    fastpersist.save(state, root / "sync")
    back = fastpersist.load(root / "sync")
    check("save/load CUDA round trip, restored to cuda", same(state, back) and
          back["model"]["w"].is_cuda and back["model"]["head"] is back["model"]["emb"], failures)
    cpu = fastpersist.load(root / "sync", map_location="cpu")
    check("load with map_location='cpu'", same(state, cpu) and not cpu["model"]["w"].is_cuda,
          failures)
    for ring in (str(256 << 20), str(64 << 10)):  # the default, and a ring smaller than a tensor
        os.environ["FASTPERSIST_LOAD_RING_BYTES"] = ring
        ringed = fastpersist.load(root / "sync", map_location="cuda:0")
        check(f"load with map_location='cuda:0' through a {ring}-byte pinned ring",
              same(state, ringed) and ringed["model"]["w"].is_cuda, failures)
        into = clone(state)  # the caller's CUDA tensors, other values
        for t in (into["model"]["w"], into["optim"]["exp_avg"]):  # type: ignore[index]
            t.zero_()
        kept = into["model"]["w"].data_ptr()  # type: ignore[index]
        loaded = fastpersist.load(root / "sync", map_location="cuda:0", into=into)
        check(f"load(into=CUDA tensors) through a {ring}-byte pinned ring",
              same(state, loaded) and loaded["model"]["w"] is into["model"]["w"]  # type: ignore[index]
              and into["model"]["w"].data_ptr() == kept, failures)  # type: ignore[index]
    del os.environ["FASTPERSIST_LOAD_RING_BYTES"]

    before = clone(state)
    fut = fastpersist.async_save(state, root / "async", wait_for_snapshot=False)
    fut.wait_snapshot()
    for t in (state["model"]["w"], state["optim"]["exp_avg"]):  # type: ignore[index]
        t.mul_(-1).add_(1)  # GPU kernels right after the snapshot
    fut.result()
    check("async_save snapshot is consistent under GPU mutation",
          same(before, fastpersist.load(root / "async")), failures)

    big = cuda_state(int(args.gib * (1 << 30)))
    parts: list[dict[str, torch.Tensor]] = [big["model"], big["optim"]]  # type: ignore[list-item]
    tensors = [t for d in parts for t in d.values()]
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    floors, stalls = [], []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(pinned, tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        floors.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fut = fastpersist.async_save(big, root / f"stall-{i}")
        stalls.append(time.perf_counter() - t0)
        fut.result()
        shutil.rmtree(root / f"stall-{i}")
    floor, stall = statistics.median(floors), statistics.median(stalls[1:])
    print(f"INFO  D2H floor {floor * 1000:.1f} ms ({nbytes / floor / 1e9:.1f} GB/s pinned); "
          f"async_save stall, saves 2-6: {stall * 1000:.1f} ms = {stall / floor:.2f}x the floor "
          f"(samples {', '.join(f'{s * 1000:.0f}' for s in stalls)} ms; staging "
          f"{pipeline_for().staging_bytes / 2**30:.2f} GiB); all five of saves 2-6 within "
          f"1.3x: {'yes' if max(stalls[1:]) <= 1.3 * floor else 'NO'} (issue 14)")
    # The first save of a fresh saver, without and with prepare_staging beforehand
    # (the first one pins its staging: the lead for the 11x sample of run2).
    firsts = []
    for prepare in (False, True):
        saver = pipeline_for("", shared=False)  # a fresh in-process pipeline
        t0 = time.perf_counter()
        if prepare:
            saver.prepare_staging(big)
        prepared = time.perf_counter() - t0
        t0 = time.perf_counter()
        fut = saver.save(big, root / f"first-{prepare}")
        firsts.append(time.perf_counter() - t0)
        fut.result()
        saver.close()
        shutil.rmtree(root / f"first-{prepare}")
    print(f"INFO  first async_save of a fresh pipeline: {firsts[0] * 1000:.0f} ms = "
          f"{firsts[0] / floor:.1f}x the floor without prepare_staging, {firsts[1] * 1000:.0f} ms "
          f"= {firsts[1] / floor:.2f}x after it (prepare_staging took {prepared * 1000:.0f} ms)")

    if not args.no_daemon:
        check_daemon(root, big, floor, failures)

    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()

    def compute() -> float:
        t0 = time.perf_counter()
        for _ in range(50):
            a.matmul(a)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    alone = compute()
    fut = fastpersist.async_save(big, root / "overlap")
    during = compute()
    persist_pending = not fut.done()
    fut.result()
    print(f"INFO  GPU compute alone {alone * 1000:.0f} ms, during persist {during * 1000:.0f} ms "
          f"(persist still running at the end of compute: {persist_pending}); "
          f"persist {fut.persist_seconds:.2f} s")
    shutil.rmtree(root, ignore_errors=True)
    print("FAILED: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
