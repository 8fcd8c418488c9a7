"""One rank of the 16-rank gloo job of tests/test_distributed_sixteen.py.

    python sixteen_worker.py slow OUT_DIR ARGS_JSON

Rank, world size and rendezvous come from the environment. The job holds a
data-parallel x tensor-parallel state (plain tensors replicated on every
rank, DTensors replicated over "dp" and sharded over "tp", and a DTensor of
which every rank holds its own box) and saves it three times, to
args["path"]/ckpt-1..3, the values of save n being the base values + n:

    1  the first save (it makes the plan)
    2  every rank at its own speed: the baseline
    3  rank args["slow_rank"] writes its share 10x slower than the slowest
       rank wrote in save 2 (and for at least args["min_slow_seconds"])

For each save, each rank records (time.monotonic, system-wide on Linux, so
that times compare across the ranks) when its write started and ended, each
exchange of the save (Phase.collective) and, on rank 0, its publish; and it
counts the round trips the save makes to the job's c10d store. OUT_DIR/rank-R.json
holds them, or the error the rank raised.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastpersist
from fastpersist.distributed import coordinator, phases, storage

DP, TP = 4, 4
SEED = 4321


def full_tensors() -> dict[str, torch.Tensor]:
    """The job's global tensors (a fixed seed: the same on every rank and in the test)."""
    g = torch.Generator().manual_seed(SEED)
    return {
        # Plain tensors: replicated on all 16 ranks, written once (cut into pieces).
        "embed": torch.randn(2048, 1024, generator=g),                        # 8 MiB
        "head": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),      # 2 MiB
        "norm": torch.randn(1024, generator=g),
        # DTensors: replicated over dp, sharded over tp (each tp shard has 4 replicas).
        "qkv": torch.randn(1024, 512, generator=g),                           # 2 MiB
        "proj": torch.randn(256, 2048, generator=g),                          # 2 MiB
        # A DTensor of which each rank holds a box nobody else has.
        "moments": torch.randn(512, 512, generator=g),                        # 1 MiB
    }


def expected(save: int) -> dict[str, torch.Tensor]:
    """The global tensors of save n."""
    return {k: t + save for k, t in full_tensors().items()}


def state_of(save: int, rank: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = expected(save)
    dp, tp = divmod(rank, TP)

    def local(key: str, placements: list[Any], box: torch.Tensor) -> DTensor:
        # from_local without its check: no collective, the boxes are known.
        return DTensor.from_local(box.clone(), mesh, placements, run_check=False,
                                  shape=full[key].shape, stride=full[key].stride())

    rows = full["qkv"].shape[0] // TP
    cols = full["proj"].shape[1] // TP
    m_rows = full["moments"].shape[0] // DP
    m_cols = full["moments"].shape[1] // TP
    return {
        "model": {
            "embed": full["embed"], "head": full["head"], "norm": full["norm"],
            "qkv": local("qkv", [Replicate(), Shard(0)], full["qkv"][tp * rows:(tp + 1) * rows]),
            "proj": local("proj", [Replicate(), Shard(1)],
                          full["proj"][:, tp * cols:(tp + 1) * cols]),
        },
        "optim": {"moments": local("moments", [Shard(0), Shard(1)], full["moments"][
            dp * m_rows:(dp + 1) * m_rows, tp * m_cols:(tp + 1) * m_cols])},
        "step": save,
    }


class Record:
    """What this rank saw of one save."""

    def __init__(self) -> None:
        self.save = 0
        self.slow_seconds = 0.0  # this rank's writes last at least this long (0: no slowing)
        self.writes: dict[int, list[float]] = {}  # save -> [start, end]
        self.publish: dict[int, list[float]] = {}  # rank 0: save -> [start, end]
        self.exchanges: dict[int, list[list[Any]]] = {}  # save -> [[phase, start, end]]
        self.store_calls: dict[int, int] = {}  # save -> round trips to the c10d store

    def count(self) -> None:
        self.store_calls[self.save] = self.store_calls.get(self.save, 0) + 1


class CountingStore:
    """The job's c10d store, counting every call the save makes to it."""

    def __init__(self, store: Any, record: Record) -> None:
        self._store, self._record = store, record

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **k: Any) -> Any:
            self._record.count()
            return attr(*a, **k)

        return counted


def instrument(record: Record) -> None:
    """Test-only hooks in this process: timestamps, the store counter, and the slowing."""
    job_store = coordinator.job_store

    def counting_store() -> Any:
        store = job_store()
        return None if store is None else CountingStore(store, record)

    coordinator.job_store = counting_store  # type: ignore[assignment]

    write = storage.InProcess.write

    def timed_write(self: Any, *a: Any, **k: Any) -> Any:
        start = time.monotonic()
        out = write(self, *a, **k)
        # The slow rank: as if its disk were slow, after the real write.
        time.sleep(max(0.0, record.slow_seconds - (time.monotonic() - start)))
        record.writes[record.save] = [start, time.monotonic()]
        return out

    storage.InProcess.write = timed_write  # type: ignore[method-assign]

    publish = storage.InProcess.publish

    def timed_publish(self: Any, *a: Any, **k: Any) -> Any:
        start = time.monotonic()
        out = publish(self, *a, **k)
        record.publish[record.save] = [start, time.monotonic()]
        return out

    storage.InProcess.publish = timed_publish  # type: ignore[method-assign]

    collective = phases.Phase.collective

    def timed_collective(self: Any, phase: str, fn: Any) -> Any:
        start, cpu = time.monotonic(), time.process_time()
        out = collective(self, phase, fn)
        record.exchanges.setdefault(record.save, []).append(
            [phase, start, time.monotonic(), time.process_time() - cpu])
        return out

    phases.Phase.collective = timed_collective  # type: ignore[method-assign]


def main() -> int:
    out_dir, args = Path(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result.update(run(rank, args))
        result["warnings"] = [str(w.message) for w in seen]
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def run(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    record = Record()
    instrument(record)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    returned: dict[int, float] = {}
    slowest = 0.0
    for save in (1, 2, 3):
        state = state_of(save, rank, mesh)
        if save == 3:
            # 10x the slowest write of save 2 (every rank learns it alike).
            took = [0.0] * dist.get_world_size()
            dist.all_gather_object(took, record.writes[2][1] - record.writes[2][0])
            slowest = max(took)
            if rank == args["slow_rank"]:
                record.slow_seconds = max(10 * slowest, args["min_slow_seconds"])
        record.save = save
        fastpersist.save(state, f"{args['path']}/ckpt-{save}", process_group=dist.group.WORLD)
        returned[save] = time.monotonic()
        record.save = 0
    return {"ok": True, "returned": returned, "writes": record.writes,
            "publish": record.publish, "exchanges": record.exchanges,
            "store_calls": record.store_calls, "slow_seconds": record.slow_seconds,
            "slowest_save2_write": slowest,
            "plans_made": coordinator.coordinator_for(dist.group.WORLD).plans_made}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
