"""Loads read through the engine's bounce buffers (FASTPERSIST_LOAD_BOUNCE):
the same tensors, every CRC32C still checked, and the choice made as the knob,
the memory's page size and the I/O backend say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import assert_same_state, flip_bit

import fastpersist
from fastpersist import anonmem
from fastpersist.tensors import checkpoint, datafile

MODES = [pytest.param("on", id="bounce"), pytest.param("off", id="in-place")]


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several blocks of the region
        "odd": torch.randn(1_000_003, generator=g).to(torch.bfloat16),  # ends mid-page
        "small": torch.arange(17, dtype=torch.int64),
        "empty": torch.empty(0),
        "nested": {"w": torch.randn(513, 257, generator=g), "step": 5},
    }


@pytest.mark.parametrize("mode", MODES)
def test_a_load_gives_back_the_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     mode: str) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_BOUNCE", mode)
    state = _state()
    fastpersist.save(state, tmp_path / "c")
    assert_same_state(fastpersist.load(tmp_path / "c"), state)


@pytest.mark.parametrize("mode", MODES)
def test_a_flipped_bit_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 mode: str) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_BOUNCE", mode)
    fastpersist.save(_state(), tmp_path / "c")
    rec = next(t for t in checkpoint.read_manifest(tmp_path / "c").tensors if t.name == "big")
    flip_bit(tmp_path / "c" / rec.file, rec.offset + (5 << 20) + 123)  # inside its 3rd block
    with pytest.raises(fastpersist.ChecksumMismatchError, match="big"):
        fastpersist.load(tmp_path / "c")


@pytest.mark.parametrize(("knob", "huge_pages", "backend", "bounces"), [
    ("on", "on", "uring", True), ("off", "off", "pool", False),
    ("auto", "off", "pool", True),  # 4 KiB pages, the pool: through the bounce buffers
    ("auto", "on", "pool", False),  # huge pages: straight in
    ("auto", "off", "uring", False),  # io_uring's threads would do every copy
    ("auto", "off", "auto", False),
])
def test_the_choice_follows_the_knob_the_page_size_and_the_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, knob: str, huge_pages: str,
        backend: str, bounces: bool) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_BOUNCE", knob)
    monkeypatch.setenv("FASTPERSIST_HUGE_PAGES", huge_pages)
    monkeypatch.setenv("FASTPERSIST_IO_BACKEND", backend)
    assert anonmem.loads_bounce() is bounces
    fastpersist.save({"t": torch.randn(1 << 20)}, tmp_path / "c")
    manifest = checkpoint.read_manifest(tmp_path / "c")
    f = manifest.files[0]
    pending = datafile.start_read(str(tmp_path / "c"), f, list(manifest.tensors), verify=True)
    assert pending.region is not None  # a whole file: one mapping either way
    assert pending.bounce is bounces


def test_a_bad_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_LOAD_BOUNCE", "sometimes")
    with pytest.raises(ValueError, match="FASTPERSIST_LOAD_BOUNCE"):
        anonmem.loads_bounce()
