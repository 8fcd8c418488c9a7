"""One DeepSpeed rank on the CPU (gloo), run by tests/test_deepspeed.py.

    python tests/deepspeed_worker.py roundtrip DIR     save/load of ZeRO 1-3, both engines
    python tests/deepspeed_worker.py train DIR TAGS    save each tag (fastpersist), forever
    python tests/deepspeed_worker.py resume DIR        load DIR's latest, compare, print tag
    python tests/deepspeed_worker.py select DIR        install() + the config key, decoupled
    python tests/deepspeed_worker.py fail DIR          the last rank's disk fills during a save
    python tests/deepspeed_worker.py raised DIR        the last rank's save() raises, decoupled

The launcher sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and DS_ACCELERATOR=cpu.
Every comparison is bit-exact (torch.equal); a mismatch raises, naming what.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import deepspeed
import torch

from fastpersist.integrations import deepspeed as fp_deepspeed

HIDDEN = int(os.environ.get("FP_DS_HIDDEN", "32"))


def config(stage: int, **extra: Any) -> dict[str, Any]:
    return extra | {
        "train_batch_size": 2 * int(os.environ["WORLD_SIZE"]),
        "steps_per_print": 10_000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 100}},
        "zero_optimization": {"stage": stage},
    }


def make(stage: int, kind: str, seed: int, **extra: Any) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, **extra))
    if kind == "fastpersist":
        fp_deepspeed.use(engine)
    return engine


def train(engine: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 100 + int(os.environ["RANK"]))
    for _ in range(steps):
        loss = engine(torch.randn(2, 16, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()


def params(engine: Any) -> dict[str, torch.Tensor]:
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named],
                                           enabled=hasattr(named[0][1], "ds_id")):
        return {n: p.detach().clone() for n, p in named}


def optimizer_state(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's fp32 master partition and Adam's moments, flat."""
    opt = engine.optimizer
    out: dict[str, torch.Tensor] = {}
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = opt.fp32_partitioned_groups_flat
    for i, t in enumerate(masters):
        out[f"master{i}"] = t.detach().clone()
    # Keyed by the flat partitions (ZeRO-3 empties param_groups between steps).
    for i, s in enumerate(opt.optimizer.state.values()):
        for k, v in s.items():
            out[f"adam{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    if not any(k.startswith("adam") for k in out):
        raise AssertionError("no Adam state to compare")
    return out


def snapshot(engine: Any) -> dict[str, Any]:
    return {"params": params(engine), "optim": optimizer_state(engine),
            "sched": engine.lr_scheduler.state_dict(), "steps": engine.global_steps}


def same(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        if not (torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)):
            raise AssertionError(f"{where}: {a!r} != {b!r}")
    elif isinstance(a, dict):
        if set(a) != set(b):
            raise AssertionError(f"{where}: keys {sorted(a)} != {sorted(b)}")
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def roundtrip(root: str) -> None:
    checked = []
    for stage in (1, 2, 3):
        expected: dict[str, Any] = {}
        for kind in ("torch", "fastpersist"):
            where = f"stage {stage} {kind} rank {os.environ['RANK']}"
            d = os.path.join(root, f"stage{stage}-{kind}")
            saver = make(stage, kind, seed=1)
            train(saver, 3, seed=1)
            client = {"epoch": 3, "ids": torch.arange(5), "name": "run"}
            saver.save_checkpoint(d, client_state=client)  # tag global_step3, `latest`
            expected[kind] = snapshot(saver)
            loader = make(stage, kind, seed=2)  # other initial weights
            path, loaded_client = loader.load_checkpoint(d)
            if path is None:
                raise AssertionError(f"{where}: load_checkpoint found nothing in {d}")
            same(expected[kind], snapshot(loader), where)
            same(client, {k: loaded_client[k] for k in client}, where + " client_state")
            # Training on from both gives the same weights, bit for bit.
            train(saver, 1, seed=3)
            train(loader, 1, seed=3)
            same(params(saver), params(loader), where + " after a step")
            saver.destroy()
            loader.destroy()
            checked.append(where)
        # fastpersist's engine resumes a run that DeepSpeed's torch engine saved.
        reader = make(stage, "fastpersist", seed=2)
        reader.load_checkpoint(os.path.join(root, f"stage{stage}-torch"))
        same(expected["torch"], snapshot(reader), f"stage {stage} torch file by fastpersist")
        reader.destroy()
        checked.append(f"stage {stage} torch->fastpersist rank {os.environ['RANK']}")
    print("CHECKED " + json.dumps(checked), flush=True)


def train_forever(root: str, tags: int) -> None:
    """Save tags t0, t1, ... of a growing run; before each save, the expected
    state is written (torch.save, fsynced) for `resume` to compare with."""
    engine = make(2, "fastpersist", seed=1)
    for i in range(tags):
        train(engine, 1, seed=i)
        tag = f"t{i}"
        exp = os.path.join(root, f"expected-{tag}.pt")
        torch.save(snapshot(engine), exp + ".tmp")
        fd = os.open(exp + ".tmp", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.replace(exp + ".tmp", exp)
        print(f"SAVING {tag}", flush=True)
        if os.environ.get("FP_DS_STOP_IN_COMMIT") == tag:
            stall_in_commit(engine)
        engine.save_checkpoint(os.path.join(root, "ckpt"), tag=tag)
        print(f"SAVED {tag}", flush=True)
    time.sleep(3600)


def stall_in_commit(engine: Any) -> None:
    """Stop before commit: every file of the tag has been handed to the engine
    (and may be half written); the parent kills the process here."""
    def commit(info: Any) -> bool:
        print(f"IN_COMMIT {info.tag}", flush=True)
        time.sleep(3600)
        return True

    engine.checkpoint_engine.commit = commit


def resume(root: str) -> None:
    engine = make(2, "fastpersist", seed=5)
    path, _ = engine.load_checkpoint(os.path.join(root, "ckpt"))
    if path is None:
        raise AssertionError("no checkpoint to resume")
    with open(os.path.join(root, "ckpt", "latest")) as f:
        tag = f.read().strip()
    expected = torch.load(os.path.join(root, f"expected-{tag}.pt"), weights_only=False)
    same(expected, snapshot(engine), f"resumed {tag}")
    print(f"RESUMED {tag}", flush=True)


def select(root: str) -> None:
    """The engine chosen by the config (install()), decoupled: save_checkpoint
    returns before `latest` is written; the next step commits the tag."""
    fp_deepspeed.install()
    chosen = {"checkpoint": {"fastpersist": {"decoupled": True}}}
    engine = make(2, "config", seed=1, **chosen)
    if type(engine.checkpoint_engine).__name__ != "FastPersistCheckpointEngine":
        raise AssertionError(f"the config chose {type(engine.checkpoint_engine)}")
    train(engine, 2, seed=1)
    d = os.path.join(root, "ckpt")
    engine.save_checkpoint(d)
    expected = snapshot(engine)
    if os.path.exists(os.path.join(d, "latest")):
        raise AssertionError("decoupled: `latest` written before the next step committed")
    train(engine, 1, seed=2)  # commits global_step2, then steps
    with open(os.path.join(d, "latest")) as f:
        if f.read().strip() != "global_step2":
            raise AssertionError("the step did not commit global_step2")
    engine.destroy()
    plain = make(2, "torch", seed=3)  # without the key: DeepSpeed's own choice
    if type(plain.checkpoint_engine).__name__ != "TorchCheckpointEngine":
        raise AssertionError(f"no key, yet {type(plain.checkpoint_engine)}")
    loader = make(2, "fastpersist", seed=4)
    loader.load_checkpoint(d)
    same(expected, snapshot(loader), "decoupled, chosen by the config")
    print("SELECTED", flush=True)


def fail(root: str) -> None:
    """The last rank's optimizer file fails (ENOSPC) in the background: every
    rank's save_checkpoint raises, naming that rank and file; `latest` stays."""
    import pytest
    from support import inject_enospc

    from fastpersist import CheckpointError

    engine = make(2, "fastpersist", seed=1)
    train(engine, 1, seed=1)
    d = os.path.join(root, "ckpt")
    engine.save_checkpoint(d, tag="good")
    last = int(os.environ["WORLD_SIZE"]) - 1
    if int(os.environ["RANK"]) == last:
        inject_enospc(pytest.MonkeyPatch(), f"zero_pp_rank_{last}_mp_rank_00_optim_states.pt")
    try:
        engine.save_checkpoint(d, tag="bad")
    except CheckpointError as exc:
        print(f"RAISED {exc}", flush=True)
    else:
        raise AssertionError("save_checkpoint of 'bad' did not raise")
    with open(os.path.join(d, "latest")) as f:
        print(f"LATEST {f.read().strip()}", flush=True)


def raised(root: str) -> None:
    """The engine as DeepSpeed's decoupled save_checkpoint and step() call it,
    the last rank's optimizer file's save() raising (allow_pickle=False): the
    commit raises on every rank, naming that rank and file; `latest` stays."""
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from fastpersist import CheckpointError, UnsupportedValueError

    rank, last = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]) - 1
    mine = fp_deepspeed.FastPersistCheckpointEngine(daemon="", decoupled=True,
                                                    allow_pickle=False)
    d = os.path.join(root, "ckpt")
    for tag in ("good", "bad"):
        mine.makedirs(os.path.join(d, tag), exist_ok=True)
        torch.distributed.barrier()
        mine.create(CheckpointCommitInfo(tag=tag, save_dir=d, save_latest=True))
        optim: dict[str, Any] = {"s": torch.ones(2)}
        if tag == "bad" and rank == last:
            optim["scaler"] = object()
        mine.save({"w": torch.ones(4)}, os.path.join(d, tag, "mp_rank_00_model_states.pt"))
        optim_file = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        # The trainer catches save_checkpoint's error and steps on.
        with contextlib.suppress(UnsupportedValueError):
            mine.save(optim, os.path.join(d, tag, optim_file))
        info = mine.get_commit_info()  # engine.step(): _commit_decoupled_checkpoint
        if info is None:
            raise AssertionError(f"no open tag {tag!r} to commit")
        try:
            mine.commit(info)
        except CheckpointError as exc:
            if tag == "good":
                raise
            print(f"RAISED {exc}", flush=True)
        else:
            if tag == "bad":
                raise AssertionError("the commit of 'bad' did not raise")
    mine.close()
    with open(os.path.join(d, "latest")) as f:
        print(f"LATEST {f.read().strip()}", flush=True)
    # Leave together, the group torn down: without a DeepSpeed engine to
    # destroy it, a rank exiting while gloo's threads still serve the other
    # one aborted at exit ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "roundtrip":
        roundtrip(root)
    elif mode == "train":
        train_forever(root, int(sys.argv[3]))
    elif mode == "resume":
        resume(root)
    elif mode == "select":
        select(root)
    elif mode == "fail":
        fail(root)
    elif mode == "raised":
        raised(root)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
