"""verify() checksums every data file through the engine's reused bounce
buffers (unkept segments), never into tensors: what it finds must not depend
on what an earlier file left in those buffers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import flip_bit

import fastpersist
from fastpersist import anonmem
from fastpersist.engine import get_engine
from fastpersist.tensors import verifying
from fastpersist.tensors.checkpoint import read_manifest


@pytest.fixture
def many_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Six data files of different sizes, with an empty and an odd-sized tensor."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(1 << 20))
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn((i + 1) * 70_000, generator=g) for i in range(6)}
    state["empty"] = torch.empty(0)
    state["odd"] = torch.randn(333, generator=g).to(torch.bfloat16)
    fastpersist.save(state, tmp_path / "c")
    assert len(read_manifest(tmp_path / "c").files) >= 6
    return tmp_path / "c"


def test_verify_keeps_no_bytes_and_makes_no_tensors(
        many_files: Path, monkeypatch: pytest.MonkeyPatch, engine_name: str) -> None:
    """Every byte is checked through the engine's unkept segments: verify maps
    no memory for what it reads and makes no tensor."""
    engine = get_engine()
    segments: list[tuple[object, ...]] = []
    real = engine.read_file

    def spy(path: str, segs, **kw):  # type: ignore[no-untyped-def]
        segments.extend(segs)
        return real(path, segs, **kw)

    monkeypatch.setattr(engine, "read_file", spy)
    monkeypatch.setattr(anonmem.mmap, "mmap", None)  # a verify that mapped memory would fail
    monkeypatch.setattr(torch, "frombuffer", None)  # a verify that made tensors would fail
    report = verifying.verify(many_files, engine)
    assert report.ok, report.problems
    manifest = read_manifest(many_files)
    assert report.tensors == len(manifest.tensors)
    assert report.bytes_checked == sum(t.length for t in manifest.tensors)
    assert segments and all(s[0] is None for s in segments)
    checked = sum(s[2] for s in segments)  # type: ignore[misc]
    assert checked == report.bytes_checked + sum(f.data_start for f in manifest.files)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_flipped_byte_in_any_file_is_found_after_the_scratch_held_good_bytes(
        many_files: Path, which: str, engine_name: str) -> None:
    manifest = read_manifest(many_files)
    big = [t for t in manifest.tensors if t.name.startswith("w")]
    victim = big[0] if which == "first" else big[-1]
    flip_bit(many_files / victim.file, victim.offset + victim.length - 1)
    report = verifying.verify(many_files, get_engine())
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"{victim.file}: tensor '{victim.name}': CRC32C")


def test_a_flipped_header_byte_is_found(many_files: Path, engine_name: str) -> None:
    f = read_manifest(many_files).files[-1]
    flip_bit(many_files / f.name, 20)  # inside the header's JSON
    report = verifying.verify(many_files, get_engine())
    assert any(p.startswith(f"{f.name}: ") and "header" in p for p in report.problems), \
        report.problems
