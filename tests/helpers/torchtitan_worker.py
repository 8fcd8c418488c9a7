"""One rank of a gloo job for tests/test_integration_torchtitan.py: torchtitan's
CheckpointManager as FastPersistCheckpointManager, with torchtitan's own
optimizer and LR-scheduler containers over an FSDP2 model, all built as
examples/torchtitan_example.py builds them (checkpointing every step here).

    python torchtitan_worker.py SCENARIO OUT_DIR ARGS_JSON

Rank and rendezvous come from the environment. Each rank writes
OUT_DIR/rank-R.json: {"ok": ...} or {"error": ...}.

Scenarios:
    train  4 training steps, manager.save(step) after each (args["async_mode"]),
           keep_latest_k=2; writes each rank's model and optimizer shards and
           the LR after step 4 to OUT_DIR/expected-R.pt
    resume a model and optimizer from another seed: manager.load() (the latest
           committed step), then reports the step restored and which shards,
           and whether the LR, differ from expected-R.pt
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from torchtitan_example import build  # the example's model, containers and manager


def local(value: Any) -> Any:
    return value.to_local().clone() if isinstance(value, DTensor) else value


def shards(model: Any, optimizers: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizers.optimizers[0])
    flat = {f"model.{k}": local(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = local(v)
    return flat


def run(scenario: str, out: Path, args: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    base = Path(args["base"])
    expected_file = out.parent / "train" / f"expected-{rank}.pt"
    if scenario == "train":
        model, optimizers, schedulers, train_state, manager = build(
            0, base, interval=1, async_mode=args["async_mode"])
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(1, 5):
            model(torch.randn(16, 64, generator=g)).square().mean().backward()
            optimizers.step()
            optimizers.zero_grad()
            schedulers.step()
            train_state.step = step
            manager.save(step)
        manager.maybe_wait_for_saving()
        torch.save({"shards": shards(model, optimizers),
                    "lr": schedulers.schedulers[0].get_last_lr()}, expected_file)
        manager.close()  # joins the purge thread: its removals are done
        dist.barrier()
        return {"ok": True, "folder": sorted(os.listdir(base / "checkpoint"))}
    if scenario == "resume":
        if rank == 0:
            # An uncommitted step folder and an unfinished save's staging
            # directory, both newer: neither may be taken for the latest.
            (base / "checkpoint" / "step-8").mkdir()
            hidden = base / "checkpoint" / ".step-9.fp-tmp-1234-abcd1234@host"
            hidden.mkdir()
            (hidden / "manifest.json").write_text("{}")
        dist.barrier()
        model, optimizers, schedulers, train_state, manager = build(
            1, base, interval=1, async_mode=args["async_mode"])
        loaded = manager.load()
        expected = torch.load(expected_file)
        got = shards(model, optimizers)
        differ = sorted(k for k, v in expected["shards"].items()
                        if not torch.equal(got[k], v))
        manager.close()
        return {"ok": True, "loaded": loaded, "step": train_state.step, "differ": differ,
                "compared": len(expected["shards"]),
                "lr_equal": schedulers.schedulers[0].get_last_lr() == expected["lr"]}
    raise ValueError(f"unknown scenario {scenario}")


def main() -> None:
    scenario, out_dir, args_json = sys.argv[1:4]
    out = Path(out_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        report = run(scenario, out, json.loads(args_json))
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
