"""fastpersist demo: train, checkpoint, "crash", restore, and carry on bit-exactly.

Trains a small GPT-style transformer (torch.nn, AdamW) on a synthetic token
stream, checkpoints model + optimizer + RNG state with fastpersist.save, then
restores the latest checkpoint into a fresh model and optimizer and checks that
training continues with exactly the same losses as the run that never stopped.
Finally it lists and verifies the checkpoints with fpctl.

    python examples/demo.py [--root demo-checkpoints] [--steps 12] [--every 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, GPTConfig, train_step, unique_bytes

import fastpersist
from fastpersist.cli import main as fpctl


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
    args = p.parse_args()
    torch.manual_seed(0)
    root = Path(args.root).absolute()
    shutil.rmtree(root, ignore_errors=True)

    model, opt = make_model(args)
    params = sum(t.numel() for t in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters; checkpoints in {root}")
    last_saved = None
    for step in range(1, args.steps + 1):
        loss = train_step(model, opt, step, args.batch)
        if step % args.every == 0:
            state = checkpoint_state(model, opt, step)
            t0 = time.perf_counter()
            fastpersist.save(state, root / f"step-{step:06d}")
            dt = time.perf_counter() - t0
            nbytes = unique_bytes(state)
            print(f"step {step:4d} loss {loss:.4f}  saved {nbytes / 2**20:.0f} MiB in {dt:.2f} s "
                  f"({nbytes / dt / 1e9:.2f} GB/s, durable)")
            last_saved = step
    assert last_saved is not None, "--steps must be at least --every"

    # The run that never stopped carries on for a few steps...
    after = range(args.steps + 1, args.steps + 4)
    reference = [train_step(model, opt, s, args.batch) for s in after]

    # ...and a fresh process restores the latest checkpoint and does the same.
    latest = root / f"step-{last_saved:06d}"
    t0 = time.perf_counter()
    restored = fastpersist.load(latest)
    dt = time.perf_counter() - t0
    print(f"restored {latest.name} in {dt:.2f} s (every tensor's CRC32C checked)")
    model2, opt2 = make_model(args)
    model2.load_state_dict(restored["model"])
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
    t0 = time.perf_counter()
    fastpersist.save(state, root / "compare")
    dt_fp = time.perf_counter() - t0
    print(f"same state: torch.save+fsync {dt_torch:.2f} s, fastpersist.save {dt_fp:.2f} s "
          "(one sample; see benchmarks/ for measurements)")
    (root / "torch-save.pt").unlink()
    shutil.rmtree(root / "compare")

    print(f"\n$ fpctl ls {root}")
    fpctl(["ls", str(root)])
    print(f"\n$ fpctl verify {latest}")
    return fpctl(["verify", str(latest)])


if __name__ == "__main__":
    raise SystemExit(main())
