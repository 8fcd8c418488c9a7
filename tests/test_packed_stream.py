"""A compressed file of one tensor over a third of the staging budget is
written as it is encoded (tensors/packed_stream.py), byte for byte the file
that encoding it whole writes (issue 37: such a tensor held all its encoded
frames at once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.engine import get_engine
from fastpersist.tensors import packed, packed_stream
from fastpersist.tensors.plan import StoredTensor

FRAME = 256 << 10


def _stored(t: torch.Tensor, name: str = "w") -> StoredTensor:
    dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype]
    return StoredTensor(name, dtype, tuple(t.shape), t, t.nbytes)


def _tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    if dtype == torch.int64:
        return torch.randint(0, 1000, (n,), generator=g)  # compresses well
    return torch.randn(n, generator=g).to(dtype)  # hardly at all


@pytest.mark.parametrize("dtype, n", [(torch.float32, 1_300_000), (torch.bfloat16, 2_500_000),
                                      (torch.int64, 700_001)])
def test_the_streamed_file_is_the_one_encoding_it_whole_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int) -> None:
    t = _tensor(dtype, n)  # several batches of frames, the last frame short
    stored = _stored(t)
    monkeypatch.setenv("FASTPERSIST_CODEC_THREADS", "2")
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(3 << 20))
    assert packed_stream.streams([stored], FRAME)
    (tmp_path / "s").mkdir()
    (tmp_path / "w").mkdir()
    streamed = packed.write(get_engine(), str(tmp_path / "s"), "data-00000.fpz", [stored], FRAME)
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", "0")  # encoded whole
    assert not packed_stream.streams([stored], FRAME)
    whole = packed.write(get_engine(), str(tmp_path / "w"), "data-00000.fpz", [stored], FRAME)
    assert streamed == whole
    assert len(whole[1][0].frames) > 8
    a = (tmp_path / "s" / "data-00000.fpz").read_bytes()
    b = (tmp_path / "w" / "data-00000.fpz").read_bytes()
    assert a == b


def test_only_a_lone_tensor_over_a_third_of_the_budget_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    big, small = _stored(torch.zeros(1 << 20)), _stored(torch.zeros(100), "b")
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(12 << 20))  # a third: 4 MiB, as big
    assert not packed_stream.streams([big], FRAME)
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(9 << 20))
    assert packed_stream.streams([big], FRAME)
    assert not packed_stream.streams([big, small], FRAME)  # files are cut under the cap then
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", "0")
    assert not packed_stream.streams([big], FRAME)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_compressed_save_of_large_tensors_under_a_small_budget_round_trips(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(3 << 20))
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(FRAME))
    state = {"a": _tensor(torch.float32, 1_300_000), "b": _tensor(torch.int64, 700_001),
             "small": torch.arange(10)}
    written = []
    write = packed_stream.write
    monkeypatch.setattr(packed_stream, "write", lambda *a: written.append(a[2].name) or write(*a))
    ckpt = tmp_path / "ck"
    if how == "save":
        fastpersist.save(state, ckpt, compression="zstd")
    else:
        fastpersist.async_save(state, ckpt, compression="zstd").result()
    loaded = fastpersist.load(ckpt)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert fpctl(["verify", str(ckpt)]) == 0
    assert sorted(written) == ["a", "b"]  # each over a third of the budget, alone in its file


KILLED_MID_STREAM = r"""
import os, signal, sys, torch, fastpersist
from fastpersist.tensors import packed_stream
target = sys.argv[1]
fastpersist.save({"w": torch.full((1_300_000,), 1.0)}, target)  # version 1, uncompressed
os.environ["FASTPERSIST_STAGING_BUDGET"] = str(3 << 20)
os.environ["FASTPERSIST_FRAME_BYTES"] = str(256 << 10)
writes = [0]
pwrite = packed_stream._pwrite_all
def dying(fd, data, offset):
    pwrite(fd, data, offset)
    writes[0] += 1
    if writes[0] == 6:  # some frames on disk, the header not yet
        os.kill(os.getpid(), signal.SIGKILL)
packed_stream._pwrite_all = dying
g = torch.Generator().manual_seed(1)
fastpersist.save({"w": torch.randn(1_300_000, generator=g)}, target, compression="zstd")
"""


def test_a_save_killed_while_streaming_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_STREAM, str(target)], timeout=120)
    assert proc.returncode == -9
    loaded = fastpersist.load(target)
    assert torch.equal(loaded["w"], torch.full((1_300_000,), 1.0))
    assert fpctl(["verify", str(target)]) == 0
    leftovers = [p for p in tmp_path.iterdir() if p != target]
    assert leftovers and all(p.name.startswith(".") for p in leftovers), leftovers
    fastpersist.save({"w": torch.zeros(3)}, target)  # the next save goes ahead
    assert torch.equal(fastpersist.load(target)["w"], torch.zeros(3))
