"""torchtitan's checkpoint manager, saving and loading through fastpersist.

    python examples/torchtitan_example.py [DIR]                       # one process
    torchrun --nproc-per-node 2 examples/torchtitan_example.py [DIR]  # two gloo ranks

Builds torchtitan's own optimizer and LR-scheduler containers over a small
FSDP2 model, checkpoints every 2 steps with FastPersistCheckpointManager
(async_mode="async", keep_latest_k=2), then builds everything again from
another seed, lets the manager load the latest checkpoint, checks that the
step and the model are bit for bit those saved, and trains on from there.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from fastpersist.integrations.torchtitan import FastPersistCheckpointManager


class TrainState:
    """The step counter, a Stateful as torchtitan's trainer keeps it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def cosine(step: int) -> float:
    return 0.5 * (1 + torch.cos(torch.tensor(step / 20 * torch.pi)).item())


def build(seed: int, root: Path, *, interval: int = 2, async_mode: str = "async"
          ) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer(optimizers, cosine)
    state = TrainState()
    # The one change from torchtitan's own: FastPersistCheckpointManager.Config
    # where a trainer config has CheckpointManager.Config (the same fields).
    manager = FastPersistCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=interval, keep_latest_k=2,
        async_mode=async_mode,
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers,
            lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
            base_folder=str(root))
    return model, optimizers, schedulers, state, manager


def train(model: Any, optimizers: Any, schedulers: Any, state: Any, manager: Any,
          steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        state.step = step
        manager.save(step)


def weights(model: Any) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()]


def main(root: Path) -> None:
    if "RANK" not in os.environ:  # one process: a gloo group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    model, optimizers, schedulers, state, manager = build(0, root)
    train(model, optimizers, schedulers, state, manager, range(1, 7))  # saves at 2, 4, 6
    manager.maybe_wait_for_saving()
    train(model, optimizers, schedulers, state, manager, range(7, 9))  # saves at 8
    manager.maybe_wait_for_saving()
    expected = weights(model)
    manager.close()

    # A restart: everything built again, from another seed, then the latest checkpoint.
    model, optimizers, schedulers, state, manager = build(1, root)
    dist.barrier()  # (rank 0 may still be purging step-6)
    assert manager.load(), "no checkpoint found"
    assert state.step == 8, state.step
    assert all(torch.equal(a, b) for a, b in zip(weights(model), expected, strict=True))
    train(model, optimizers, schedulers, state, manager, range(9, 11))
    manager.maybe_wait_for_saving()
    manager.close()
    dist.barrier()
    if dist.get_rank() == 0:
        kept = sorted(p.name for p in (root / "checkpoint").iterdir())
        print(f"resumed from step 8 bit-exactly; trained to step 10; kept {kept}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fp-tt-")))
