"""One rank of a pipeline-parallel x data-parallel gloo job (tests/test_pipeline_stages.py).

    python stage_worker.py SCENARIO OUT_DIR ARGS_JSON

Ranks 2s and 2s+1 are the two data-parallel replicas of pipeline stage s
(world 4: stages 0 and 1). Each stage holds its layers of one small model,
keyed by their names in the whole model, its optimizer's state keyed by
parameter name (get_optimizer_state_dict, flattened), a tied embedding that
the first and last stages both hold, and values of its own. Writes
OUT_DIR/rank-R.json: {"ok": ...} or {"error": ...}.

Scenarios:
    save      save with union=True, then load into a zeroed copy (into=) and
              check it bit-exactly; report the keys of a whole load
    indexed   union=True with torch.optim's index-keyed state_dict on each stage
    no_union  the stages' states without union=True
    die_joining  save once, then save again with rank 2 (stage 1's first)
              SIGKILLed as it would send rank 0 its tree (union=True's own step)
    node_local  save with union=True and node_local=True, ranks 0 and 2 on node
              "a", 1 and 3 on "b" (a replica of each stage on each), to
              args["path"] with "{node}" replaced
    diverged  save, with rank 3's "step" unlike rank 2's (replicas of stage 1)
    tp        each stage's layers tensor-parallel over its 2 ranks (DTensors
              sharded by rows), saved with union=True and loaded with like=
              into column shards; reports where a weight came back wrong
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import fastpersist

LAYERS, STAGES = 4, 2


def whole_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8),
                                "layers": torch.nn.ModuleList(
                                    torch.nn.Linear(8, 8) for _ in range(LAYERS))})


def stage_state(stage: int, indexed: bool) -> dict[str, Any]:
    model = whole_model()
    mine = range(stage * LAYERS // STAGES, (stage + 1) * LAYERS // STAGES)
    for n in range(LAYERS):  # this stage's layers only, under their names in the model
        if n not in mine:
            model.layers[n] = torch.nn.Identity()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # The tied embedding's gradient is the same on both stages (pipeline
    # jobs all-reduce it between them), so its states are replicas.
    loss = model.embed(torch.arange(4)).sum()
    for n in mine:
        loss = loss + model.layers[n](torch.ones(4, 8) * (n + 1)).square().sum()
    loss.backward()
    opt.step()
    optim = opt.state_dict() if indexed else get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model.state_dict(), "optim": optim, "step": 7,
            f"stage{stage}": {"lr": 1e-3 * (stage + 1), "micro_batches": 4 + stage}}


def zeroed(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, zeroed(v)) for k, v in obj.items())
    return obj


def digests(obj: Any, path: str = "") -> dict[str, str]:
    """Each value of a nested state by its path: a tensor's bytes' SHA-256, else repr."""
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items()
                for k, v in digests(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(obj, torch.Tensor):
        return {path: hashlib.sha256(obj.contiguous().numpy().tobytes()).hexdigest()}
    return {path: repr(obj)}


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where b, loaded, lacks or differs from what a holds."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) - set(b):
            return [path]
        return [p for k in a for p in same(a[k], b[k], f"{path}.{k}")]
    return [] if a == b else [path]


def tensor_parallel_stages(path: str) -> list[str]:
    """The tp scenario: what came back wrong (empty: nothing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (STAGES, dist.get_world_size() // STAGES),
                            mesh_dim_names=("pp", "tp"))
    stage, tp = mesh.get_coordinate()[0], mesh["tp"]  # type: ignore[index]
    full = whole_model().state_dict()
    mine = [k for k in full for n in range(stage * LAYERS // STAGES,
                                           (stage + 1) * LAYERS // STAGES)
            if k.startswith(f"layers.{n}.")]

    def sharded(t: torch.Tensor, dim: int) -> torch.Tensor:
        return distribute_tensor(t, tp, [Shard(dim)]) if t.dim() == 2 else t

    state = {"model": {k: sharded(full[k], 0) for k in mine}, f"stage{stage}": {"tp": 2}}
    fastpersist.save(state, path, process_group=dist.group.WORLD, union=True)
    like = {"model": {k: sharded(torch.zeros_like(full[k]), 1) for k in mine}}
    back = fastpersist.load(path, like=like)["model"]
    wrong = sorted(set(back) ^ set(mine))
    for k in mine:
        t = back[k]
        if isinstance(t, DTensor):
            if t.placements != (Shard(1),) or not torch.equal(t.full_tensor(), full[k]):
                wrong.append(k)
        elif full[k].dim() == 2 or not torch.equal(t, full[k]):
            wrong.append(k)
    return wrong


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    report: dict[str, Any] = {"rank": rank}
    try:
        path = args["path"]
        if scenario == "tp":
            report["wrong"] = tensor_parallel_stages(path)
        elif scenario == "node_local":
            node = "ab"[rank % 2]
            os.environ["FASTPERSIST_NODE"] = node
            state = stage_state(rank * STAGES // dist.get_world_size(), indexed=False)
            fastpersist.save(state, path.replace("{node}", node), union=True, node_local=True,
                             process_group=dist.group.WORLD)
            report["digests"] = digests(state)
        elif scenario == "die_joining":
            state = stage_state(rank * STAGES // dist.get_world_size(), indexed=False)
            fastpersist.save(state, path, process_group=dist.group.WORLD, union=True)
            if rank == 2:
                from fastpersist.distributed.coordinator import Save

                Save._join_trees = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
            state["step"] = 8
            fastpersist.save(state, path, process_group=dist.group.WORLD, union=True)
        else:
            report.update(save_and_load(scenario, path, args, rank))
        report["ok"] = True
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["trace"] = traceback.format_exc()[-2000:]
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def save_and_load(scenario: str, path: str, args: dict[str, Any], rank: int
                  ) -> dict[str, Any]:
    """The save, indexed, no_union and diverged scenarios: what the rank saw."""
    stage = rank * STAGES // dist.get_world_size()
    state = stage_state(stage, indexed=scenario == "indexed")
    if scenario == "diverged" and rank == 3:  # stage 1's second replica has drifted
        state["step"] = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastpersist.save(state, path, process_group=dist.group.WORLD,
                         union=scenario != "no_union")
    back = fastpersist.load(path, into=zeroed(state))
    report = {"differs": same(state, back),
              "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
              # Values outside the rank's tensors come back whole (load's into=): the other
              # stage's.
              "extra": sorted(set(back) - set(state)),
              "keys": sorted(fastpersist.load(path)["model"])}
    if "root" in args:  # the same through async_save and a Checkpointer
        fastpersist.async_save(state, args["root"] + "/async", union=True,
                               process_group=dist.group.WORLD).result()
        ckpt = fastpersist.Checkpointer(args["root"] + "/run", keep_last=1, union=True,
                                        process_group=dist.group.WORLD)
        ckpt.save(1, state).result()
        report["checkpointer_differs"] = same(state, ckpt.load_latest(into=zeroed(state)))
        ckpt.close()
        report["async_differs"] = same(state, fastpersist.load(
            args["root"] + "/async", into=zeroed(state)))
    return report


if __name__ == "__main__":
    main()
