"""The one read path: every load goes through loading.load_from over a Source
(tensors/source.py), whatever holds the bytes; a local directory and the
object store (a real moto server) are read, checked and placed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support import assert_loaded_into, assert_same_state, zeros_like_state

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.errors import ChecksumMismatchError, PickleNotAllowedError
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.loading.load import load_from, source_for
from fastpersist.tensors import source, tier_read
from fastpersist.tensors.source import LocalSource
from fastpersist.tensors.tier_read import TierSource

MIB = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g),
            "nested": {"half": torch.randn(33, 7, generator=g).half()}, "step": 5}


@pytest.fixture
def uploaded(s3: Any, tmp_path: Path) -> tuple[str, Path, dict[str, Any]]:
    """The same checkpoint on local disk and in the store: (URL, path, state)."""
    state = _state()
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, tier_compression="none")
    ckpt.save(5, state)
    ckpt.close()  # waits for the upload
    return f"{s3.url}/step-00000005", tmp_path / "run" / "step-00000005", state


def test_the_source_is_chosen_in_one_place(tmp_path: Path) -> None:
    local = source_for(tmp_path / "c")
    assert isinstance(local, LocalSource) and local.where == str(tmp_path / "c")
    remote = source_for("s3://bucket/run/step-1", endpoint_url="http://127.0.0.1:1")
    assert isinstance(remote, TierSource) and remote.where == "s3://bucket/run/step-1"


def test_both_sources_give_the_same_state_and_the_same_placement(
        uploaded: tuple[str, Path, dict[str, Any]]) -> None:
    url, path, state = uploaded
    for where in (path, url):
        loaded = load_from(source_for(where))
        assert_same_state(loaded, state)
        into = zeros_like_state(state)
        assert_loaded_into(state, load_from(source_for(where), into=into), into)


def test_the_store_fills_into_tensors_in_place(
        uploaded: tuple[str, Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """load("s3://...", into=) fetches raw tensors straight into the caller's
    memory (it used to fetch into new tensors and copy)."""
    url, _, state = uploaded
    seen: list[dict[int, torch.Tensor]] = []
    original = tier_read.read_tensors

    def spy(*args: Any, into: Any = None, **kwargs: Any) -> Any:
        seen.append(dict(into or {}))
        return original(*args, into=into, **kwargs)

    monkeypatch.setattr(tier_read, "read_tensors", spy)
    into = zeros_like_state(state)
    loaded = fastpersist.load(url, into=into)
    assert loaded["w"] is into["w"] and torch.equal(into["w"], state["w"])
    filled = {t.data_ptr() for t in seen[0].values()}
    assert into["w"].data_ptr() in filled and into["b"].data_ptr() in filled


def test_a_corrupt_tensor_is_named_from_either_source(
        uploaded: tuple[str, Path, dict[str, Any]], s3: Any) -> None:
    url, path, _ = uploaded
    manifest = LocalSource(path).manifest()
    record = next(r for r in manifest.tensors if r.name == "w")
    data = bytearray((path / record.file).read_bytes())
    data[record.offset + 100] ^= 0xFF
    (path / record.file).write_bytes(data)
    key = url.removeprefix(f"s3://{s3.bucket}/") + "/" + record.file
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    for where in (path, url):
        with pytest.raises(ChecksumMismatchError, match=record.name):
            load_from(source_for(where))


def test_pickle_is_refused_before_a_byte_of_tensors_from_either_source(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, allow_pickle=True)
    ckpt.save(1, {"w": torch.ones(4), "obj": {1, 2}})
    ckpt.close()
    reads: list[str] = []
    monkeypatch.setattr(LocalSource, "read_tensors",
                        lambda *a, **k: reads.append("local"))  # type: ignore[misc]
    monkeypatch.setattr(TierSource, "read_tensors",
                        lambda *a, **k: reads.append("tier"))  # type: ignore[misc]
    for where in (tmp_path / "run" / "step-00000001", f"{s3.url}/step-00000001"):
        with pytest.raises(PickleNotAllowedError):
            fastpersist.load(where)
    assert reads == []


def test_fpctl_restore_reads_the_manifest_once(
        uploaded: tuple[str, Path, dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """It read it twice (once for the progress bar's total, once to load)."""
    url, path, state = uploaded
    reads: list[str] = []
    local, remote = source.read_manifest, tier_read.read_manifest
    monkeypatch.setattr(source, "read_manifest",
                        lambda p: reads.append(str(p)) or local(p))
    monkeypatch.setattr(tier_read, "read_manifest",
                        lambda s3, u: reads.append(str(u)) or remote(s3, u))
    assert fpctl(["restore", str(path), "--to", str(tmp_path / "a.pt")]) == 0
    assert fpctl(["restore", url, "--to", str(tmp_path / "b.pt")]) == 0
    assert reads == [str(path), url]
    for name in ("a.pt", "b.pt"):
        assert torch.equal(torch.load(tmp_path / name)["w"], state["w"])


def test_a_sources_ranges_are_checked_by_their_crcs(
        uploaded: tuple[str, Path, dict[str, Any]]) -> None:
    """read_ranges (what the DCP reader reads items through) gives each
    segment's CRC32C, the same from disk and from the store."""
    url, path, _ = uploaded
    local, remote = source_for(path), source_for(url)
    manifest = local.manifest()
    records = manifest.tensors[:2]
    f = next(f for f in manifest.files if f.name == records[0].file)
    crcs = []
    for s in (local, remote):
        s.check_file(f)
        buffers = [bytearray(r.length) for r in records if r.file == f.name]
        got = s.read_ranges(f, [(memoryview(b), r.offset) for b, r in
                                zip(buffers, records, strict=False)], checksum=True)
        crcs.append(got)
    assert crcs[0] == crcs[1] == [r.crc32c for r in records if r.file == f.name]


def test_manifest_is_read_once_per_source(tmp_path: Path) -> None:
    fastpersist.save(_state(), tmp_path / "c")
    s = LocalSource(tmp_path / "c")
    assert s.manifest() is s.manifest()
    (tmp_path / "c" / MANIFEST_NAME).write_text(json.dumps({"broken": True}))
    assert s.manifest().tensors  # the first read is kept


def test_fpctl_verify_reads_the_manifest_once(
        uploaded: tuple[str, Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It read it twice (once for the progress bar's total, once to verify)."""
    from fastpersist.cli import inspecting, remote
    from fastpersist.tensors import verifying

    url, path, _ = uploaded
    reads: list[str] = []
    local, fetched = verifying.read_manifest, tier_read.read_manifest
    for module in (inspecting, verifying):
        monkeypatch.setattr(module, "read_manifest",
                            lambda p: reads.append(str(p)) or local(p))
    for module in (remote, tier_read):
        monkeypatch.setattr(module, "read_manifest",
                            lambda s3, u: reads.append(str(u)) or fetched(s3, u))
    assert fpctl(["verify", str(path)]) == 0
    assert fpctl(["verify", url]) == 0
    assert capsys.readouterr().out.count("OK ") == 2
    assert reads == [str(path), url]
