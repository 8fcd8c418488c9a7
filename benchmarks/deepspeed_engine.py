"""DeepSpeed's engine.save_checkpoint with its checkpoint engines and fastpersist's.

    python benchmarks/deepspeed_engine.py                    # 256 MiB of fp32 weights, 5 rounds
    python benchmarks/deepspeed_engine.py --weights-mib 64 --repeats 3 --dir /mnt/nvme/bench
    python benchmarks/deepspeed_engine.py --json out.json

One process (world size 1, gloo, DS_ACCELERATOR=cpu), ZeRO stage 1, Adam: a
tag holds the weights (mp_rank_00_model_states.pt) and the fp32 master copy
and both Adam moments (zero_pp_rank_0_..._optim_states.pt), about 4x the
weights. One DeepSpeed engine; its checkpoint_engine is swapped between
methods, so every method saves the same state. Per method and round:

- save_s: engine.save_checkpoint wall time. TorchCheckpointEngine and
  FastCheckpointEngine return with the files in the page cache; fastpersist's
  engine returns with them durable (fsynced, renamed, directory fsynced).
- durable_s: save_s plus an fsync of every file of the tag and the directories
  (for fastpersist this adds nothing but the walk), the guarantee fastpersist gives.
- stall_s (fastpersist, decoupled=True only): the time save_checkpoint takes
  to return (the trainer's stall); durable_s adds the commit DeepSpeed runs
  at the next step.

Methods alternate within each round (order rotated each round); the report
gives median, min and max over rounds and ratios of medians. FastCheckpointEngine
("fast" writer: DeepNVMe's aio op, or "python" writer: DeepSpeed's
buffered Python file writer) is included when DeepSpeed can build it here; if
not, the report gives the exception.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _system import fsync_tree, machine_facts  # noqa: E402  (from HERE)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29741",
                   # the DeepSpeed launcher sets these; its checkpoint writers read them
                   "CROSS_SIZE": "1", "CROSS_RANK": "0"}.items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine  # noqa: E402

WIDTH = 2048


def config(writer: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": 2, "steps_per_print": 10_000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    if writer is not None:
        cfg["checkpoint"] = {"writer": writer}
    return cfg


def make_engine(weights_mib: int, writer: dict[str, Any] | None = None) -> Any:
    torch.manual_seed(0)
    layers = max(1, weights_mib * 2**20 // (WIDTH * WIDTH * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(writer))
    return engine


def fast_engine(weights_mib: int, writer_type: str) -> tuple[Any, str | None]:
    """A FastCheckpointEngine as DeepSpeed builds it from checkpoint.writer, or the error."""
    try:
        # data_parallel set: without it DeepSpeed 0.19.8 reads a dp_rank its
        # UniversalParallelInfo does not have (AttributeError) when no mpu is given.
        other = make_engine(1, {"type": writer_type, "decoupled": False,
                                "data_parallel": "replica"})
        return other.checkpoint_engine, None
    except Exception as exc:  # reported: why it cannot run here
        return None, f"{type(exc).__name__}: {exc}"


def train_step(engine: Any) -> None:
    loss = engine(torch.randn(2, WIDTH)).square().mean()
    engine.backward(loss)
    engine.step()


def measure(engine: Any, method: str, ckpt_engine: Any, root: Path, tag: str) -> dict[str, Any]:
    engine.checkpoint_engine = ckpt_engine
    out: dict[str, Any] = {"method": method, "tag": tag}
    start = time.perf_counter()
    engine.save_checkpoint(str(root), tag=tag, save_latest=True)
    returned = time.perf_counter()
    info = ckpt_engine.get_commit_info()
    if info is not None:  # decoupled: what the next step's commit waits for
        ckpt_engine.commit(info)
    committed = time.perf_counter()
    fsync_tree(root / tag)
    durable = time.perf_counter()
    out["save_s"] = committed - start
    out["stall_s"] = returned - start
    out["durable_s"] = durable - start
    out["bytes"] = sum(f.stat().st_size for f in (root / tag).rglob("*") if f.is_file())
    shutil.rmtree(root / tag)
    return out


def summary(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows]
    return statistics.median(values), min(values), max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    engine = make_engine(args.weights_mib)
    train_step(engine)
    methods: dict[str, Any] = {
        "TorchCheckpointEngine": TorchCheckpointEngine(),
        "FastPersistCheckpointEngine": FastPersistCheckpointEngine(),
        "FastPersistCheckpointEngine(decoupled)": FastPersistCheckpointEngine(decoupled=True),
    }
    unavailable: dict[str, str] = {}
    for writer_type in ("fast", "python"):
        name = f"FastCheckpointEngine(writer {writer_type})"
        built, error = fast_engine(args.weights_mib, writer_type)
        if built is None:
            unavailable[name] = error or "?"
        else:
            methods[name] = built

    base = Path(tempfile.mkdtemp(prefix="ds-bench-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        names = list(methods)
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                row = measure(engine, name, methods[name], base / "ckpt", f"r{r}")
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    state_bytes = rows[0]["bytes"]
    lines = [f"DeepSpeed {deepspeed.__version__} save_checkpoint, ZeRO 1, world 1, "
             f"{state_bytes / 2**20:.0f} MiB a tag, {args.repeats} rounds (median [min-max] s)"]
    by: dict[str, list[dict[str, Any]]] = {n: [x for x in rows if x["method"] == n]
                                          for n in methods}
    for name, got in by.items():
        s, d, st = summary(got, "save_s"), summary(got, "durable_s"), summary(got, "stall_s")
        lines.append(f"  {name:<42} save {s[0]:7.3f} [{s[1]:.3f}-{s[2]:.3f}]"
                     f"  durable {d[0]:7.3f} [{d[1]:.3f}-{d[2]:.3f}]"
                     f"  returns {st[0]:7.3f} [{st[1]:.3f}-{st[2]:.3f}]")
    torch_durable = summary(by["TorchCheckpointEngine"], "durable_s")[0]
    for name, got in by.items():
        if name != "TorchCheckpointEngine":
            lines.append(f"  Torch durable / {name} durable: "
                         f"{torch_durable / summary(got, 'durable_s')[0]:.2f}x;"
                         f" / its return: {torch_durable / summary(got, 'stall_s')[0]:.2f}x")
    for name, error in unavailable.items():
        lines.append(f"  {name}: not built here: {error}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "unavailable": unavailable,
                                         "summary": lines,
                                         "machine": machine_facts(base.parent)}, indent=1))


if __name__ == "__main__":
    main()
