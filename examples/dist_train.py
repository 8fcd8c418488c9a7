"""Data-parallel training that checkpoints with one writer per unique byte.

    torchrun --nproc-per-node 4 examples/dist_train.py --root /tmp/dist-ckpts
    # several machines: torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 ...
    # with --root on storage every node sees

Each rank trains the same small GPT with DistributedDataParallel (gloo, on the
CPU here; NCCL on GPUs works the same: checkpoint traffic runs over a gloo group
of fastpersist's own). A Checkpointer with the job's process group saves model,
optimizer and step every --every steps, asynchronously: each rank copies only
the quarter (with 4 ranks) of the unique bytes it was assigned, and the writes
and the global commit overlap the next steps. At the end every rank restores
the latest checkpoint and checks it bit-exactly against the state it saved,
and rank 0 prints how the bytes were split.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig, synthetic_batch, tensors_of
from torch.nn.parallel import DistributedDataParallel

import fastpersist
from fastpersist.distributed.coordinator import tensor_bytes_by_rank
from fastpersist.tensors.checkpoint import read_manifest


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("dist-checkpoints"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    cfg = GPTConfig(vocab=4096, dim=256, layers=2, heads=4)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if rank == 0:  # a fresh run: a Checkpointer refuses to save over an earlier run's steps
        shutil.rmtree(args.root, ignore_errors=True)
    dist.barrier()
    ckpt = fastpersist.Checkpointer(args.root.resolve(), keep_last=2,
                                    process_group=dist.group.WORLD)
    saved: dict[int, dict[str, Any]] = {}
    for step in range(args.steps):
        data = synthetic_batch(step * world + rank, cfg, 8)  # each rank its own batch
        logits = ddp(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab),
                                                 data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces: the replicas stay identical
        opt.step()
        if step % args.every == 0 or step == args.steps - 1:
            state = state_of(model, opt, step)
            ckpt.save(step, state)  # returns after this rank's share is copied
            saved[step] = copy.deepcopy(state)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    ckpt.close()  # waits for the last save's commit

    latest = ckpt.latest()
    assert latest is not None
    restored = ckpt.load_latest()
    expected = saved[restored["step"]]
    same = all(torch.equal(a, b) for a, b in zip(tensors_of(restored), tensors_of(expected),
                                                  strict=True))
    flags = [None] * world
    dist.all_gather_object(flags, same)
    if rank == 0:
        per_rank = tensor_bytes_by_rank(read_manifest(latest))
        total = sum(per_rank.values())
        print(f"checkpoints kept: {ckpt.steps()}; latest {latest.name}: {total / 2**20:.1f} MiB "
              f"of unique tensor bytes, written by rank: "
              + ", ".join(f"{r}: {n / 2**20:.1f} MiB" for r, n in per_rank.items()))
        print(f"restored step {restored['step']} on {world} ranks, bit-exact on all: {all(flags)}")
    # Every rank tears gloo down together: a rank that destroys its group while
    # another still talks to it can abort at exit ("terminate called without an
    # active exception", seen once in CI on a loaded machine).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(flags) else 1


if __name__ == "__main__":
    sys.exit(main())
