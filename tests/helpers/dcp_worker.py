"""One rank of a gloo job for tests/test_integration_dcp.py: DCP through
fastpersist's FastPersistWriter/Reader.

    python dcp_worker.py SCENARIO OUT_DIR ARGS_JSON

Rank and rendezvous come from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Each rank writes OUT_DIR/rank-R.json: {"ok": ...} or {"error"}.

Scenarios:
    save   an FSDP2 model (fully_shard over all ranks) and its Adam state from
           get_state_dict, a large DTensor sharded by columns, and non-tensor
           values (bytes items): dcp.save (args["async"]: dcp.async_save;
           args["executor"] == "process": DCP's process executor, saving
           args["saves"] times, each replacing the last) to args["path"];
           rank 0 also writes args["reference"], the full tensors by DCP fqn
           (torch.save) to compare loads against
    stage  DTensors of several dtypes (a 0-d one among them) staged by
           FastPersistStager: equal to the sources, each on a storage of its
           own starting at its first byte, and through torch.multiprocessing's
           pickler (what DCP's process executor uses) and back unchanged
    load   the same model and DTensor on this job's ranks (rows, a different
           layout), from a fresh seed: dcp.load from args["path"], then
           set_state_dict; reports which fqns differ from the reference and
           the bytes the reader read
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

BIG = (8192, 1024)  # 32 MiB of float32: each stored column chunk spans several CRC blocks


def model_and_optim(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state(mesh: Any, seed: int, big_placement: Any) -> tuple[dict[str, Any], Any, Any]:
    model, opt = model_and_optim(mesh, seed)
    msd, osd = get_state_dict(model, opt)
    g = torch.Generator().manual_seed(seed)
    big = distribute_tensor(torch.randn(BIG, generator=g), mesh, [big_placement])
    extra = {"step": 1000 + seed, "note": f"seed {seed}", "blob": bytes(range(256)) * seed}
    return {"model": msd, "optim": osd, "big": big, "extra": extra}, model, opt


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def run(scenario: str, args: dict[str, Any]) -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if scenario == "save":
        sd, _, _ = state(mesh, 1, Shard(1))
        if args.get("executor") == "process":
            # Earlier saves hold other values: the last one must win.
            for _ in range(args["saves"]):
                for t in sd["model"].values():
                    t.to_local().add_(1)
                dcp.async_save(sd, storage_writer=FastPersistWriter(args["path"]),
                               async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
            from fastpersist.integrations.dcp.stager import shared_pool

            # Each snapshot went to DCP's save process: none may stay counted.
            if shared_pool().allocated_bytes:
                return {"error": f"staging still holds {shared_pool().allocated_bytes} bytes"}
        elif args.get("async"):
            dcp.async_save(sd, storage_writer=FastPersistWriter(args["path"])).result()
        else:
            dcp.save(sd, storage_writer=FastPersistWriter(args["path"]))
        flat, _ = flatten_state_dict(sd)
        reference = {k: full(v) for k, v in flat.items()}
        if dist.get_rank() == 0:
            torch.save(reference, args["reference"])
        return {"ok": True}
    if scenario == "stage":
        return stage_scenario(mesh)
    if scenario == "load":
        sd, model, opt = state(mesh, 2, Shard(0))
        reader = FastPersistReader(args["path"])
        dcp.load(sd, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        msd, osd = get_state_dict(model, opt)
        got, _ = flatten_state_dict({**sd, "model": msd, "optim": osd})
        reference = torch.load(args["reference"], weights_only=False)
        differ = [k for k, v in reference.items()
                  if (isinstance(v, torch.Tensor) and not torch.equal(full(got[k]), v))
                  or (not isinstance(v, torch.Tensor) and got[k] != v)]
        missing = sorted(set(reference) - set(got))
        return {"ok": not differ and not missing, "differ": differ, "missing": missing,
                "bytes_read": reader.bytes_read}
    raise ValueError(f"unknown scenario {scenario}")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # bytes: float8 has no torch.equal


def stage_scenario(mesh: Any) -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    from torch.distributed.tensor import Replicate

    from fastpersist.integrations.dcp import FastPersistStager

    g = torch.Generator().manual_seed(3)
    sources = {str(dtype): DTensor.from_local(  # no collective: gloo has no float8
        (torch.randn(37, 5, generator=g) * 9).to(dtype), mesh, [Shard(0)], run_check=False)
               for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8,
                             torch.bool, torch.float64, torch.float8_e4m3fn)}
    sources["scalar"] = DTensor.from_local(torch.tensor(4.5), mesh, [Replicate()],
                                           run_check=False)
    sources["plain"] = torch.arange(7)
    staged, lease = FastPersistStager().stage_leased({"s": sources})
    assert lease is not None
    out = staged["s"]
    problems = []
    for k, v in sources.items():
        local = out[k].to_local() if isinstance(out[k], DTensor) else out[k]
        want = v.to_local() if isinstance(v, DTensor) else v
        if local.dtype != want.dtype or not torch.equal(_raw(local), _raw(want)):
            problems.append(f"{k}: staged differs")
        if local.storage_offset() or local.untyped_storage().nbytes() != local.nbytes:
            problems.append(f"{k}: not a storage of its own")
    back = ForkingPickler.loads(ForkingPickler.dumps(out))
    for k, v in out.items():
        a = back[k].to_local() if isinstance(back[k], DTensor) else back[k]
        b = v.to_local() if isinstance(v, DTensor) else v
        if not torch.equal(_raw(a), _raw(b)):
            problems.append(f"{k}: changed through the pickler")
    return {"ok": not problems, "problems": problems}


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        report = run(scenario, args)
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, **report}))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
