"""fastpersist demo: train, checkpoint through fastpersistd, restore, carry on bit-exactly.

Starts a local fastpersistd (the per-node daemon) on a Unix socket with its root
on local disk, trains a small GPT-style transformer (torch.nn, AdamW) on a
synthetic token stream and checkpoints model + optimizer + RNG state through the
daemon with a Checkpointer: each save copies the state into shared memory and
returns; the daemon writes it with O_DIRECT and commits it. Then it restores the
latest checkpoint into a fresh model and optimizer and checks that training
continues with exactly the same losses as the run that never stopped. Finally
fpctl asks the daemon for its status and lists and verifies the checkpoints.

    python examples/demo.py [--root demo-checkpoints] [--steps 12] [--every 4]
                            [--daemon unix:///PATH | --in-process]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, GPTConfig, train_step, unique_bytes

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.protocol.client import DaemonClient


def make_model(args: argparse.Namespace) -> tuple[GPT, torch.optim.Optimizer]:
    cfg = GPTConfig(vocab=args.vocab, ctx=args.ctx, dim=args.dim, layers=args.layers,
                    heads=args.heads)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return model, opt


def checkpoint_state(model: GPT, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state()}


def torch_save_durably(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def start_daemon(root: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """fastpersistd on a temporary socket, serving `root`, as a deployment would
    run it (systemd or a DaemonSet; see deploy/)."""
    sockdir = Path(tempfile.mkdtemp(prefix="fastpersistd-"))
    socket = sockdir / "fastpersistd.sock"
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "fastpersist.daemon", "--root", str(root),
                             "--socket", str(socket), "--log-format", "text",
                             "--log-level", "warning"])
    address = f"unix://{socket}"
    deadline = time.monotonic() + 30
    client = DaemonClient(address)
    while True:
        try:
            if socket.exists() and client.health() == "SERVING":
                break
        except fastpersist.CheckpointError:
            pass  # not listening yet
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"fastpersistd did not start (exit status {proc.poll()})")
        time.sleep(0.1)
    client.close()
    print(f"started fastpersistd (pid {proc.pid}) at {address}, root {root}")
    return proc, address, sockdir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="demo-checkpoints", help="checkpoint directory (local disk)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--daemon", help="use this running fastpersistd instead of starting one "
                       "(--root must lie under its root)")
    where.add_argument("--in-process", action="store_true", help="save without a daemon")
    args = p.parse_args()
    torch.manual_seed(0)
    root = Path(args.root).absolute()
    shutil.rmtree(root, ignore_errors=True)
    daemon = None
    address = args.daemon or ""
    if not args.daemon and not args.in_process:
        daemon, address, sockdir = start_daemon(root)
    try:
        return run(args, root, address)
    finally:
        if daemon is not None:
            daemon.terminate()  # SIGTERM: finishes what it was handed, then exits
            daemon.wait(60)
            shutil.rmtree(sockdir, ignore_errors=True)


def run(args: argparse.Namespace, root: Path, address: str) -> int:

    model, opt = make_model(args)
    params = sum(t.numel() for t in model.parameters())
    how = f"through fastpersistd at {address}" if address else "in-process"
    print(f"model: {params / 1e6:.1f}M parameters; checkpoints in {root / 'run'}, {how}")
    checkpointer = fastpersist.Checkpointer(root / "run", keep_last=2, daemon=address)
    for step in range(1, args.steps + 1):
        loss = train_step(model, opt, step, args.batch)
        if step == 1:  # the optimizer's state exists from its first step on
            t0 = time.perf_counter()
            ready = checkpointer.prepare_staging(checkpoint_state(model, opt, step))
            print(f"staging prepared: {ready / 2**20:.0f} MiB in {time.perf_counter() - t0:.2f} s "
                  "(so the first checkpoint stalls no longer than the others)")
        if step % args.every == 0:
            state = checkpoint_state(model, opt, step)
            future = checkpointer.save(step, state)  # returns once the snapshot is taken
            nbytes = unique_bytes(state)
            stall = future.snapshot_seconds or 0.0
            future.result()  # only so the demo can print the time; training need not wait
            print(f"step {step:4d} loss {loss:.4f}  checkpoint {nbytes / 2**20:.0f} MiB: "
                  f"training stalled {stall * 1e3:.0f} ms, durable after "
                  f"{(future.persist_seconds or 0) + stall:.2f} s")
    checkpointer.close()
    latest = checkpointer.latest()
    assert latest is not None, "--steps must be at least --every"
    last_saved = int(latest.name.removeprefix("step-"))

    # The run that never stopped carries on for a few steps...
    after = range(args.steps + 1, args.steps + 4)
    reference = [train_step(model, opt, s, args.batch) for s in after]

    # ...and a fresh process restores the latest checkpoint and does the same.
    model2, opt2 = make_model(args)
    t0 = time.perf_counter()
    # into=: the weights land in model2's own tensors (no second copy, no
    # load_state_dict); the fresh optimizer has no state yet, so its comes back
    # new. into= reads only what it names: name the optimizer and the RNG too.
    restored = fastpersist.load(latest, into={"model": model2.state_dict(),
                                              "optimizer": opt2.state_dict(),
                                              "rng": torch.get_rng_state()})
    dt = time.perf_counter() - t0
    print(f"restored {latest.name} in {dt:.2f} s (every tensor's CRC32C checked)")
    opt2.load_state_dict(restored["optimizer"])
    torch.set_rng_state(restored["rng"])
    for s in range(last_saved + 1, args.steps + 1):  # steps done after the last checkpoint
        train_step(model2, opt2, s, args.batch)
    resumed = [train_step(model2, opt2, s, args.batch) for s in after]
    print(f"losses after restore: {resumed}")
    print(f"losses without stop:  {reference}")
    if resumed != reference:
        print("FAIL: the restored run diverged from the original")
        return 1
    print("OK: training resumed bit-exactly from the checkpoint")

    # The same state with torch.save + fsync, for scale (one sample, not a benchmark).
    state = checkpoint_state(model, opt, args.steps)
    t0 = time.perf_counter()
    torch_save_durably(state, root / "torch-save.pt")
    dt_torch = time.perf_counter() - t0
    fastpersist.save(state, root / "compare", daemon=address)  # first: allocates staging
    t0 = time.perf_counter()
    fastpersist.save(state, root / "compare", daemon=address)
    dt_fp = time.perf_counter() - t0
    print(f"same state: torch.save+fsync {dt_torch:.2f} s, fastpersist.save {dt_fp:.2f} s "
          "(one sample; see benchmarks/ for measurements)")
    (root / "torch-save.pt").unlink()
    shutil.rmtree(root / "compare")

    if address:
        print(f"\n$ fpctl daemon status --daemon {address}")
        fpctl(["daemon", "status", "--daemon", address])
    print(f"\n$ fpctl ls {root / 'run'}")
    fpctl(["ls", str(root / "run")])
    print(f"\n$ fpctl verify {latest}")
    return fpctl(["verify", str(latest)])


if __name__ == "__main__":
    raise SystemExit(main())
