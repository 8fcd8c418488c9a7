"""verify() reads every data file into reused scratch memory, never into tensors:
what it finds must not depend on what an earlier file left in that memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import flip_bit

import fastpersist
from fastpersist.engine import get_engine
from fastpersist.tensors import verifying
from fastpersist.tensors.checkpoint import FILES_IN_FLIGHT, read_manifest


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


def test_verify_reuses_a_few_scratch_buffers_and_makes_no_tensors(
        many_files: Path, monkeypatch: pytest.MonkeyPatch, engine_name: str) -> None:
    mapped: list[int] = []
    real = verifying.anonymous

    def counting(nbytes: int, *, huge: bool = False):  # type: ignore[no-untyped-def]
        mapped.append(nbytes)
        return real(nbytes, huge=huge)

    monkeypatch.setattr(verifying, "anonymous", counting)
    monkeypatch.setattr(torch, "frombuffer", None)  # a verify that made tensors would fail
    report = verifying.verify(many_files, get_engine())
    assert report.ok, report.problems
    manifest = read_manifest(many_files)
    assert report.tensors == len(manifest.tensors)
    assert report.bytes_checked == sum(t.length for t in manifest.tensors)
    # Each scratch grows at most once per file, and there are FILES_IN_FLIGHT of them.
    assert 0 < len(mapped) <= FILES_IN_FLIGHT * len(manifest.files)
    assert len(mapped) < len(manifest.files)  # reused, not one per file


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
