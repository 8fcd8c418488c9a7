"""fastpersist.open: one tensor, or rows of one, read without the rest of the
checkpoint; from a directory, the object store (moto), the daemon's memory
(a real fastpersistd) and a distributed checkpoint's chunks. What is read is
counted at the engine (a local directory) or at the S3 client's ranged GETs."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, serving
from hostile_support import distributed_checkpoint, grid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import flip_bit

import fastpersist
from fastpersist.engine import get_engine
from fastpersist.errors import (
    CheckpointError,
    ChecksumMismatchError,
    TensorIndexError,
    TensorNotFoundError,
)
from fastpersist.format.manifest import Manifest
from fastpersist.loading.handle import CheckpointHandle, TensorInfo
from fastpersist.loading.load import load_from
from fastpersist.tensors.checkpoint import read_manifest
from fastpersist.tensors.source import LocalSource

Reads = list[tuple[str, int, int]]  # (file name, offset, length)


class CountingEngine:
    """The engine, recording every (file, offset, length) it reads."""

    def __init__(self, reads: Reads) -> None:
        self._engine, self.reads = get_engine(), reads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def read_file(self, path: str, segments: Any, **kwargs: Any) -> Any:
        for seg in segments:
            n = seg[2] if seg[0] is None else memoryview(seg[0]).nbytes
            self.reads.append((Path(path).name, seg[1], n))
        return self._engine.read_file(path, segments, **kwargs)


def counted(ckpt: Path, **kwargs: Any) -> tuple[CheckpointHandle, Reads]:
    reads: Reads = []
    return CheckpointHandle(LocalSource(ckpt, engine=CountingEngine(reads)), **kwargs), reads


def data_bytes(reads: Reads, manifest: Manifest) -> int:
    """The bytes read past the files' headers (the data sections)."""
    start = {f.name: f.data_start for f in manifest.files}
    return sum(max(0, off + n - max(off, start[name])) for name, off, n in reads)


def touched(reads: Reads, manifest: Manifest) -> set[str]:
    """The records any read overlapped."""
    return {r.name for r in manifest.tensors for name, off, n in reads
            if name == r.file and off < r.offset + r.stored_span and r.offset < off + n}


def trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(1)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5,
            "emb": torch.randn(1000, 16, generator=g), "tag": "run-1"}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = trained_state()
    fastpersist.save(state, tmp_path / "c")
    return tmp_path / "c", state


def test_keys_metadata_and_every_tensor(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    with fastpersist.open(ckpt) as h:
        assert h.keys() == [
            "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias",
            *[f"optim.state.{i}.{k}" for i in range(4) for k in ("step", "exp_avg",
                                                                  "exp_avg_sq")],
            "emb"]
        meta = h.metadata()
        assert meta["step"] == 5 and meta["tag"] == "run-1"
        assert meta["optim"]["param_groups"] == state["optim"]["param_groups"]
        assert meta["emb"] == TensorInfo("emb", torch.float32, (1000, 16))
        assert meta["optim"]["state"][2]["exp_avg"].name == "optim.state.2.exp_avg"
        loaded = fastpersist.load(ckpt)
        for name in h:
            parts = name.split(".")
            expected = loaded
            for p in parts if parts[0] != "model" else ["model", ".".join(parts[1:])]:
                expected = expected[int(p) if p.isdigit() and parts[0] == "optim" else p]
            assert torch.equal(h.get_tensor(name), expected), name
    with pytest.raises(CheckpointError, match="closed"):
        h.get_tensor("emb")


def test_get_tensor_reads_only_that_tensor(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    manifest = read_manifest(ckpt)
    h, reads = counted(ckpt)
    w = h.get_tensor("model.0.weight")
    assert torch.equal(w, state["model"]["0.weight"])
    assert touched(reads, manifest) == {r.name for r in manifest.tensors if r.name.endswith(
        "model.0.weight")} and data_bytes(reads, manifest) == w.nbytes


def test_slices_match_torch_indexing(saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    emb = state["emb"]
    for verify in (True, False):
        with fastpersist.open(ckpt, verify=verify) as h:
            s = h.get_slice("emb")
            assert s.get_shape() == [1000, 16] and s.dtype == torch.float32
            for index in (slice(10, 20), 7, -1, slice(None, None, 333), (slice(5, 9), 3),
                          (..., slice(2, 4)), (slice(990, None), ...), slice(500, 500),
                          (3, slice(1, 16, 5)), ...):
                assert torch.equal(s[index], emb[index]), index
            assert torch.equal(h.get_slice("optim.state.0.step")[...],
                               state["optim"]["state"][0]["step"])


@pytest.fixture(scope="module")
def shapes_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    shapes = [(0,), (5,), (1, 3), (4, 0), (6, 2), (3, 4, 2), ()]
    tensors = {f"t{i}": torch.arange(math.prod(s), dtype=torch.int32).reshape(s)
               for i, s in enumerate(shapes)}
    path = tmp_path_factory.mktemp("shapes") / "c"
    fastpersist.save(tensors, path)
    return path, tensors


def _index_item(draw: Any, n: int) -> Any:
    kind = draw(st.sampled_from(["int", "slice", "ellipsis"]))
    bound = st.one_of(st.none(), st.integers(-n - 2, n + 2))
    if kind == "int":
        return draw(st.integers(-n - 2, n + 1))
    if kind == "slice":
        return slice(draw(bound), draw(bound), draw(st.one_of(st.none(), st.integers(1, 3))))
    return ...


@st.composite
def _indexed(draw: Any) -> tuple[int, Any]:
    which = draw(st.integers(0, 6))
    shape = [(0,), (5,), (1, 3), (4, 0), (6, 2), (3, 4, 2), ()][which]
    items = tuple(_index_item(draw, shape[d] if d < len(shape) else 1)
                  for d in range(draw(st.integers(0, len(shape) + 1))))
    return which, items if draw(st.booleans()) or len(items) != 1 else items[0]


def _in_range(index: Any, shape: tuple[int, ...]) -> bool:
    """Whether slicing.cut accepts `index` (its rule: Python's, with no clipping)."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is ... for i in items) > 1 or sum(i is not ... for i in items) > len(shape):
        return False
    if ... in items:
        at = items.index(...)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1:]
    for item, n in zip(items, shape, strict=False):
        if isinstance(item, int) and not -n <= item < n:
            return False
        if isinstance(item, slice) and not all(b is None or -n <= b <= n
                                               for b in (item.start, item.stop)):
            return False
    return True


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_indexed(), verify=st.booleans())
def test_any_index_is_torchs_or_a_clear_error(shapes_ckpt: tuple[Path, dict[str, Any]],
                                              case: tuple[int, Any], verify: bool) -> None:
    path, tensors = shapes_ckpt
    which, index = case
    t = tensors[f"t{which}"]
    with fastpersist.open(path, verify=verify) as h:
        s = h.get_slice(f"t{which}")
        if _in_range(index, tuple(t.shape)):
            assert torch.equal(s[index], t[index]), index
        else:
            with pytest.raises(TensorIndexError, match=f"tensor 't{which}' of shape"):
                s[index]


def test_a_raw_slice_reads_its_record_when_verified_and_only_its_rows_when_not(
        saved: tuple[Path, dict[str, Any]]) -> None:
    """A raw record has one CRC32C: verifying a slice needs all of it."""
    ckpt, state = saved
    manifest = read_manifest(ckpt)
    (emb,) = [r for r in manifest.tensors if r.name.endswith("emb")]
    h, reads = counted(ckpt)
    assert torch.equal(h.get_slice("emb")[100:110], state["emb"][100:110])
    assert touched(reads, manifest) == {emb.name} and data_bytes(reads, manifest) == emb.length
    h, reads = counted(ckpt, verify=False)
    assert torch.equal(h.get_slice("emb")[100:110], state["emb"][100:110])
    assert reads == [(emb.file, emb.offset + 100 * 64, 10 * 64)]


def test_a_compressed_slice_reads_and_checks_only_its_frames(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(4096))
    g = torch.Generator().manual_seed(0)
    big = torch.randn(256, 64, generator=g)  # 64 KiB: 16 frames of 16 rows
    other = torch.randn(4096, generator=g)
    fastpersist.save({"big": big, "other": other}, tmp_path / "c", compression="zstd")
    manifest = read_manifest(tmp_path / "c")
    (rec,) = [r for r in manifest.tensors if r.name.endswith("big")]
    assert rec.frames is not None and len(rec.frames) == 16
    h, reads = counted(tmp_path / "c")
    assert torch.equal(h.get_slice("big")[40:50, 3], big[40:50, 3])  # rows in frames 2 and 3
    frames = rec.frames[2:4]
    assert reads == [(rec.file, rec.offset + frames[0].stored_offset,
                      sum(f.stored_length for f in frames))]
    # A bit flipped in frame 10: a slice over it names the file and tensor; other
    # rows are still read (each frame has its CRC32C); the whole tensor fails.
    flip_bit(tmp_path / "c" / rec.file, rec.offset + rec.frames[10].stored_offset + 5)
    with fastpersist.open(tmp_path / "c") as h:
        with pytest.raises(ChecksumMismatchError, match="big") as info:
            h.get_slice("big")[160:161]
        assert info.value.file == rec.file and info.value.tensor == rec.name
        assert torch.equal(h.get_slice("big")[:160], big[:160])
        with pytest.raises(ChecksumMismatchError):
            h.get_tensor("big")
        assert torch.equal(h.get_tensor("other"), other)


def test_a_corrupt_raw_record_fails_any_verified_slice_of_it(
        saved: tuple[Path, dict[str, Any]]) -> None:
    ckpt, state = saved
    manifest = read_manifest(ckpt)
    (emb,) = [r for r in manifest.tensors if r.name.endswith("emb")]
    flip_bit(ckpt / emb.file, emb.offset + 900 * 64)  # row 900
    with fastpersist.open(ckpt) as h:
        with pytest.raises(ChecksumMismatchError) as info:
            h.get_slice("emb")[:10]
        assert info.value.file == emb.file and info.value.tensor == emb.name
        assert str(ckpt) in str(info.value) and emb.file in str(info.value)
        assert torch.equal(h.get_tensor("model.1.bias"), state["model"]["1.bias"])
    with fastpersist.open(ckpt, verify=False) as h:  # unchecked: only the rows asked for
        assert torch.equal(h.get_slice("emb")[:10], state["emb"][:10])


def test_bad_names_and_indices_fail_before_any_read(saved: tuple[Path, dict[str, Any]]
                                                    ) -> None:
    ckpt, _ = saved
    h, reads = counted(ckpt)
    with pytest.raises(TensorNotFoundError, match=r"'model\.0\.wieght'.*'model\.0\.weight'"
                       ) as info:
        h.get_tensor("model.0.wieght")
    assert isinstance(info.value, KeyError) and str(ckpt) in str(info.value)
    with pytest.raises(KeyError):
        h.get_slice("nope")
    s = h.get_slice("emb")
    for index, what in [(slice(990, 1010), r"slice 990:1010 is out of range for dimension 0 "
                                           r"\(size 1000\)"),
                        (1000, r"index 1000 is out of range for dimension 0"),
                        (-1001, "index -1001"),
                        ((0, 16), r"index 16 is out of range for dimension 1 \(size 16\)"),
                        ((0, 0, 0), "3 indices for 2 dimensions"),
                        (slice(None, None, -1), "slice step -1 along dimension 0: only positive"),
                        ((..., ...), r"an index can have only one `\.\.\.`")]:
        with pytest.raises(TensorIndexError, match=f"^{re.escape(str(ckpt))}: "
                           r"tensor 'emb' of shape \[1000, 16\]: " + what):
            s[index]
    with pytest.raises(IndexError):
        s[2000]
    with pytest.raises(TypeError, match="not str"):
        s["a"]
    assert reads == []
    with pytest.raises(fastpersist.CheckpointNotFoundError):
        fastpersist.open(ckpt.parent / "nothing-here")


def test_map_location_and_parameters(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
    fastpersist.save({"p": p, "v": p.detach()[1:3]}, tmp_path / "c")
    with fastpersist.open(tmp_path / "c", map_location="meta") as h:
        t = h.get_tensor("p")
        assert isinstance(t, torch.nn.Parameter) and t.device.type == "meta"
        assert h.get_slice("v")[0].device.type == "meta"
    with fastpersist.open(tmp_path / "c") as h:
        assert torch.equal(h.get_tensor("v"), p.detach()[1:3])  # a view, read whole and cut
        row = h.get_slice("v")[1]
        assert torch.equal(row, p.detach()[2])
        assert row.untyped_storage().nbytes() == row.nbytes  # not a view of the whole entry
        assert "p" in h and list(h) == ["p", "v"]


def test_a_callable_map_location_places_slices_as_get_tensor(tmp_path: Path) -> None:
    import json

    w = torch.arange(12.0).reshape(4, 3)
    fastpersist.save({"w": w}, tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["tree"]["v"][0]["device"] = "cuda:0"  # as if saved from a GPU (torch's idiom below)
    manifest.write_text(json.dumps(m))
    calls: list[str] = []

    def keep(storage: Any, location: str) -> Any:
        calls.append(location)
        return storage

    for verify in (True, False):
        with fastpersist.open(tmp_path / "c", map_location=keep, verify=verify) as h:
            whole = h.get_tensor("w")
            rows = h.get_slice("w")[1:3]
        assert whole.device.type == "cpu" and rows.device.type == "cpu"
        assert torch.equal(rows, w[1:3]) and calls == ["cuda:0", "cuda:0"]
        calls.clear()
    with fastpersist.open(tmp_path / "c", map_location=lambda s, loc: torch.ones(3)) as h, \
            pytest.raises(CheckpointError, match=r"map_location.*'cuda:0'.*Tensor"):
        h.get_slice("w")[1:]


def test_numpy_values_a_bare_tensor_and_odd_keys(tmp_path: Path) -> None:
    import numpy as np

    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    fastpersist.save({"np": arr, 3: [torch.ones(2), {"x": torch.zeros(1)}]}, tmp_path / "a")
    with fastpersist.open(tmp_path / "a") as h:
        assert h.keys() == ["np", "3.0", "3.1.x"]
        meta = h.metadata()
        assert meta["np"] == TensorInfo("np", torch.int32, (2, 3))
        assert meta[3][1]["x"].name == "3.1.x"
        assert torch.equal(h.get_tensor("np"), torch.from_numpy(arr))
        assert torch.equal(h.get_slice("np")[1], torch.from_numpy(arr[1]))
    fastpersist.save(torch.arange(5), tmp_path / "b")
    with fastpersist.open(tmp_path / "b") as h:
        assert h.keys() == ["<root>"] and torch.equal(h.get_slice("<root>")[1:3],
                                                       torch.arange(1, 3))


def test_a_distributed_checkpoint_reads_only_the_chunks_over_the_rows(tmp_path: Path) -> None:
    """A schema-2 manifest as a job's rank 0 writes it (hostile_support.py):
    `w` stored as a 4x2 grid of chunks, rows 0-1, 2-4, 5-6, 7-9."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 6, generator=g)
    expected = distributed_checkpoint(tmp_path / "c", {
        "w": (w, grid((10, 6), [[2, 5, 7], [3]])),
        "b": (torch.arange(5.0), grid((5,), [[2]]))}, values={"step": 3})
    manifest = read_manifest(tmp_path / "c")
    h, reads = counted(tmp_path / "c")
    assert h.keys() == ["w", "b"] and h.metadata()["step"] == 3
    assert torch.equal(h.get_tensor("w"), expected["w"])
    assert touched(reads, manifest) == {r.name for r in manifest.tensors
                                        if r.name.startswith("w@")}
    reads.clear()
    assert torch.equal(h.get_slice("w")[3:6, 4], w[3:6, 4])
    assert touched(reads, manifest) == {"w@2,0", "w@2,3", "w@5,0", "w@5,3"}
    with pytest.raises(TensorIndexError, match=r"tensor 'w' of shape \[10, 6\]"):
        h.get_slice("w")[8:11]
    # A bit flipped in chunk w@7,3: only a read over its rows finds it, and names it.
    (bad,) = [r for r in manifest.tensors if r.name == "w@7,3"]
    flip_bit(tmp_path / "c" / bad.file, bad.offset + 3)
    with fastpersist.open(tmp_path / "c") as h:
        assert torch.equal(h.get_slice("w")[:7], w[:7])
        with pytest.raises(ChecksumMismatchError) as info:
            h.get_slice("w")[9]
        assert info.value.file == bad.file and info.value.tensor == "w@7,3"


def test_into_of_a_distributed_checkpoint_reads_only_the_globals_it_names(tmp_path: Path
                                                                         ) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(10, 6, generator=g), torch.randn(7, generator=g)
    distributed_checkpoint(tmp_path / "c", {"w": (w, grid((10, 6), [[4]])),
                                            "b": (b, grid((7,), [[3]]))}, values={"step": 3})
    manifest = read_manifest(tmp_path / "c")
    reads: Reads = []
    into = {"b": torch.zeros(7)}
    loaded = load_from(LocalSource(tmp_path / "c", engine=CountingEngine(reads)), into=into)
    assert loaded == {"b": into["b"], "step": 3} and torch.equal(into["b"], b)
    assert touched(reads, manifest) == {"b@0", "b@3"}
    reads.clear()  # like= names a part the same way
    loaded = load_from(LocalSource(tmp_path / "c", engine=CountingEngine(reads)),
                       like={"w": torch.zeros(10, 6)})
    assert set(loaded) == {"w", "step"} and torch.equal(loaded["w"], w)
    assert touched(reads, manifest) == {"w@0,0", "w@4,0"}


def test_pickled_values_are_unpickled_only_when_allowed(tmp_path: Path) -> None:
    fastpersist.save({"w": torch.ones(3), "obj": {1, 2}}, tmp_path / "c", allow_pickle=True)
    with fastpersist.open(tmp_path / "c") as h:
        assert h.keys() == ["w"] and torch.equal(h.get_tensor("w"), torch.ones(3))
        with pytest.raises(fastpersist.PickleNotAllowedError):
            h.metadata()
    with fastpersist.open(tmp_path / "c", allow_pickle=True) as h:
        assert h.metadata()["obj"] == {1, 2}


@pytest.mark.slow
def test_a_checkpoint_two_ranks_saved_with_dtensors(tmp_path: Path) -> None:
    """Real ranks (gloo): tp.rows is saved row-sharded over 2 ranks, tp.cols
    column-sharded; a slice of rows reads only the chunk that holds them."""
    from dist_support import ok, run_job, worker_module

    ckpt = tmp_path / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0"], {"path": str(ckpt), "dp": 1, "tp": 2}))
    manifest = read_manifest(ckpt)
    assert manifest.globals is not None
    full = worker_module().sharded_tensors()
    h, reads = counted(ckpt)
    assert {"tp.rows", "tp.cols", "model.embed", "model.tied"} <= set(h.keys())
    assert torch.equal(h.get_tensor("tp.cols"), full["cols"])
    (rows,) = [g for g in manifest.globals if g.name == "tp.rows"]
    assert len(rows.chunks) == 2
    reads.clear()
    assert torch.equal(h.get_slice("tp.rows")[40:45, :5], full["rows"][40:45, :5])
    (second,) = [c for c in rows.chunks if c.offsets[0] == 32]
    assert touched(reads, manifest) == {manifest.tensors[second.tensor].name}


# -- the object store and the daemon's memory -----------------------------------------


@pytest.fixture
def ranged_gets(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Every ranged GET the tier's client sends: (object name, offset, length)."""
    from fastpersist.tier.client import S3

    gets: Reads = []
    original = S3.read_range

    def read_range(self: S3, url: Any, name: str, offset: int, length: int, fn: Any) -> Any:
        gets.append((name, offset, length))
        return original(self, url, name, offset, length, fn)

    monkeypatch.setattr(S3, "read_range", read_range)
    return gets


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_from_the_object_store(s3: Any, tmp_path: Path, ranged_gets: Reads,
                               monkeypatch: pytest.MonkeyPatch, compression: str) -> None:
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(4096))
    state = trained_state()
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, tier_compression=compression)
    ckpt.save(7, state)
    ckpt.close()  # waits for the upload
    url = f"{s3.url}/step-00000007"
    ranged_gets.clear()
    with fastpersist.open(url) as h:
        assert h.metadata()["step"] == 5
        assert torch.equal(h.get_tensor("model.1.weight"), state["model"]["1.weight"])
        assert torch.equal(h.get_slice("emb")[500:520], state["emb"][500:520])
    from fastpersist.tier.client import client_for
    from fastpersist.tier.remote import read_manifest as remote_manifest
    from fastpersist.tier.url import TierURL

    stored = remote_manifest(client_for(None), TierURL.parse(url))[0]
    data = [(n, o, ln) for n, o, ln in ranged_gets
            if o >= {f.name: f.data_start for f in stored.files}.get(n, 1 << 62)]
    assert touched(data, stored) <= {r.name for r in stored.tensors
                                     if r.name.endswith(("model.1.weight", "emb"))}
    emb = next(r for r in stored.tensors if r.name.endswith("emb"))
    emb_bytes = sum(ln for n, o, ln in data if n == emb.file and emb.offset <= o
                    < emb.offset + emb.stored_span)
    if emb.frames is not None:  # only the frames over rows 500..520 (64 rows a frame)
        assert emb_bytes == emb.frames[7].stored_length + emb.frames[8].stored_length
    else:  # verified: the raw record whole
        assert emb_bytes == emb.length
    # One bit flipped in the stored bytes of rows 640..703 (frame 10, compressed).
    key = url.removeprefix(f"s3://{s3.bucket}/") + "/" + emb.file
    data = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    at = emb.offset + (emb.frames[10].stored_offset + 3 if emb.frames is not None else 650 * 64)
    data[at] ^= 1
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    with fastpersist.open(url) as h:
        with pytest.raises(ChecksumMismatchError) as info:
            h.get_slice("emb")[650]
        assert info.value.file == emb.file and info.value.tensor == emb.name
        if emb.frames is not None:  # other frames still read, each checked
            assert torch.equal(h.get_slice("emb")[:640], state["emb"][:640])
        else:  # one CRC32C for the raw record: every verified slice of it fails
            with pytest.raises(ChecksumMismatchError):
                h.get_slice("emb")[:10]


@pytest.fixture
def memory_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    with serving(Daemon(tmp_path, "--memory-tier-count", "2", "--memory-tier-bytes", "64M"),
                 monkeypatch) as d:
        yield d


@pytest.mark.slow
def test_from_the_daemons_memory(memory_daemon: Daemon) -> None:
    """The data files are removed: only the daemon's copy holds the tensors."""
    ckpt = memory_daemon.root / "step-1"
    state = trained_state()
    fastpersist.save(state, ckpt, daemon=memory_daemon.address)
    for f in ckpt.glob("data-*"):
        f.unlink()
    with fastpersist.open(ckpt, daemon=memory_daemon.address) as h:
        assert torch.equal(h.get_tensor("optim.state.3.exp_avg"),
                           state["optim"]["state"][3]["exp_avg"])
        assert torch.equal(h.get_slice("emb")[3:5], state["emb"][3:5])
    with fastpersist.open(ckpt, daemon=memory_daemon.address, verify=False) as h:
        assert torch.equal(h.get_slice("emb")[-2:], state["emb"][-2:])
    with fastpersist.open(ckpt, daemon="") as h, pytest.raises(CheckpointError, match="data"):
        h.get_tensor("emb")
