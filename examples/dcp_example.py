"""torch.distributed.checkpoint (DCP) saving and loading through fastpersist.

    python examples/dcp_example.py [DIR]                       # one process
    torchrun --nproc-per-node 2 examples/dcp_example.py [DIR]  # two gloo ranks

Trains a small model for a few steps, checkpoints model and optimizer with
dcp.save and dcp.async_save through FastPersistWriter, loads the last
checkpoint into a fresh model and optimizer with FastPersistReader, and checks
that training resumed from it matches training that never stopped. Under
torchrun, every rank holds the same (replicated) model, as in DDP; DCP writes
each tensor once.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastpersist
from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main(root: Path) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    model, opt = make()
    future = None
    for step in (5, 10):
        train(model, opt, range(step - 5, step))
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        if step == 5:
            dcp.save(state, storage_writer=FastPersistWriter(root / f"step-{step}"))
        else:  # returns once the snapshot is taken; written while training goes on
            future = dcp.async_save(state, storage_writer=FastPersistWriter(root / f"step-{step}"))
    assert future is not None
    future.result()  # durable and committed
    train(model, opt, range(10, 15))  # the run that never stopped

    resumed, resumed_opt = make()
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=FastPersistReader(root / "step-10"))
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    train(resumed, resumed_opt, range(10, 15))
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"
    # The same directory is a fastpersist checkpoint: {fqn: whole tensor}.
    flat = fastpersist.load(root / "step-10")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"saved steps 5 and 10 through FastPersistWriter, resumed from step 10 "
              f"bit-exactly; fastpersist.load sees {len(flat)} items")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
