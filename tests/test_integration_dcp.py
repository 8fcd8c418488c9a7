"""torch.distributed.checkpoint through fastpersist: FastPersistWriter/Reader/Stager.

One process: dcp.save/load round trips (every kind of value DCP takes, bytes
items included), the JSON metadata rebuilding DCP's Metadata, dcp.async_save
snapshotting into reused staging buffers, fastpersist.load and fpctl on the
result, corruption (data, metadata) detected, resharding reads that read only
the CRC blocks they need. Real gloo jobs (tests/helpers/dcp_worker.py): 4
ranks save an FSDP2 model, its Adam state and a column-sharded DTensor; 2
ranks load it in another layout (rows), one process loads it whole. SIGKILL
at every step of a save leaves the old checkpoint or the new one.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_support import run_example, run_ranks
from support import kill_at_hooks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import fastpersist
from fastpersist import ChecksumMismatchError, CorruptCheckpointError
from fastpersist.cli import main as fpctl
from fastpersist.integrations.dcp import FastPersistReader, FastPersistStager, FastPersistWriter
from fastpersist.integrations.dcp.blocks import CRC_BLOCK
from fastpersist.integrations.dcp.metadata_json import DCP_METADATA_NAME
from fastpersist.integrations.dcp.stager import shared_pool
from fastpersist.storage.commit import collect, find_leftovers

HELPERS = Path(__file__).parent / "helpers"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def sample_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(1500, 1000, generator=g),  # 6 MB: two CRC blocks
            "b16": torch.randn(33, generator=g).to(torch.bfloat16),
            "i64": torch.arange(7) * (seed + 1),
            "u8": torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8),
            "flag": torch.tensor([True, False]),
            "half_view": torch.randn(8, 8, generator=g)[:, :4],  # non-contiguous
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5 + seed),
            "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        },
        "step": 100 + seed,
        "cfg": {"lr": 0.25, "name": "run@1", "betas": (0.9, 0.95), "tags": ["a", "b"]},
        "blob": b"\x00\xff" * 1000 + bytes([seed]),
        "io": io.BytesIO(b"raw bytes io"),
    }


def blank_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.contiguous())
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    if isinstance(sd, io.BytesIO):
        return io.BytesIO()
    return None


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, io.BytesIO):
        got.seek(0)
        assert got.read() == want.getvalue(), path
    else:
        assert got == want, path


def f8_safe(sd: dict[str, Any]) -> dict[str, Any]:
    """torch.equal has no float8 kernel on every build: compare its bytes."""
    out = dict(sd)
    out["model"] = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                    for k, v in sd["model"].items()}
    return out


# --- one process --------------------------------------------------------------------------


def test_save_load_one_process(tmp_path: Path) -> None:
    sd = sample_state()
    path = tmp_path / "ckpt"
    saved_md = dcp.save(sd, storage_writer=FastPersistWriter(path))
    names = sorted(os.listdir(path))
    assert names == ["data-r00000-000.safetensors", DCP_METADATA_NAME, "manifest.json"]
    assert not find_leftovers(tmp_path)

    out = blank_like(sd)
    out["io"] = io.BytesIO()
    reader = FastPersistReader(path)
    dcp.load(out, storage_reader=reader)
    assert_same(f8_safe(out), f8_safe(sd))
    assert out["cfg"]["betas"] == (0.9, 0.95)

    # The JSON metadata rebuilds DCP's Metadata (what a pickle would have kept).
    md = FastPersistReader(path).read_metadata()
    assert md.state_dict_metadata == saved_md.state_dict_metadata
    assert md.planner_data == saved_md.planner_data
    assert md.storage_data == saved_md.storage_data
    assert md.storage_meta is not None and md.storage_meta.save_id == saved_md.storage_meta.save_id
    w = md.storage_data[MetadataIndex("model.w", [0, 0])]
    assert len(w.block_crcs) == 2  # 6 MB item: per-block CRCs

    # The same directory is a fastpersist checkpoint: flat {fqn: tensor}.
    flat = fastpersist.load(path)
    assert torch.equal(flat["model.w"], sd["model"]["w"])
    assert torch.equal(flat["model.half_view"], sd["model"]["half_view"])
    assert flat["blob"].dtype == torch.uint8  # a bytes item: DCP's torch.save of the value
    assert torch.load(io.BytesIO(flat["blob"].numpy().tobytes()), weights_only=True) == sd["blob"]
    assert fpctl(["verify", str(path)]) == 0


def test_save_replaces_atomically_and_refuses_foreign_dirs(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"x": torch.ones(3)}, storage_writer=FastPersistWriter(path))
    dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=FastPersistWriter(path))
    out = {"x": torch.zeros(3)}
    dcp.load(out, storage_reader=FastPersistReader(path))
    assert out["x"].tolist() == [2.0] * 3
    assert not find_leftovers(tmp_path)
    with pytest.raises(CheckpointException):
        dcp.save({"x": torch.ones(3)}, storage_writer=FastPersistWriter(path, overwrite=False))
    foreign = tmp_path / "fs"
    dcp.save({"x": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(foreign))
    with pytest.raises(CheckpointException, match="not a fastpersist checkpoint"):
        dcp.save({"x": torch.ones(3)}, storage_writer=FastPersistWriter(foreign))
    assert not find_leftovers(tmp_path)


def test_async_save_snapshots_into_reused_buffers(tmp_path: Path) -> None:
    pool = shared_pool()
    # From a known start: buffers an earlier test left free in the process's
    # pool (of other sizes, some still held by a dropped snapshot) would make
    # the reuse counted below depend on the order tests run in.
    gc.collect()
    pool.clear()
    sd = sample_state(1)
    expected = {k: v.clone() for k, v in sd["model"].items()}
    future = dcp.async_save(sd, storage_writer=FastPersistWriter(tmp_path / "a"))
    for t in sd["model"].values():  # training goes on: the snapshot must not see it
        if t.dtype in (torch.float32, torch.bfloat16, torch.int64):
            t.add_(1)
    future.result()
    after_first = pool.allocated_bytes
    assert after_first > 0
    for i in range(2):
        dcp.async_save(sd, storage_writer=FastPersistWriter(tmp_path / f"b{i}")).result()
        assert pool.allocated_bytes == after_first  # reused, not allocated again
    out = blank_like(sd)
    out["io"] = io.BytesIO()
    dcp.load(out, storage_reader=FastPersistReader(tmp_path / "a"))
    assert_same(f8_safe({"model": out["model"]}), f8_safe({"model": expected}))

    # A stager given to async_save on its own returns its buffer when DCP drops
    # the snapshot (shortly after the future completes: DCP's thread lets go).
    stager = FastPersistStager()
    for name in "cd":
        dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / name),
                       async_stager=stager).result()
        deadline = time.monotonic() + 10
        while not pool._free and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.02)
        assert pool.allocated_bytes == after_first


def test_writer_and_errors_pickle(tmp_path: Path) -> None:
    writer = FastPersistWriter(tmp_path / "p")
    writer.stage({"x": torch.ones(4)})
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.path == writer.path and clone._lease is None
    err = pickle.loads(pickle.dumps(ChecksumMismatchError("m", file="f", tensor="t")))
    assert (err.file, err.tensor) == ("f", "t")


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corruption_is_detected(tmp_path: Path) -> None:
    sd = sample_state()
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FastPersistWriter(path))
    record = next(r for r in fastpersist.tensors.checkpoint.read_manifest(path).tensors
                  if r.name.startswith("model.b16@"))
    _flip(path / record.file, record.offset + 3)
    out = blank_like(sd)
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=FastPersistReader(path))
    # DCP keeps each rank's (exception, traceback).
    failures = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert any(isinstance(f, ChecksumMismatchError) and f.tensor == record.name
               for f in failures), failures
    with pytest.raises(ChecksumMismatchError):
        fastpersist.load(path)
    assert fpctl(["verify", str(path)]) == 1

    meta = path / DCP_METADATA_NAME
    text = meta.read_bytes()
    meta.write_bytes(text.replace(b'"fqn":"model.w"', b'"fqn":"model.v"'))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        FastPersistReader(path).read_metadata()


class _Planner:
    """The part of a LoadPlanner read_data uses."""

    def __init__(self, dest: dict[str, torch.Tensor]) -> None:
        self.dest = dest

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.dest[req.dest_index.fqn]
        for d, (o, n) in enumerate(zip(req.dest_offsets, req.lengths, strict=True)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError


def _read_box(path: Path, offsets: list[int], lengths: list[int]) -> tuple[torch.Tensor, int]:
    reader = FastPersistReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    out = torch.zeros(lengths)
    req = ReadItem(LoadItemType.TENSOR, MetadataIndex("t", [0, 0]), torch.Size([0, 0]),
                   MetadataIndex("t", [0, 0]), torch.Size(offsets), torch.Size(lengths))
    from torch.distributed.checkpoint.planner import LoadPlan

    reader.read_data(LoadPlan([req]), _Planner({"t": out})).wait()  # type: ignore[arg-type]
    return out, reader.bytes_read


def test_partial_reads_read_and_check_only_their_blocks(tmp_path: Path) -> None:
    full = torch.randn(4096, 1024)  # 16 MiB: 4 blocks of 1024 rows
    path = tmp_path / "ckpt"
    dcp.save({"t": full}, storage_writer=FastPersistWriter(path))
    rows = CRC_BLOCK // (1024 * 4)
    got, read = _read_box(path, [rows + 10, 100], [rows, 300])  # rows in blocks 1 and 2
    assert torch.equal(got, full[rows + 10:2 * rows + 10, 100:400])
    assert read == 2 * CRC_BLOCK
    got, read = _read_box(path, [0, 0], [4096, 1024])
    assert torch.equal(got, full) and read == 4 * CRC_BLOCK
    # Damage in a block nobody reads goes unnoticed by that read; in a block
    # read, it is named.
    record = fastpersist.tensors.checkpoint.read_manifest(path).tensors[0]
    _flip(path / record.file, record.offset + 3 * CRC_BLOCK + 5)
    got, _ = _read_box(path, [0, 0], [rows, 1024])
    assert torch.equal(got, full[:rows])
    with pytest.raises(ChecksumMismatchError, match="block 3 of tensor"):
        _read_box(path, [3 * rows, 0], [10, 10])


# --- gloo jobs ----------------------------------------------------------------------------


def run_job(tmp_path: Path, scenario: str, world: int, args: dict[str, Any]
            ) -> list[dict[str, Any]]:
    return run_ranks(HELPERS / "dcp_worker.py", scenario, tmp_path / f"out-{scenario}-{world}",
                     world, args)


def test_four_ranks_save_two_ranks_and_one_process_load(tmp_path: Path) -> None:
    path, ref = tmp_path / "ckpt", tmp_path / "reference.pt"
    args = {"path": str(path), "reference": str(ref), "async": True}
    for report in run_job(tmp_path, "save", 4, args):
        assert report.get("ok"), report
    assert not find_leftovers(tmp_path)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("data-")) == [
        f"data-r{r:05d}-000.safetensors" for r in range(4)]

    # 2 ranks, rows instead of columns: each reads the blocks of its rows only.
    reports = run_job(tmp_path, "load", 2, args)
    for report in reports:
        assert report.get("ok"), report
        assert report["bytes_read"] < 0.6 * 8192 * 1024 * 4  # about half of "big"

    # 1 process, whole tensors: through DCP and through fastpersist.load.
    from torch.distributed.checkpoint._nested_dict import (
        flatten_state_dict,
        unflatten_state_dict,
    )

    reference = torch.load(ref, weights_only=False)
    reader = FastPersistReader(path)
    md = reader.read_metadata()
    flat = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in reference.items()}
    nested = unflatten_state_dict(flat, md.planner_data)
    dcp.load(nested, storage_reader=reader)
    got, _ = flatten_state_dict(nested)
    loaded = fastpersist.load(path)
    for k, v in reference.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
            assert torch.equal(loaded[k], v), k
        else:
            assert got[k] == v, k
    assert got["extra.blob"] == bytes(range(256))
    assert fpctl(["verify", str(path)]) == 0
    assert fpctl(["restore", str(path), "--to", str(tmp_path / "full.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "full.pt", weights_only=True)["big"],
                       reference["big"])


def test_staged_dtensors_have_storages_of_their_own(tmp_path: Path) -> None:
    (report,) = run_job(tmp_path, "stage", 1, {})
    assert report.get("ok"), report


def test_async_save_with_the_process_executor(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP pickles the writer and the snapshot into its own save process. Each
    rank stages 16 MiB per save under a 24 MiB budget: a snapshot that stayed
    counted after its hand-over would make the second save wait for ever."""
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(24 << 20))
    path, ref = tmp_path / "ckpt", tmp_path / "reference.pt"
    args = {"path": str(path), "reference": str(ref), "executor": "process", "saves": 3}
    for report in run_job(tmp_path, "save", 2, args):
        assert report.get("ok"), report
    assert not find_leftovers(tmp_path)
    assert fpctl(["verify", str(path)]) == 0
    loaded, reference = fastpersist.load(path), torch.load(ref, weights_only=False)
    for k, v in reference.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k


# --- SIGKILL ------------------------------------------------------------------------------

HOOKS = {"before_write": 1, "after_write": 1, "before_manifest": 1, "before_publish": 1,
         "after_publish": 2}


def test_sigkill_leaves_the_old_or_the_new_checkpoint(tmp_path: Path) -> None:
    targets = {hook: tmp_path / hook / "ckpt" for hook in HOOKS}
    for target in targets.values():
        target.parent.mkdir()
    kill_at_hooks({hook: [str(HELPERS / "dcp_kill_saver.py"), str(target), hook]
                   for hook, target in targets.items()})
    for hook, target in targets.items():
        version = HOOKS[hook]
        out = {"w": torch.zeros(1 << 20), "big": torch.zeros(3 << 20), "meta": {"version": 0}}
        dcp.load(out, storage_reader=FastPersistReader(target))
        assert out["meta"]["version"] == version, hook
        assert bool((out["w"] == version).all()) and bool((out["big"] == version).all()), hook
        assert fpctl(["verify", str(target)]) == 0
        # What the kill left is a leftover gc recognises (its process is gone).
        leftovers = find_leftovers(target.parent)
        assert [lo.kind for lo in leftovers] == ["tmp"], hook
        assert not leftovers[0].owner_alive
        collect(leftovers[0])
        assert [p.name for p in target.parent.iterdir()] == ["ckpt"], hook
        fastpersist.load(target)


def test_import_fastpersist_does_not_import_dcp() -> None:
    code = ("import sys, fastpersist\n"
            "fastpersist.load\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)



@pytest.mark.parametrize("ranks", [1, 2])
def test_example_runs(tmp_path: Path, ranks: int) -> None:
    """docs/guides/dcp.md: python examples/dcp_example.py, and under torchrun with 2 ranks."""
    out = run_example("dcp_example.py", tmp_path, ranks)
    assert "resumed from step 10 bit-exactly" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-5"]
