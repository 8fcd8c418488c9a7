"""Restoring from the object-store tier: load("s3://..."), Checkpointer.latest()
falling back to the store, and fpctl on s3:// URLs. Against a real S3 server
(moto, a subprocess)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_loaded_into, assert_same_state, zeros_like_state

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    TruncatedFileError,
)
from fastpersist.format.manifest import Manifest
from fastpersist.tier.remote import GAP, plan

MIB = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 * MIB, generator=g)  # 12 MiB: several ranged GETs
    return {
        "big": big, "view": big[10:20], "tied": {"a": big, "b": big},
        "half": torch.randn(300, 7, generator=g).half(), "ints": torch.arange(1000),
        "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 3),
        "step": 7, "name": "run", "nested": [1.5, None, {"x": torch.ones(2, 2)}],
    }


@pytest.fixture(params=["none"])
def uploaded(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> tuple[str, Any]:
    """A checkpoint uploaded by a Checkpointer: (its URL, the state saved);
    uploaded raw unless the test asks for tier_compression="zstd"."""
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    state = _state()
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url,
                                    tier_compression=request.param)
    ckpt.save(7, state)
    ckpt.close()  # waits for the upload
    return f"{s3.url}/step-00000007", state


def _object(s3: Any, url: str, name: str) -> bytes:
    key = url.removeprefix(f"s3://{s3.bucket}/") + "/" + name
    return bytes(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())


def _put(s3: Any, url: str, name: str, data: bytes) -> None:
    key = url.removeprefix(f"s3://{s3.bucket}/") + "/" + name
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=data)


@pytest.mark.parametrize("uploaded", ["none", "zstd"], indirect=True)
def test_load_from_the_store(s3: Any, uploaded: tuple[str, Any]) -> None:
    url, state = uploaded
    seen = []
    loaded = fastpersist.load(url, progress=seen.append)
    assert_same_state(state, loaded)
    assert loaded["tied"]["a"] is loaded["tied"]["b"]  # ties and views come back
    assert (loaded["view"].untyped_storage().data_ptr()
            == loaded["big"].untyped_storage().data_ptr())
    into = zeros_like_state(state)  # load(into=): the same values, in the caller's tensors
    assert_loaded_into(loaded, fastpersist.load(url, into=into), into)
    manifest = Manifest.from_json(_object(s3, url, "manifest.json"), url)
    assert sum(seen) == manifest.tensor_bytes
    # zstd (the default): uploaded compressed, the local copy raw.
    names = {f.name for f in manifest.files}
    assert names == ({"data-00000.fpz"} if any(t.frames for t in manifest.tensors)
                     else {"data-00000.safetensors"})


def test_a_corrupted_object_names_the_file_and_tensor(s3: Any, uploaded: tuple[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = uploaded
    manifest = Manifest.from_json(_object(s3, url, "manifest.json"), url)
    record = next(t for t in manifest.tensors if t.name == "half")
    data = bytearray(_object(s3, url, record.file))
    data[record.offset + 5] ^= 0x10
    _put(s3, url, record.file, bytes(data))
    with pytest.raises(ChecksumMismatchError, match=f"tensor 'half' in {record.file}") as info:
        fastpersist.load(url)
    assert (info.value.file, info.value.tensor) == (record.file, "half")
    assert fpctl(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT {url}" in out and f"{record.file}: tensor 'half': CRC32C" in out
    assert fpctl(["verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["problems"]) == 1
    # The header too.
    data[record.offset + 5] ^= 0x10
    data[20] ^= 0x01
    _put(s3, url, record.file, bytes(data))
    with pytest.raises(ChecksumMismatchError, match="header") as info:
        fastpersist.load(url)
    assert info.value.tensor == "<header>"


def test_missing_and_truncated_objects(s3: Any, uploaded: tuple[str, Any]) -> None:
    url, _ = uploaded
    data = _object(s3, url, "data-00000.safetensors")
    _put(s3, url, "data-00000.safetensors", data[:-100])
    with pytest.raises(TruncatedFileError, match=r"data-00000\.safetensors is truncated"):
        fastpersist.load(url)
    s3.client.delete_object(Bucket=s3.bucket,
                            Key=url.removeprefix(f"s3://{s3.bucket}/") + "/data-00000.safetensors")
    with pytest.raises(CorruptCheckpointError, match=r"data-00000\.safetensors is missing"):
        fastpersist.load(url)
    with pytest.raises(CheckpointNotFoundError, match=r"no manifest\.json"):
        fastpersist.load(f"{s3.url}/step-99")  # e.g. an upload not finished


def test_latest_falls_back_to_the_store(s3: Any, tmp_path: Path) -> None:
    root = tmp_path / "run"
    ckpt = fastpersist.Checkpointer(root, tier=s3.url)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step})
    ckpt.close()
    shutil.rmtree(root)  # the node is gone; a new one starts with an empty disk
    fresh = fastpersist.Checkpointer(root, tier=s3.url)
    assert fresh.latest() == f"{s3.url}/step-00000002"
    state = fresh.load_latest()
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
    fresh.save(3, state).result()
    assert fresh.latest() == root / "step-00000003"  # a local one again
    fresh.close()
    assert fastpersist.Checkpointer(tmp_path / "other").latest() is None  # no tier


def test_fpctl_ls_inspect_restore_gc(s3: Any, uploaded: tuple[str, Any], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url, state = uploaded
    _put(s3, f"{s3.url}/step-00000009", "data-00000.safetensors", b"partial")
    assert fpctl(["ls", s3.url]) == 0
    out = capsys.readouterr().out
    assert "step-00000007" in out and "committed" in out
    assert "step-00000009" in out and "incomplete" in out
    assert fpctl(["ls", s3.url, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["step-00000007"]["tensors"] == 6 and rows["step-00000009"]["tensors"] is None
    assert fpctl(["inspect", url]) == 0
    assert "half" in capsys.readouterr().out
    assert fpctl(["verify", url]) == 0
    assert capsys.readouterr().out.startswith(f"OK {url}")
    # --endpoint-url instead of the environment.
    endpoint = s3.endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    target = tmp_path / "out.pt"
    assert fpctl(["restore", url, "--to", str(target), "--endpoint-url", endpoint]) == 0
    assert_same_state(state, torch.load(target, weights_only=True))
    assert fpctl(["gc", s3.url, "--older-than", "3600", "--endpoint-url", endpoint]) == 0
    assert "nothing to clean" in capsys.readouterr().out
    assert fpctl(["gc", s3.url, "--older-than", "0", "--endpoint-url", endpoint]) == 0
    assert f"removed incomplete {s3.url}/step-00000009" in capsys.readouterr().out
    assert fpctl(["ls", s3.url, "--endpoint-url", endpoint]) == 0
    out = capsys.readouterr().out
    assert "step-00000009" not in out and "step-00000007" in out


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 3 * MIB), st.integers(0, 2 * MIB)), max_size=12),
       st.sampled_from([5 * MIB, 6 * MIB + 3]))
def test_ranged_gets_cover_every_byte_once(layout: list[tuple[int, int]], part: int) -> None:
    """plan(): GETs of at most `part` bytes whose spans cover each buffer exactly,
    in object order; padding between buffers skipped, wide gaps not read."""
    segments, at = [], 0
    for gap, n in layout:
        at += gap
        segments.append((memoryview(bytearray(n)), at))
        at += n
    pieces = plan(segments, part)
    covered: dict[int, list[tuple[int, int]]] = {}
    for piece in pieces:
        assert 0 < piece.length <= part
        pos = piece.offset
        for i, start, n, where in piece.spans:
            assert where >= pos and where - pos <= GAP and n > 0
            assert where == segments[i][1] + start
            covered.setdefault(i, []).append((start, n))
            pos = where + n
        assert pos == piece.offset + piece.length
    for i, (buf, _) in enumerate(segments):
        spans, expect = sorted(covered.get(i, [])), 0
        for start, n in spans:
            assert start == expect
            expect += n
        assert expect == len(buf)


def test_a_compressed_checkpoint_round_trips_and_a_corrupt_frame_is_named(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Uploaded as it is (its .fpz files); loaded from the store by ranged GETs
    # of the stored frames, decoded in parallel, every CRC checked.
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(64 << 10))
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(1 << 20, generator=g).bfloat16(),  # 2 MiB: 32 frames
             "m": torch.randn(300, 100, generator=g), "small": torch.arange(10),
             "step": 3}
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, compression="zstd")
    ckpt.save(1, state)
    ckpt.close()
    url = f"{s3.url}/step-00000001"
    manifest = Manifest.from_json(_object(s3, url, "manifest.json"), url)
    record = next(t for t in manifest.tensors if t.name == "w")
    assert record.file.endswith(".fpz") and record.frames and len(record.frames) == 32
    seen: list[int] = []
    assert_same_state(state, fastpersist.load(url, progress=seen.append))
    assert sum(seen) == manifest.tensor_bytes
    assert fpctl(["verify", url]) == 0
    assert capsys.readouterr().out.startswith(f"OK {url}")
    # One stored byte of frame 5 flipped: the load names file, tensor and frame.
    data = bytearray(_object(s3, url, record.file))
    data[record.offset + record.frames[5].stored_offset + 7] ^= 0x40
    _put(s3, url, record.file, bytes(data))
    with pytest.raises(ChecksumMismatchError,
                       match=rf"tensor 'w' \(stored frame 5\) in {record.file}") as info:
        fastpersist.load(url)
    assert (info.value.file, info.value.tensor) == (record.file, "w")
    for extra in ([], ["--no-decode"]):
        assert fpctl(["verify", url, "--json", *extra]) == 1
        report = json.loads(capsys.readouterr().out)
        assert len(report["problems"]) == 1, report
        assert report["problems"][0].startswith(
            f"{record.file}: tensor 'w' (stored frame 5): CRC32C ")
