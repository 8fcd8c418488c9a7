"""One rank of a gloo job for tests/test_dcp_conformance.py: the same DCP
scenario through torch's FileSystemWriter/Reader and fastpersist's
FastPersistWriter/Reader, side by side.

    python dcp_conformance_worker.py SCENARIO OUT_DIR ARGS_JSON

Scenarios (args["root"]: a directory with one checkpoint per backend):
    save    DTensors sharded by rows, by columns (uneven over the ranks),
            replicated, and a bf16 one nested in a dict, a ShardedTensor, a
            plain replicated tensor and non-tensor values; saved with
            dcp.save (args["tag"] "sync") or with dcp.async_save, the local
            shards then changed before the future is waited for (args["tag"]
            "async": what is saved is the state at the call)
    load    the same names in other layouts on this job's ranks (rows as
            columns, columns as rows, replicated as rows, the nested one
            replicated): dcp.load from each backend's checkpoint; reports
            what differs from the expected full tensors and between backends

Each rank writes OUT_DIR/rank-R.json: {"ok": bool, "problems": [...]} or {"error"}.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

BACKENDS = {"torch": (dcp.FileSystemWriter, dcp.FileSystemReader),
            "fastpersist": (FastPersistWriter, FastPersistReader)}
SHAPES = {"rows": (7, 5), "cols": (6, 11), "rep": (4, 3), "nested.x": (9, 2)}


def expected(name: str) -> torch.Tensor:
    """The full tensor of `name`, the same on every rank and in every job."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = torch.randn(SHAPES[name], generator=g)
    return t.to(torch.bfloat16) if name == "nested.x" else t


def sharded_tensor(world: int, rank: int, empty: bool) -> Any:
    """A 1-D ShardedTensor of 12 elements over the ranks (ChunkShardingSpec)."""
    from torch.distributed._shard.sharded_tensor import empty as st_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = st_empty(spec, 12)
    for shard in st.local_shards():
        off = shard.metadata.shard_offsets[0]
        n = shard.tensor.numel()
        shard.tensor.copy_(torch.zeros(n) if empty else torch.arange(off, off + n,
                                                                       dtype=torch.float32))
    return st


def state(mesh: Any, layout: dict[str, Any], empty: bool) -> dict[str, Any]:
    def dt(name: str) -> DTensor:
        full = torch.zeros_like(expected(name)) if empty else expected(name)
        return distribute_tensor(full, mesh, [layout[name]])

    world, rank = dist.get_world_size(), dist.get_rank()
    return {
        "rows": dt("rows"), "cols": dt("cols"), "rep": dt("rep"),
        "nested": {"x": dt("nested.x"), "plain": torch.zeros(10) if empty else torch.arange(10.0)},
        "st": sharded_tensor(world, rank, empty),
        "step": 0 if empty else 42,
        "cfg": {"lr": 0.0, "names": None} if empty else {"lr": 0.5, "names": ["a", "b"]},
    }


SAVE_LAYOUT = {"rows": Shard(0), "cols": Shard(1), "rep": Replicate(), "nested.x": Shard(0)}
LOAD_LAYOUT = {"rows": Shard(1), "cols": Shard(0), "rep": Shard(0), "nested.x": Replicate()}


def save(mesh: Any, root: Path, tag: str) -> dict[str, Any]:
    for backend, (writer, _) in BACKENDS.items():
        sd = state(mesh, SAVE_LAYOUT, empty=False)
        path = root / f"{backend}-{tag}"
        if tag == "async":
            future = dcp.async_save(sd, storage_writer=writer(path))
            for name in ("rows", "cols", "rep"):  # training goes on
                sd[name].to_local().add_(1000)
            sd["nested"]["x"].to_local().add_(1000)
            sd["nested"]["plain"].add_(1000)
            future.result()
        else:
            dcp.save(sd, storage_writer=writer(path))
    return {"ok": True, "problems": []}


def _full(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def _sharded_full(st: Any) -> list[float]:
    """A ShardedTensor's values, gathered: this rank's shards, then all."""
    mine = [(s.metadata.shard_offsets[0], s.tensor.tolist()) for s in st.local_shards()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    values = [0.0] * 12
    for shards in everyone:
        for off, vals in shards:
            values[off:off + len(vals)] = vals
    return values


def load(mesh: Any, root: Path, tag: str) -> dict[str, Any]:
    problems = []
    loaded: dict[str, dict[str, Any]] = {}
    for backend, (_, reader) in BACKENDS.items():
        sd = state(mesh, LOAD_LAYOUT, empty=True)
        dcp.load(sd, storage_reader=reader(root / f"{backend}-{tag}"))
        got = {n: _full(sd[n]) for n in ("rows", "cols", "rep")}
        got["nested.x"] = _full(sd["nested"]["x"])
        for name, t in got.items():
            if t.dtype != expected(name).dtype or not torch.equal(t, expected(name)):
                problems.append(f"{backend}: {name} differs from what was saved")
        if not torch.equal(sd["nested"]["plain"], torch.arange(10.0)):
            problems.append(f"{backend}: nested.plain differs")
        if _sharded_full(sd["st"]) != [float(i) for i in range(12)]:
            problems.append(f"{backend}: the ShardedTensor differs")
        if sd["step"] != 42 or sd["cfg"] != {"lr": 0.5, "names": ["a", "b"]}:
            problems.append(f"{backend}: non-tensor values differ: {sd['step']}, {sd['cfg']}")
        got["plain"] = sd["nested"]["plain"]
        loaded[backend] = got
    for name, t in loaded["torch"].items():
        if not torch.equal(t, loaded["fastpersist"][name]):
            problems.append(f"the backends loaded different {name}")
    return {"ok": not problems, "problems": problems}


def main() -> None:
    scenario, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        root = Path(args["root"])
        fn = save if scenario == "save" else load
        report = fn(mesh, root, args["tag"])
    except BaseException as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, **report}))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
