"""One rank of a torch.distributed (gloo) job for tests/test_distributed.py.

    python dist_worker.py SCENARIO OUT_DIR ARGS_JSON

Rank, world size and rendezvous come from the environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), the node from FASTPERSIST_NODE. Each rank writes
OUT_DIR/rank-R.json with what it saw, or the error it raised.

Scenarios:
    save       save the test state (replicated, plus DTensors when args["tp"])
    load       load a checkpoint; report checksums of what came back
    fail       save, with one rank's write failing (args["fail_rank"])
    die        save, with one rank killing itself in the write phase
    mismatch   save, with one rank holding a tensor the others do not
    fail_commit  save, with one rank's publishing of its directory failing
    die_at_commit  save, with rank 0 SIGKILLed just before or just after it
               publishes (the job's commit point: args["when"]), alone or,
               with args["everyone"], after it killed every other rank too
    hang       save, with one rank (args["hang_rank"]) stuck in its writes for
               args["seconds"], longer than FASTPERSIST_DIST_TIMEOUT
    settle     fastpersist.distributed.settle of the checkpoint's directory
    async      async_save, then a Checkpointer (keep_last=2) over 3 steps; the
               state is changed as soon as each call returns
    lost_watch through a daemon: save full + 1 to args["path"] + "/one" with
               rank args["lost_rank"]'s progress stream breaking after its
               part's Commit (and, with args["unreachable"], the daemon not
               answering it afterwards), then full + 2 to "/two"; reports each
               save's error and the segments each handed over
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fastpersist
from fastpersist.distributed import coordinator
from fastpersist.distributed.planner import Plan

GEN_SEED = 1234


def full_tensors() -> dict[str, torch.Tensor]:
    """The job's global tensors, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(GEN_SEED)
    return {
        "embed": torch.randn(1000, 256, generator=g),          # 1 MB: split over writers
        "big": torch.randn(3000, 200, generator=g),            # 2.4 MB
        "w1": torch.randn(512, 128, generator=g).to(torch.bfloat16),
        "b1": torch.randn(512, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "ids": torch.randint(0, 1 << 40, (4096,), generator=g),
    }


def sharded_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(GEN_SEED + 1)
    return {"rows": torch.randn(64, 48, generator=g), "cols": torch.randn(40, 64, generator=g)}


def build_state(args: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": full_tensors(), "step": 7, "name": "test-run"}
    state["model"]["tied"] = state["model"]["embed"]  # tied weights: stored once
    if args.get("tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        dp, tp = args["dp"], args["tp"]
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        s = sharded_tensors()
        state["tp"] = {
            "rows": distribute_tensor(s["rows"], mesh, [Replicate(), Shard(0)]),
            "cols": distribute_tensor(s["cols"], mesh, [Replicate(), Shard(1)]),
        }
    return state


def like_state(args: dict[str, Any]) -> dict[str, Any]:
    """This rank's state in the load job's layout (args["like"]: "rows<->cols" swaps)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    s = sharded_tensors()
    # The opposite of how they were saved: rows column-sharded, cols row-sharded.
    model = full_tensors()
    model["tied"] = model["embed"]
    return {"model": model, "step": 0, "name": "",
            "tp": {"rows": distribute_tensor(s["rows"] * 0, mesh, [Shard(1)]),
                   "cols": distribute_tensor(s["cols"] * 0, mesh, [Shard(0)])}}


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def describe_loaded(obj: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"step": obj["step"], "name": obj["name"], "tensors": {},
                           "tied": obj["model"].get("tied") is obj["model"]["embed"]}
    expected = full_tensors()
    expected["tied"] = expected["embed"]
    for k, t in obj["model"].items():
        out["tensors"][f"model.{k}"] = {
            "equal": bool(t.dtype == expected[k].dtype and t.shape == expected[k].shape
                          and torch.equal(t, expected[k])), "digest": digest(t)}
    if "tp" in obj:
        s = sharded_tensors()
        for k, t in obj["tp"].items():
            if isinstance(t, DTensor):
                local = t.to_local()
                full = t.full_tensor()
                out["tensors"][f"tp.{k}"] = {
                    "dtensor": True, "placements": [str(p) for p in t.placements],
                    "local_shape": list(local.shape), "equal": bool(torch.equal(full, s[k])),
                    "local_equal": bool(torch.equal(local, _expected_local(t, s[k])))}
            else:
                out["tensors"][f"tp.{k}"] = {"dtensor": False, "equal": bool(torch.equal(t, s[k]))}
    return out


def _expected_local(t: Any, full: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(full.shape, t.device_mesh, t.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))]


def _count_received() -> list[int]:
    """The pickled size of every object this rank receives by broadcast or
    scatter (what the coordinator sends each rank, which must not grow with
    the job)."""
    import pickle

    import torch.distributed as dist

    sizes: list[int] = []
    broadcast, scatter = dist.broadcast_object_list, dist.scatter_object_list

    def counted_broadcast(box: list[Any], *a: Any, **kw: Any) -> None:
        broadcast(box, *a, **kw)
        sizes.append(len(pickle.dumps(box[0])))

    def counted_scatter(out: list[Any], *a: Any, **kw: Any) -> None:
        scatter(out, *a, **kw)
        sizes.append(len(pickle.dumps(out[0])))

    dist.broadcast_object_list = counted_broadcast  # type: ignore[assignment]
    dist.scatter_object_list = counted_scatter  # type: ignore[assignment]
    return sizes


def _count_items_sent() -> list[int]:
    """How many planner boxes (plan.described's table's) this rank
    sends to rank 0 (gathered or point to point; the coordinator sends a
    table as bytes): a rank's description goes once per layout, not once
    per rank."""
    import torch.distributed as dist

    sent: list[int] = []
    gather, send = dist.gather_object, dist.send_object_list

    def items_in(obj: Any) -> int:
        from fastpersist.distributed.table import BoxTable
        from fastpersist.errors import DistributedCheckpointError

        try:  # a table (table.BoxTable.sent), or another message
            return len(BoxTable.received(obj, 0))
        except DistributedCheckpointError:
            return 0

    def counted_gather(obj: Any, *a: Any, **kw: Any) -> None:
        sent.append(items_in(obj))
        gather(obj, *a, **kw)

    def counted_send(objs: list[Any], *a: Any, **kw: Any) -> None:
        sent.extend(items_in(o) for o in objs)
        send(objs, *a, **kw)

    dist.gather_object = counted_gather  # type: ignore[assignment]
    dist.send_object_list = counted_send  # type: ignore[assignment]
    return sent


def main() -> int:
    scenario, out_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    (out_dir / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "node": os.environ.get("FASTPERSIST_NODE")}
    path = args["path"].format(node=os.environ.get("FASTPERSIST_NODE", ""))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run(scenario, args, path, rank, result)
    # Warnings a save gave (a rank that died after the commit, values that
    # differ), in the report and, as usual, in the log.
    result["warnings"] = [str(w.message) for w in seen]
    for w in seen:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


def _run(scenario: str, args: dict[str, Any], path: str, rank: int,
         result: dict[str, Any]) -> None:
    out_dir = Path(sys.argv[2])
    try:
        if scenario in ("save", "fail", "die", "mismatch", "fail_commit", "die_handed_over",
                        "die_at_commit", "hang"):
            if scenario == "fail" and rank == args["fail_rank"]:
                _fail_writes()
            if scenario == "fail_commit" and rank == args["fail_rank"]:
                _fail_commits()
            if scenario == "die" and rank == args["die_rank"]:
                _die_in_writes()
            if scenario == "die_handed_over" and rank in args["die_ranks"]:
                _die_after_hand_over()
            if scenario == "hang" and rank == args["hang_rank"]:
                _slow_writes(args["seconds"])
            if scenario == "die_at_commit" and rank == 0:
                _die_at_commit(out_dir, args["when"], args.get("everyone", False))
            received = _count_received()
            items_sent = _count_items_sent()
            state = build_state(args)
            if args.get("per_rank_values"):
                state["rank_note"] = rank  # values that differ between ranks
                state["rng"] = torch.tensor([rank, 7])
            if args.get("numpy_values"):
                import numpy as np  # numpy values: stored as tensors, one copy per job

                state["np"] = {"same": np.arange(6, dtype=np.int16).reshape(2, 3),
                               "scalar": np.float32(2.5),
                               "rng": np.random.RandomState(rank).get_state()}
            if scenario == "mismatch" and rank == args["odd_rank"]:
                state["model"]["extra"] = torch.zeros(3)  # a state the others do not have
            for _ in range(args.get("saves", 1)):
                fastpersist.save(state, path, process_group=dist.group.WORLD,
                                 node_local=args.get("node_local", False),
                                 compression=args.get("compression"))
            co = coordinator.coordinator_for(dist.group.WORLD)
            result["plans_made"] = co.plans_made
            result["largest_received"] = max(received, default=0)
            result["items_sent"] = sum(items_sent)
            cached = co.cache.plan
            assert cached is not None
            result["cached"] = type(cached).__name__  # rank 0: the Plan; the others: a Share
            if isinstance(cached, Plan):
                result["plan_bytes"] = {str(r): n for r, n in cached.bytes_per_rank().items()}
            result["ok"] = True
        elif scenario == "fail_copy":
            if rank == args["fail_rank"]:
                _fail_copy(args["call"])
            fastpersist.save(build_state(args), path, process_group=dist.group.WORLD)
            result["ok"] = True
        elif scenario == "async":
            state = build_state(args)
            future = fastpersist.async_save(state, path + "/single", process_group=dist.group.WORLD)
            _scribble(state)  # after the snapshot: must not reach the checkpoint
            future.result()
            ckpt = fastpersist.Checkpointer(path + "/run", keep_last=2,
                                            process_group=dist.group.WORLD)
            full = full_tensors()
            for step in range(3):
                for k, t in full.items():
                    state["model"][k].copy_(t + step)  # the state of step s is full + s
                state["step"] = step
                ckpt.save(step, state)
                _scribble(state)
            ckpt.close()
            result["steps"] = ckpt.steps()
            result["latest"] = str(ckpt.latest())
            result["staging_bytes_after_close"] = ckpt.staging_bytes
            result["ok"] = True
        elif scenario == "windowed":
            # A share over FASTPERSIST_STAGING_BUDGET: async and blocking saves
            # (a blocking one stages too through a daemon) and what staging held.
            peak = _track_staging_peak()
            state = build_state(args)
            for name in ("async", "blocking"):
                kwargs = {"process_group": dist.group.WORLD,
                          "compression": args.get("compression")}
                if name == "async":
                    fastpersist.async_save(state, f"{path}/{name}", **kwargs).result()
                else:
                    fastpersist.save(state, f"{path}/{name}", **kwargs)
            result.update(ok=True, staging_peak=peak[0])
        elif scenario == "die_windowed":
            # async_save of a share over the budget: this rank is killed as it
            # writes its second file, while its caller waits for room.
            if rank == args["die_rank"]:
                _die_at_file(2)
            fastpersist.async_save(build_state(args), path,
                                   process_group=dist.group.WORLD).result()
            result["ok"] = True
        elif scenario == "keep_best":
            # Rank 0 records the metrics and keeps the best; every rank checks its metrics=.
            state = build_state(args)
            ckpt = fastpersist.Checkpointer(path, keep_best=1, best_metric="val_loss",
                                            process_group=dist.group.WORLD)
            for step, loss in enumerate([0.5, 0.1, 0.7, 0.9]):
                ckpt.save(step, state, metrics={"val_loss": loss})
            try:
                ckpt.save(4, state)
            except ValueError as exc:
                result["missing"] = str(exc)
            ckpt.close()
            result.update(ok=True, steps=ckpt.steps())
        elif scenario == "tier_checkpointer":
            # Three steps with a tier; the last one's model is full_tensors().
            state = build_state(args)
            ckpt = fastpersist.Checkpointer(path, keep_last=1, process_group=dist.group.WORLD,
                                            tier=args["tier"],
                                            compression=args.get("compression"))
            full = full_tensors()
            for step in range(3):
                for k, t in full.items():
                    state["model"][k].copy_(t + (step - 2))
                ckpt.save(step, state)
            ckpt.close()  # rank 0: after the uploads
            status = ckpt.tier_status()
            assert status is not None
            result.update(ok=True, steps=ckpt.steps(), uploaded=status.uploaded,
                          pending=list(status.pending), last_error=status.last_error)
        elif scenario == "abort":
            # Every rank's writes are slow, so that the abort comes in mid-save.
            _slow_writes()
            ckpt = fastpersist.Checkpointer(path, process_group=dist.group.WORLD)
            future = ckpt.save(5, build_state(args))
            if rank == args["abort_rank"]:
                ckpt.close(abort=True)  # must not raise: an abort is what we asked for
                error = future.exception()
            else:
                error = future.exception()
                ckpt.close()  # the failure was looked at: nothing more to raise
            result.update(ok=True, error_type=type(error).__name__, error=str(error),
                          failures={str(k): v for k, v in getattr(error, "failures", {}).items()},
                          steps=ckpt.steps())
        elif scenario == "lost_watch":
            result.update(_lost_watch(args, rank, path), ok=True)
        elif scenario == "settle":
            from fastpersist.distributed import settle

            settled = settle(Path(path).parent, dist.group.WORLD)
            result.update(ok=True, promoted=settled.promoted, removed=settled.removed,
                          in_doubt=settled.in_doubt)
        elif scenario == "load":
            like = like_state(args) if args.get("like") else None
            obj = fastpersist.load(path, like=like)
            result.update(describe_loaded(obj), ok=True)
    except fastpersist.CheckpointError as exc:
        result.update(ok=False, error_type=type(exc).__name__, error=str(exc),
                      failures={str(k): v for k, v in getattr(exc, "failures", {}).items()})
    except Exception as exc:
        result.update(ok=False, error_type=type(exc).__name__, error=str(exc),
                      traceback=traceback.format_exc())


def _lost_watch(args: dict[str, Any], rank: int, path: str) -> dict[str, Any]:
    from fastpersist.errors import DaemonUnavailableError
    from fastpersist.protocol import client as daemon_client
    from fastpersist.protocol.client import DaemonClient
    from fastpersist.saving import remote

    try:  # the Watch follower; remote.Progress in the code before the fix
        from fastpersist.saving.handover import Progress
    except ImportError:
        Progress = remote.Progress  # type: ignore[attr-defined]
    segments: list[list[str]] = [[], []]
    saving = [0]
    submit, wait, ask = DaemonClient.submit_shm, Progress.wait, DaemonClient.wait

    def spy(client: Any, ident: str, index: int, header: bytes, segment: str, *a: Any) -> None:
        segments[saving[0]].append(segment)
        submit(client, ident, index, header, segment, *a)

    def broken(progress: Any, files_written: int | None = None) -> Any:
        if files_written is None and saving[0] == 0:
            raise DaemonUnavailableError("injected: the progress stream broke", "UNAVAILABLE")
        return wait(progress, files_written)

    def unreachable(*a: Any, **k: Any) -> Any:
        raise DaemonUnavailableError("injected: fastpersistd does not answer", "UNAVAILABLE")

    DaemonClient.submit_shm = spy  # type: ignore[method-assign]
    if rank == args["lost_rank"]:
        Progress.wait = broken  # type: ignore[method-assign]
        if args.get("unreachable"):
            DaemonClient.wait = unreachable  # type: ignore[method-assign]
            daemon_client.OUTCOME_PATIENCE = 1.0  # type: ignore[attr-defined]
    state = build_state(args)
    errors: list[str | None] = []
    for n, name in enumerate(("one", "two")):
        saving[0] = n
        for k, t in full_tensors().items():
            state["model"][k].copy_(t + 1 + n)  # the state of save n is full + 1 + n
        try:
            fastpersist.save(state, f"{path}/{name}", process_group=dist.group.WORLD)
            errors.append(None)
        except fastpersist.CheckpointError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        if n == 0 and args.get("unreachable") and rank == args["lost_rank"]:
            DaemonClient.wait = ask  # type: ignore[method-assign]
    shm_dir = Path(os.environ["FASTPERSIST_SHM_DIR"])
    return {"errors": errors, "segments": segments,
            "segments_left": sorted(p.name for p in shm_dir.iterdir())}


def _fail_copy(call: int) -> None:
    """This rank's copy of its `call`-th file into staging fails."""
    from fastpersist.saving import pipeline

    calls = [0]
    stage = pipeline.stage_file

    def failing(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            raise OSError(errno.EFAULT, "Bad address")
        return stage(*a, **k)

    pipeline.stage_file = failing  # type: ignore[assignment]


def _track_staging_peak() -> list[int]:
    """[the most bytes any staging pool of this process held], kept up to date."""
    from fastpersist.saving.staging import StagingPool

    peak = [0]
    acquire = StagingPool.acquire

    def tracked(self: StagingPool, *args: Any, **kwargs: Any) -> torch.Tensor:
        buffer = acquire(self, *args, **kwargs)
        peak[0] = max(peak[0], self.allocated_bytes)
        return buffer

    StagingPool.acquire = tracked  # type: ignore[method-assign]
    return peak


def _scribble(state: dict[str, Any]) -> None:
    for t in state["model"].values():
        t.fill_(-7)


def _fail_writes() -> None:
    """This rank's data-file writes fail as a full disk would."""
    from fastpersist.tensors import datafile

    def full(*a: Any, **k: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    datafile.write = full  # type: ignore[assignment]


def _fail_commits() -> None:
    """This rank's commit (or node-local preparing) of its staging directory
    fails as an I/O error would (in-process, or as the daemon's answer to CommitJob)."""
    from fastpersist.distributed import storage
    from fastpersist.errors import DaemonError
    from fastpersist.storage.commit import Staging

    def broken(*a: Any, **k: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    def refused(self: Any, *a: Any) -> None:
        raise DaemonError("cannot commit the distributed checkpoint: Input/output error",
                          "INTERNAL")

    # Rank 0's node commits; the others' first ranks prepare their part first.
    Staging.commit = broken  # type: ignore[method-assign]
    storage.prepare = broken  # type: ignore[assignment]  (prepared.prepare, as storage has it)
    storage.ThroughDaemon.publish = refused  # type: ignore[method-assign]
    storage.ThroughDaemon.prepare = refused  # type: ignore[method-assign,assignment]


def _slow_writes(seconds: float = 1.0) -> None:
    """This rank's writes start after `seconds` (in-process or through a daemon)."""
    from fastpersist.distributed import storage

    for cls in (storage.InProcess, storage.ThroughDaemon):
        def slow(self: Any, *a: Any, _write: Any = cls.write, **k: Any) -> Any:
            time.sleep(seconds)
            return _write(self, *a, **k)

        cls.write = slow  # type: ignore[method-assign]


def _die_in_writes() -> None:
    """This rank is SIGKILLed as it starts writing its pieces (in-process or
    through a daemon: before its part is begun there)."""
    from fastpersist.distributed import storage

    def die(*a: Any, **k: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    storage.InProcess.write = die  # type: ignore[method-assign]
    storage.ThroughDaemon.write = die  # type: ignore[method-assign]


def _die_at_file(n: int) -> None:
    """This rank is SIGKILLed as it starts writing its n-th data file (in-process)."""
    from fastpersist.distributed import storage

    write = storage.datafile.write
    calls = [0]

    def dying(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(*a, **k)

    storage.datafile.write = dying  # type: ignore[assignment]


def _die_after_hand_over() -> None:
    """This rank is SIGKILLed once the daemon holds its part (Commit answered)."""
    from fastpersist.protocol.client import DaemonClient

    original = DaemonClient.commit

    def commit_then_die(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)

    DaemonClient.commit = commit_then_die  # type: ignore[method-assign]


def _die_at_commit(out_dir: Path, when: str, everyone: bool) -> None:
    """Rank 0 is SIGKILLed just before or just after its publish, the job's
    commit point (in-process, or CommitJob through its daemon); with everyone,
    every other rank of the job is killed first: a whole-job crash."""
    from fastpersist.distributed import storage

    def kill() -> None:
        if everyone:
            for f in out_dir.glob("pid-*"):
                if int(f.read_text()) != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(f.read_text()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    for cls in (storage.InProcess, storage.ThroughDaemon):
        def publish(self: Any, *a: Any, _publish: Any = cls.publish, **k: Any) -> str:
            if when == "before":
                kill()
            _publish(self, *a, **k)
            kill()
            return ""

        cls.publish = publish  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
