"""Loads to an accelerator through a bounded ring of host buffers
(tensors/device_load.py, issue 14 part 2).

The ring's logic (chunks of consecutive tensors, tensors larger than a slot
read in pieces, CRC32Cs combined from the pieces, slots reused) is the same
on the CPU, where the copies are synchronous: these tests run it there
against the usual read, on every engine. The CUDA test runs where there is
a GPU (benchmarks/gpu_check.py measures it).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastpersist
from fastpersist import ChecksumMismatchError, TruncatedFileError
from fastpersist.engine import get_engine
from fastpersist.tensors import checkpoint, device_load

CPU = torch.device("cpu")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300_000, generator=g)
    small = torch.randn(4096, generator=g)
    return {
        "big": big,  # 1.2 MB: many slots' worth with the small rings below
        "view": big[10:20],  # a view: stored as its own bytes
        "bf16": torch.randn(33, 7, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "flags": torch.rand(1000, generator=g) > 0.5,
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "cplx": torch.randn(17, dtype=torch.complex64, generator=g),
        "step": 7,
        # Small enough to share a device allocation with its neighbours: the
        # strided view and its base are views of one stored span, at an
        # offset in that allocation (the GPU run found them read as zeros).
        "small": small,
        "strided": small[10:5000:7],
    }


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(512 << 10))  # several data files
    path = tmp_path / "ckpt"
    fastpersist.save(_state(), path)
    return path


@pytest.mark.parametrize("ring_bytes", [64, 4096 * 3 + 8, 1 << 20, 64 << 20])
def test_the_ring_reads_what_the_usual_read_does(saved: Path, ring_bytes: int) -> None:
    manifest = checkpoint.read_manifest(saved)
    expected = checkpoint.read_tensors(saved, manifest, get_engine(), verify=True)
    got = device_load.read_to_device(saved, manifest, get_engine(), CPU, verify=True,
                                     ring_bytes=ring_bytes)
    assert len(got) == len(expected)
    for r, a, b in zip(manifest.tensors, got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, r.name
        assert torch.equal(a, b), r.name


def test_chunks_cover_every_byte_once_within_a_slot() -> None:
    from fastpersist.format.manifest import TensorRecord

    records = [(i, TensorRecord(name=f"t{i}", file="f", offset=off, length=n, dtype="U8",
                                shape=(n,), crc32c=0))
               for i, (off, n) in enumerate([(0, 10), (16, 100), (128, 0), (128, 7)])]
    for slot in (1, 3, 16, 50, 1000):
        seen: dict[int, list[tuple[int, int]]] = {}
        for chunk in device_load._chunks(records, slot):
            start = chunk[0].file_offset
            assert chunk[-1].file_offset + chunk[-1].length - start <= slot
            for p in chunk:
                seen.setdefault(p.index, []).append((p.at, p.length))
        for i, r in records:
            pieces = sorted(seen.get(i, []))
            assert sum(n for _, n in pieces) == r.length
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(pieces))


def test_a_corrupt_tensor_is_named(saved: Path) -> None:
    manifest = checkpoint.read_manifest(saved)
    big = next(r for r in manifest.tensors if r.name.startswith("big"))
    f = next(f for f in manifest.files if f.name == big.file)
    with open(saved / f.name, "r+b") as fh:
        fh.seek(big.offset + big.length // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumMismatchError, match=big.name):
        device_load.read_to_device(saved, manifest, get_engine(), CPU, verify=True,
                                   ring_bytes=4096)
    # verify=False reads what is there
    got = device_load.read_to_device(saved, manifest, get_engine(), CPU, verify=False,
                                     ring_bytes=4096)
    assert got[manifest.tensors.index(big)].numel() == big.length  # a U8 storage


def _many_small(count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    kinds = itertools.cycle([torch.float32, torch.bfloat16, torch.int8, torch.float64,
                             torch.bool, torch.int16])
    return {f"t{i}": (torch.randn(i % 9 + 1, generator=g) * 50).to(kind)
            for i, kind in zip(range(count), kinds, strict=False)}


def test_small_tensors_share_one_allocation_per_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors below SHARED_BELOW that lie together in a chunk become views of
    one allocation (one copy for all); larger ones get their own."""
    state = {**_many_small(600), "large": torch.randn(4096)}
    fastpersist.save(state, tmp_path / "c")
    manifest = checkpoint.read_manifest(tmp_path / "c")
    monkeypatch.setattr(device_load, "SHARED_BELOW", 1024)  # "large" (16 KiB) is not small
    for ring_bytes in (4 << 10, 64 << 10, 16 << 20):
        got = device_load.read_to_device(tmp_path / "c", manifest, get_engine(), CPU,
                                         verify=True, ring_bytes=ring_bytes)
        by_name = {r.name: t for r, t in zip(manifest.tensors, got, strict=True)}
        for k, v in state.items():
            assert by_name[k].dtype == v.dtype and torch.equal(by_name[k], v), k
        storages = {t.untyped_storage().data_ptr() for k, t in by_name.items() if k != "large"}
        # one allocation per run of a chunk: at most a few per slot of the file's bytes
        span = sum(r.length for r in manifest.tensors if r.name != "large")
        assert len(storages) <= 2 * (span // (ring_bytes // device_load.SLOTS) + 1), ring_bytes
        large = by_name["large"]
        assert large.untyped_storage().nbytes() == large.nbytes  # its own


def test_a_corrupt_small_tensor_in_a_shared_run_is_named(tmp_path: Path) -> None:
    fastpersist.save(_many_small(50), tmp_path / "c")
    manifest = checkpoint.read_manifest(tmp_path / "c")
    victim = manifest.tensors[20]
    with open(tmp_path / "c" / victim.file, "r+b") as fh:
        fh.seek(victim.offset)
        b = fh.read(1)
        fh.seek(victim.offset)
        fh.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError, match=victim.name):
        device_load.read_to_device(tmp_path / "c", manifest, get_engine(), CPU, verify=True,
                                   ring_bytes=1 << 20)


def test_a_truncated_file_is_named(saved: Path) -> None:
    manifest = checkpoint.read_manifest(saved)
    f = max(manifest.files, key=lambda f: f.size)
    os.truncate(saved / f.name, f.size - 100)
    with pytest.raises(TruncatedFileError, match=f.name):
        device_load.read_to_device(saved, manifest, get_engine(), CPU, verify=True,
                                   ring_bytes=1 << 20)


def test_load_takes_the_ring_for_an_accelerator(saved: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """fastpersist.load's hook, with the CPU standing in for the accelerator."""
    used: list[torch.device] = []
    real = device_load.read_to_device

    def spy(*args: Any, **kwargs: Any) -> Any:
        used.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(device_load, "enabled", lambda *a: CPU)
    monkeypatch.setattr(device_load, "read_to_device", spy)
    loaded = fastpersist.load(saved)
    assert used == [CPU]
    for k, v in _state().items():
        assert (torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v), k


@pytest.mark.parametrize("ring_bytes", [64, 4096 * 3 + 8, 64 << 20])
def test_the_ring_copies_into_given_tensors(saved: Path, ring_bytes: int) -> None:
    """load(into=) through the ring: a record with a destination lands in it
    (in pieces when larger than a slot), never in a shared run; the rest as usual."""
    manifest = checkpoint.read_manifest(saved)
    expected = checkpoint.read_tensors(saved, manifest, get_engine(), verify=True)
    dests = {i: torch.full_like(t, 7) for i, t in enumerate(expected) if i % 2 == 0}
    got = device_load.read_to_device(saved, manifest, get_engine(), CPU, verify=True,
                                     ring_bytes=ring_bytes, dests=dests)
    for i, (r, a, b) in enumerate(zip(manifest.tensors, got, expected, strict=True)):
        assert torch.equal(a, b), r.name
        if i in dests:
            assert a is dests[i], r.name
        else:  # a small neighbour of a destination may share a run, never with it
            assert all(a.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
                       for d in dests.values() if d.numel()), r.name


def test_load_into_takes_the_ring_for_an_accelerator(saved: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """load(into=...) with the CPU standing in for the accelerator: the caller's
    tensors are the ring's destinations (none allocated and copied)."""
    seen: list[list[int]] = []
    real = device_load.read_to_device

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(kwargs["dests"] or {}))
        return real(*args, **kwargs)

    monkeypatch.setattr(device_load, "enabled", lambda *a: CPU)
    monkeypatch.setattr(device_load, "read_to_device", spy)
    state = _state()
    into = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    loaded = fastpersist.load(saved, into=into)
    manifest = checkpoint.read_manifest(saved)
    # Every non-empty record but big's storage, which "big" and "view" are views of
    # (those get their values by copy_).
    assert seen[0] == [i for i, r in enumerate(manifest.tensors)
                       if r.length and not r.name.endswith(".__storage__")]
    for k, v in into.items():
        assert loaded[k] is v and torch.equal(v, state[k]), k
    assert loaded["step"] == 7


def test_a_partial_into_streams_only_its_records(saved: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """load(into=) of part of the state through the ring (the CPU standing in):
    the ring is given only the records `into` names, its destinations
    numbered as those records."""
    seen: list[tuple[list[str], list[int]]] = []
    real = device_load.read_to_device

    def spy(path: Any, manifest: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(([r.name for r in manifest.tensors], sorted(kwargs["dests"] or {})))
        return real(path, manifest, *args, **kwargs)

    monkeypatch.setattr(device_load, "enabled", lambda *a: CPU)
    monkeypatch.setattr(device_load, "read_to_device", spy)
    state = _state()
    into = {"bf16": torch.zeros(33, 7, dtype=torch.bfloat16), "ints": torch.zeros(100,
                                                                               dtype=torch.int64)}
    loaded = fastpersist.load(saved, into=into)
    assert seen == [(["bf16", "ints"], [0, 1])]
    assert set(loaded) == {"bf16", "ints", "step"}
    assert all(loaded[k] is into[k] and torch.equal(into[k], state[k]) for k in into)


def test_when_the_ring_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fastpersist.save({"a": torch.ones(4096)}, tmp_path / "raw")
    fastpersist.save({"a": torch.ones(4096)}, tmp_path / "zstd", compression="zstd")
    raw = checkpoint.read_manifest(tmp_path / "raw")
    packed = checkpoint.read_manifest(tmp_path / "zstd")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_load.enabled("cuda:0", raw, 1 << 20) == torch.device("cuda:0")
    assert device_load.enabled(torch.device("cuda", 1), raw, 1 << 20) == torch.device("cuda:1")
    assert device_load.enabled("cuda:2", raw, 1 << 20) is None  # no such device: the usual error
    assert device_load.enabled("cpu", raw, 1 << 20) is None
    assert device_load.enabled(None, raw, 1 << 20) is None
    assert device_load.enabled({"cpu": "cuda:0"}, raw, 1 << 20) is None
    assert device_load.enabled("cuda:0", raw, 0) is None  # FASTPERSIST_LOAD_RING_BYTES=0
    if any(r.frames for r in packed.tensors):
        assert device_load.enabled("cuda:0", packed, 1 << 20) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    assert device_load.enabled("cuda:0", raw, 1 << 20) is None


def test_with_no_map_location_the_ring_goes_where_most_bytes_were_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fastpersist.save({"w": torch.ones(4096), "rng": torch.ones(16, dtype=torch.uint8),
                      "np": np.ones(3)}, tmp_path / "c")
    m = checkpoint.read_manifest(tmp_path / "c")
    assert device_load.enabled(None, m, 1 << 20) is None  # all on the CPU

    def on(devices: dict[str, str]) -> Any:
        def walk(n: Any) -> Any:
            if isinstance(n, dict):
                if n.get("t") == "tensor":
                    name = m.tensors[n["e"]].name
                    return {**n, "device": devices[name]} if name in devices else n
                return {k: walk(v) for k, v in n.items()}
            return [walk(v) for v in n] if isinstance(n, list) else n
        return dataclasses.replace(m, tree=walk(m.tree))

    # as saved from a GPU, with a CPU RNG state and a numpy value
    assert device_load.enabled(None, on({"w": "cuda:1"}), 1 << 20) == torch.device("cuda:1")
    assert device_load.enabled(None, on({"w": "cuda:1"}), 0) is None
    assert device_load.enabled(None, on({"rng": "cuda:0"}), 1 << 20) is None  # most on the CPU
    assert device_load.enabled(None, on({"w": "cuda:0", "rng": "cuda:1"}), 1 << 20) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_a_load_to_the_gpu_streams_through_the_ring(saved: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_RING_BYTES", str(64 << 10))
    loaded = fastpersist.load(saved, map_location="cuda:0")
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            assert loaded[k].device.type == "cuda", k
            assert torch.equal(loaded[k].cpu(), v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_a_load_into_gpu_tensors_streams_through_the_ring(saved: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_RING_BYTES", str(64 << 10))
    state = _state()
    into = {k: torch.zeros_like(v, device="cuda:0") for k, v in state.items()
            if isinstance(v, torch.Tensor)}
    addresses = {k: v.data_ptr() for k, v in into.items()}
    loaded = fastpersist.load(saved, map_location="cuda:0", into=into)
    for k, v in into.items():
        assert loaded[k] is v and v.data_ptr() == addresses[k], k
        assert torch.equal(v.cpu(), state[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_a_gpu_checkpoint_loads_back_to_the_gpu_through_the_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.randn(300_000, device="cuda"), "rng": torch.random.get_rng_state()}
    fastpersist.save(state, tmp_path / "g")
    used: list[torch.device] = []
    real = device_load.read_to_device
    monkeypatch.setattr(device_load, "read_to_device",
                        lambda *a, **k: used.append(a[3]) or real(*a, **k))
    loaded = fastpersist.load(tmp_path / "g")
    assert used == [torch.device("cuda:0")]
    assert loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])
    assert not loaded["rng"].is_cuda and torch.equal(loaded["rng"], state["rng"])
