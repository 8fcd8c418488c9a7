"""The codec's C core (fastpersist._codec, csrc/codec/).

Its encoder writes zstd frames of Huffman-coded literals itself, so the
oracle is zstd's own decoder: every frame it writes must decompress with the
`zstandard` package to exactly its input, on any bytes (Hypothesis: alphabets
narrow and wide, low and high symbols, skewed and flat, runs, tiny planes).
Its byte planes must be numpy's, bit for bit, and frames written with and
without the extension must read back with either.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, note, settings
from hypothesis import strategies as st

from fastpersist.codec import frame, planes

_codec = pytest.importorskip("fastpersist._codec")

GROUPINGS = ["BF16", "F16", "F32", "F64", "C64", "I16", "I32", "I64", "U8", "F8_E4M3"]


def unzstd(stored: bytes, n: int) -> bytes:
    assert zstandard.frame_content_size(stored) == n
    return zstandard.ZstdDecompressor().decompress(stored)


@st.composite
def byte_planes(draw: st.DrawFn) -> bytes:
    """Bytes with the shapes byte planes take: a skewed alphabet of k symbols
    from `low` up (exponents), all 256 (mantissas), runs, pieces of each."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pieces = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.sampled_from([1, 7, 1023, 1024, 5000, 32768, 32769, 70000, 200000]))
        k = draw(st.integers(1, 256))
        low = draw(st.integers(0, 256 - k))
        how = draw(st.sampled_from(["skewed", "flat", "run"]))
        if how == "run":
            pieces.append(bytes([low]) * n)
            continue
        p = rng.dirichlet(np.full(k, 0.1 if how == "skewed" else 50.0))
        pieces.append((low + rng.choice(k, size=n, p=p)).astype(np.uint8).tobytes())
    return b"".join(pieces)


@settings(max_examples=150, deadline=None)
@given(data=byte_planes())
def test_literal_frames_decode_with_zstd_to_their_input(data: bytes) -> None:
    coded = _codec.zstd_literals(data)
    note(f"{len(data)} bytes -> {coded if isinstance(coded, int) else len(coded)}")
    if isinstance(coded, bytes):
        assert len(coded) < len(data)
        assert unzstd(coded, len(data)) == data
    else:
        # UNSUPPORTED is the encoder's way out for a table it cannot describe; no
        # byte plane reaches it, and the fallback to zstd's library is tested below.
        assert coded == _codec.NOT_SMALLER


def test_tables_of_every_kind_are_written() -> None:
    """Each block's table: direct weights (symbols up to 128), FSE-coded weights
    (the only form above 128), RLE blocks and raw blocks in one frame."""
    rng = np.random.default_rng(7)
    skewed = rng.geometric(0.3, size=40000).clip(1, 60).astype(np.uint8)
    cases = {
        "low symbols": skewed.tobytes(),
        "high symbols": (skewed + 190).astype(np.uint8).tobytes(),
        "both ends": np.where(rng.random(40000) < 0.5, skewed, 255 - skewed).astype(
            np.uint8).tobytes(),
        "run, noise, skewed": b"\x05" * 40000 + rng.bytes(40000) + skewed.tobytes(),
    }
    for name, data in cases.items():
        coded = _codec.zstd_literals(data)
        assert isinstance(coded, bytes), name
        assert unzstd(coded, len(data)) == data, name
    assert _codec.zstd_literals(rng.bytes(200000)) == _codec.NOT_SMALLER
    assert _codec.zstd_literals(b"") == _codec.NOT_SMALLER


def test_exponent_planes_code_smaller_than_zstd_level_1() -> None:
    """What the encoder is for: the exponent plane of trained-weight-like floats."""
    for dtype in (torch.bfloat16, torch.float32):
        t = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
        raw = t.view(torch.uint8).numpy().tobytes()
        g = planes.grouping_for("BF16" if dtype == torch.bfloat16 else "F32")
        exponents = planes.split(memoryview(raw), g)[-1].tobytes()
        coded = _codec.zstd_literals(exponents)
        assert isinstance(coded, bytes)
        level1 = zstandard.ZstdCompressor(level=1).compress(exponents)
        assert len(coded) < len(level1), f"{dtype}: {len(coded)} vs zstd -1 {len(level1)}"


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(GROUPINGS), units=st.integers(0, 5000), seed=st.integers(0, 99))
def test_split_and_merge_are_numpys(dtype: str, units: int, seed: int) -> None:
    g = planes.grouping_for(dtype)
    raw = np.random.default_rng(seed).bytes(units * g.unit)
    out = bytearray(len(raw))
    _codec.split(raw, g.unit, g.rotate, out)
    reference = planes.split(memoryview(raw), g)
    assert bytes(out) == reference.tobytes()
    back = bytearray(len(raw))
    _codec.merge([bytes(row) for row in reference], g.unit, g.rotate, back)
    assert bytes(back) == raw


def test_split_and_merge_refuse_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="2-byte units"):
        _codec.split(b"abc", 2, True, bytearray(3))
    with pytest.raises(ValueError, match="into 2 bytes"):
        _codec.split(b"abcd", 2, True, bytearray(2))
    with pytest.raises(ValueError, match="unit of 3 bytes"):
        _codec.split(b"abc", 3, False, bytearray(3))
    with pytest.raises(ValueError, match="plane 1 holds 1 bytes"):
        _codec.merge([b"ab", b"a"], 2, False, bytearray(4))
    with pytest.raises(ValueError, match="1 planes"):
        _codec.merge([b"ab"], 2, False, bytearray(4))


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F64", "I32", "U8"])
def test_frames_with_and_without_the_extension_read_back_with_either(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = planes.grouping_for(dtype)
    rng = np.random.default_rng(3)
    values = (rng.normal(size=300000) * 0.02).astype(np.float64).tobytes()
    raw = memoryview(values[: (len(values) // 8) * 8][: 200000 * g.unit])
    with_c = frame.encode(raw, g)
    monkeypatch.setattr(frame, "_codec", None)
    without_c = frame.encode(raw, g)
    for stored in (with_c, without_c):  # read without the extension
        out = bytearray(len(raw))
        frame.decode(memoryview(stored), g, memoryview(out))
        assert bytes(out) == bytes(raw)
    monkeypatch.undo()
    for stored in (with_c, without_c):  # and with it
        out = bytearray(len(raw))
        frame.decode(memoryview(stored), g, memoryview(out))
        assert bytes(out) == bytes(raw)


def test_a_plane_the_encoder_declines_goes_to_zstds_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = planes.grouping_for("F32")
    raw = (np.random.default_rng(1).normal(size=100000) * 0.02).astype(np.float32).tobytes()
    monkeypatch.setattr(frame, "_codec", _Declining())
    stored = frame.encode(memoryview(raw), g)
    monkeypatch.undo()
    assert len(stored) < len(raw)
    out = bytearray(len(raw))
    frame.decode(memoryview(stored), g, memoryview(out))
    assert bytes(out) == raw


class _Declining:
    """The extension, except that its encoder answers UNSUPPORTED."""

    NOT_SMALLER = _codec.NOT_SMALLER
    UNSUPPORTED = _codec.UNSUPPORTED
    split = staticmethod(_codec.split)
    merge = staticmethod(_codec.merge)

    @staticmethod
    def zstd_literals(plane: object) -> int:
        return int(_codec.UNSUPPORTED)
