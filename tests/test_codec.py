"""compression="zstd": byte-grouped zstd frames (issue 13, part 1).

Round trips on every dtype and shape (Hypothesis), bit for bit; partial reads
decode only the frames they need; a corrupt frame is named; the codec never
fails on hostile bytes with anything but CodecError; every way to save
(save, async_save, Checkpointer) compresses, and the daemon and distributed
saves refuse it clearly; packed data files are not mistaken for safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from hostile_support import MANIFEST, distributed_checkpoint, read_doc, same
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import fastpersist
from fastpersist import ChecksumMismatchError, CorruptCheckpointError, checksum
from fastpersist.cli import main
from fastpersist.codec import frame, frames, packing, planes
from fastpersist.distributed import restore
from fastpersist.engine import get_engine
from fastpersist.format import dtypes, packed_file
from fastpersist.tensors import checkpoint, verifying
from fastpersist.tensors.source import LocalSource

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
SMALL_FRAMES = "4096"  # FASTPERSIST_FRAME_BYTES for tests: many frames in small tensors


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor compressed (none left raw for being small), in 4 KiB frames."""
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", SMALL_FRAMES)
    monkeypatch.setattr(packing, "MIN_ENCODED_BYTES", 1)


def values(dtype: torch.dtype, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """A tensor of `kind`: "smooth" (trained-weight-like floats: planes that
    compress), "bits" (random bytes: NaN payloads, frames stored as they are),
    "const" (compresses to almost nothing)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if kind == "const":
        return torch.full(shape, 3, dtype=dtype)
    if kind == "bits" or not (dtype.is_floating_point or dtype.is_complex):
        if kind == "smooth":  # integers: small values, high bytes alike
            return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape,
                                 generator=g).to(dtype)
        raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),),
                            generator=g, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)
    real = torch.float32 if dtype == torch.complex64 else dtype
    t = (torch.randn(shape if dtype != torch.complex64 else (*shape, 2), generator=g,
                     dtype=torch.float64) * 0.02).to(real)
    return torch.view_as_complex(t) if dtype == torch.complex64 else t


shapes = st.one_of(
    st.just(()), st.just((0,)), st.just((3, 0)),
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),  # tiny
    st.tuples(st.integers(1, 3000)),  # up to several frames of 4 KiB
    st.tuples(st.integers(1, 40), st.integers(1, 200)),
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # set once for all
@given(dtype=st.sampled_from(DTYPES), shape=shapes,
       kind=st.sampled_from(["smooth", "bits", "const"]), seed=st.integers(0, 2**31))
def test_every_dtype_and_shape_round_trips_bit_for_bit(
        dtype: torch.dtype, shape: tuple[int, ...], kind: str, seed: int,
        tmp_path_factory: pytest.TempPathFactory, small_frames: None) -> None:
    t = values(dtype, shape, kind, seed)
    ckpt = tmp_path_factory.mktemp("rt") / "c"
    fastpersist.save({"t": t, "view": t.reshape(-1)[1:] if t.numel() > 1 else t}, ckpt,
                     compression="zstd")
    back = fastpersist.load(ckpt)
    assert same(back["t"], t)
    record = checkpoint.read_manifest(ckpt).tensors[0]
    note(f"{record.encoding} {record.stored_length} / {record.length}")
    assert record.encoding == ("zstd-bytegroup-v1" if t.numel() else record.encoding)
    assert verifying.verify(ckpt, get_engine()).ok


@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 20000),
       kind=st.sampled_from(["smooth", "bits", "const"]), seed=st.integers(0, 2**31))
def test_frames_round_trip_in_the_codec_alone(dtype: torch.dtype, n: int, kind: str,
                                              seed: int) -> None:
    t = values(dtype, (n,), kind, seed)
    raw = t.view(torch.uint8).numpy().tobytes() if n else b""
    name = dtypes.to_name(dtype)
    assert name is not None
    (enc,) = frames.encode_tensors([(memoryview(raw), name)], 4096)
    out = bytearray(len(raw))
    jobs = [frames.DecodeJob(memoryview(p), name, memoryview(out)[f.raw_offset:][:f.raw_length],
                             f.crc32c) for f, p in zip(enc.frames, enc.parts, strict=True)]
    results = frames.decode_frames(jobs, raw_crc=True)
    assert bytes(out) == raw
    assert all(r.bad_stored_crc32c is None and r.error is None for r in results)
    assert checksum.combine([(r.raw_crc32c or 0, f.raw_length)
                           for r, f in zip(results, enc.frames, strict=True)]) == enc.crc32c
    assert all(f.stored_length <= f.raw_length + 1 for f in enc.frames)


def test_planes_group_the_exponent_bytes() -> None:
    """bf16 3.0 is 0x4040: rotated left by one bit, its high byte is the exponent 0x80."""
    raw = torch.tensor([3.0, -3.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    p = planes.split(memoryview(raw), planes.grouping_for("BF16"))
    assert p[1].tolist() == [0x80, 0x80]  # the exponent plane: the sign is not in it
    assert p[0].tolist() == [0x80, 0x81]  # mantissa (7 bits) and the sign, lowest
    out = bytearray(len(raw))
    planes.merge(p, planes.grouping_for("BF16"), memoryview(out))
    assert bytes(out) == raw


@given(data=st.data())
def test_hostile_stored_bytes_fail_with_codec_error_only(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(["BF16", "F32", "F64", "I64", "U8", "C64"]))
    g = planes.grouping_for(dtype)
    n = data.draw(st.integers(1, 3000)) * dtypes.itemsize(dtype)
    raw = (np.random.default_rng(data.draw(st.integers(0, 99))).normal(size=n // 2) * 0.01
           ).astype(np.float16).tobytes()[:n].ljust(n, b"\0")
    stored = bytearray(frame.encode(memoryview(raw), g))
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "grow", "byte0"]))
        if how == "flip" and stored:
            i = data.draw(st.integers(0, len(stored) - 1))
            stored[i] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del stored[data.draw(st.integers(0, len(stored))):]
        elif how == "grow":
            stored += data.draw(st.binary(max_size=20))
        elif stored:
            stored[0] = data.draw(st.integers(0, 255))
    out = bytearray(n)
    try:
        frame.decode(memoryview(bytes(stored)), g, memoryview(out))
    except frame.CodecError:
        return


# --- partial reads ----------------------------------------------------------------------


def counting_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count frame.decode calls (by raw length)."""
    calls: list[int] = []
    real = frame.decode

    def spy(stored: memoryview, g: planes.Grouping, out: memoryview) -> None:
        calls.append(len(out))
        real(stored, g, out)

    monkeypatch.setattr(frame, "decode", spy)
    return calls


def test_a_partial_read_decodes_only_the_frames_it_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_frames: None) -> None:
    """Resharding's read (distributed/restore.py, `like=`): a chunk of 32 rows of
    1 KiB is 8 frames of 4 rows; rows 8..11 are one frame, rows 6..13 three."""
    full = values(torch.float32, (64, 256), "smooth", 1)
    ckpt = tmp_path / "c"
    distributed_checkpoint(ckpt, {"w": (full, [((0, 0), (32, 256)), ((32, 0), (32, 256))])},
                           compression="zstd")
    manifest = checkpoint.read_manifest(ckpt)
    assert [len(t.frames or ()) for t in manifest.tensors] == [8, 8]
    calls = counting_decodes(monkeypatch)
    got = restore.read_boxes(LocalSource(ckpt), manifest,
                             {0: ((8, 0), (4, 256))}, verify=True)
    assert torch.equal(got[0], full[8:12]) and len(calls) == 1
    calls.clear()
    got = restore.read_boxes(LocalSource(ckpt), manifest,
                             {0: ((30, 0), (4, 100))}, verify=True)
    assert torch.equal(got[0], full[30:34, :100]) and len(calls) == 2  # one frame per chunk
    calls.clear()
    assert same(fastpersist.load(ckpt)["w"], full) and len(calls) == 16


def test_a_partial_read_checks_the_frames_it_reads(
        tmp_path: Path, small_frames: None) -> None:
    full = values(torch.float32, (64, 256), "smooth", 2)
    ckpt = tmp_path / "c"
    distributed_checkpoint(ckpt, {"w": (full, [((0, 0), (64, 256))])}, compression="zstd")
    manifest = checkpoint.read_manifest(ckpt)
    record = manifest.tensors[0]
    assert record.frames is not None
    corrupt(ckpt, record.file, record.offset + record.frames[3].stored_offset + 20)
    # Rows 0..3 are frame 0: intact, and read without complaint.
    assert torch.equal(restore.read_boxes(LocalSource(ckpt), manifest,
                                          {0: ((0, 0), (4, 256))}, verify=True)[0], full[:4])
    with pytest.raises(ChecksumMismatchError, match=r"tensor 'w@0,0' \(stored frame 3\)"):
        restore.read_boxes(LocalSource(ckpt), manifest,
                             {0: ((12, 0), (4, 256))}, verify=True)


# --- corruption -------------------------------------------------------------------------


def corrupt(ckpt: Path, file: str, offset: int) -> None:
    with open(ckpt / file, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


@pytest.fixture
def compressed(tmp_path: Path, small_frames: None) -> tuple[Path, dict[str, Any]]:
    state = {"w": values(torch.bfloat16, (64, 100), "smooth", 3),
             "m": values(torch.float32, (3000,), "smooth", 4), "step": 5}
    fastpersist.save(state, tmp_path / "c", compression="zstd")
    return tmp_path / "c", state


def test_a_corrupt_stored_frame_is_named(compressed: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = compressed
    record = checkpoint.read_manifest(ckpt).tensors[1]
    assert record.name == "m" and record.frames is not None and len(record.frames) == 3
    corrupt(ckpt, record.file, record.offset + record.frames[1].stored_offset + 5)
    with pytest.raises(ChecksumMismatchError) as info:
        fastpersist.load(ckpt)
    assert (info.value.file, info.value.tensor) == (record.file, "m")
    assert "stored frame 1" in str(info.value) and str(ckpt) in str(info.value)
    # Unverified, the frame is still decoded; what it decodes to is not checked,
    # but nothing but a CheckpointError can come out.
    try:
        fastpersist.load(ckpt, verify=False)
    except CorruptCheckpointError as exc:
        assert "'m'" in str(exc)
    for args in (["verify", str(ckpt)], ["verify", "--no-decode", str(ckpt)]):
        report = json.loads(_run([*args, "--json"], 1))
        assert any("tensor 'm' (stored frame 1)" in p for p in report["problems"])


def test_a_wrong_raw_checksum_is_found_by_decoding(
        compressed: tuple[Path, dict[str, Any]]) -> None:
    """The record's CRC32C is of the raw bytes: a load (and verify) decodes and checks it;
    verify --no-decode checks the stored frames only."""
    ckpt, _ = compressed
    doc = read_doc(ckpt)
    doc["tensors"][0]["crc32c"] ^= 1
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ChecksumMismatchError, match=r"tensor 'w' in data-00000\.fpz"):
        fastpersist.load(ckpt)
    assert fastpersist.load(ckpt, verify=False)["step"] == 5
    assert "tensor 'w': CRC32C" in _run(["verify", str(ckpt)], 1)
    assert "OK" in _run(["verify", "--no-decode", str(ckpt)], 0)


def test_a_damaged_frame_header_is_corruption_when_unverified(
        compressed: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = compressed
    record = checkpoint.read_manifest(ckpt).tensors[0]
    assert record.frames is not None
    with open(ckpt / record.file, "r+b") as fh:  # frame kind 7 does not exist
        fh.seek(record.offset + record.frames[0].stored_offset)
        fh.write(b"\x07")
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*frame 0 cannot be decoded"):
        fastpersist.load(ckpt, verify=False)


# --- every way to save ------------------------------------------------------------------


def model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return {"model": {k: v.bfloat16() for k, v in model.state_dict().items()},
            "master": model.state_dict(), "optim": opt.state_dict(), "step": 1}


def test_save_and_load(tmp_path: Path) -> None:
    state = model_state()
    fastpersist.save(state, tmp_path / "c", compression="zstd")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["data-00000.fpz",
                                                                   "manifest.json"]
    assert same(fastpersist.load(tmp_path / "c"), state)
    manifest = checkpoint.read_manifest(tmp_path / "c")
    assert {t.encoding for t in manifest.tensors} == {"raw", "zstd-bytegroup-v1"}
    assert manifest.total_bytes < manifest.tensor_bytes


def test_async_save_and_checkpointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = model_state()
    fastpersist.async_save(state, tmp_path / "a", compression="zstd").result()
    assert same(fastpersist.load(tmp_path / "a"), state)
    # Staging smaller than the state: several files, each compressed by the writer.
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(128 << 10))
    with fastpersist.Checkpointer(tmp_path / "ck", keep_last=1, compression="zstd") as ck:
        for step in (1, 2):
            ck.save(step, {**state, "step": step})
    with fastpersist.Checkpointer(tmp_path / "ck") as ck:
        assert same(ck.load_latest(), {**state, "step": 2})
        latest = ck.latest()
    assert latest is not None and latest.name == "step-00000002"
    names = sorted(p.name for p in latest.iterdir())
    assert len(names) > 2 and all(n.endswith(".fpz") for n in names if n != "manifest.json")


def test_raw_stays_the_default(tmp_path: Path) -> None:
    fastpersist.save({"w": torch.ones(5000)}, tmp_path / "c")
    assert (tmp_path / "c" / "data-00000.safetensors").is_file()
    assert "frames" not in read_doc(tmp_path / "c")["tensors"][0]


def test_an_unknown_compression_is_refused_before_anything_is_done(tmp_path: Path) -> None:
    for where in ({}, {"daemon": "unix:///nowhere"}, {"process_group": "world"}):
        with pytest.raises(ValueError, match="None or 'zstd'"):
            fastpersist.save({}, tmp_path / "c", compression="gzip", **where)
        with pytest.raises(ValueError, match="None or 'zstd'"):
            fastpersist.async_save({}, tmp_path / "c", compression="gzip", **where)
    with pytest.raises(ValueError, match="None or 'zstd'"):
        fastpersist.Checkpointer(tmp_path, compression="lz4", daemon="unix:///nowhere")
    assert not (tmp_path / "c").exists()


# --- tools ------------------------------------------------------------------------------


def _run(args: list[str], status: int, capsys: pytest.CaptureFixture[str] | None = None
         ) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == status
    return out.getvalue()


def test_safetensors_refuses_a_packed_file_and_restore_writes_a_plain_one(
        compressed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ckpt, state = compressed
    data = ckpt / "data-00000.fpz"
    assert data.read_bytes().startswith(packed_file.MAGIC)
    with pytest.raises(Exception, match=r"(?i)header.*too large"):
        safetensors.safe_open(str(data), framework="pt")
    _run(["restore", str(ckpt), "--to", str(tmp_path / "out.safetensors"),
          "--format", "safetensors"], 0)
    plain = safetensors.torch.load_file(str(tmp_path / "out.safetensors"))
    assert same(plain["w"], state["w"]) and same(plain["m"], state["m"])


def test_inspect_shows_encoding_and_ratio(compressed: tuple[Path, dict[str, Any]]) -> None:
    ckpt, _ = compressed
    info = json.loads(_run(["inspect", "--json", str(ckpt)], 0))
    w = next(t for t in info["tensors"] if t["name"] == "w")
    assert w["encoding"] == "zstd-bytegroup-v1" and w["frames"] == 4
    assert 0 < w["stored_bytes"] < w["bytes"] and w["ratio"] == pytest.approx(
        w["stored_bytes"] / w["bytes"], abs=1e-3)
    assert 0 < info["totals"]["ratio"] < 1
    text = _run(["inspect", str(ckpt)], 0)
    assert "zstd-bytegroup-v1" in text and "compressed" in text


@pytest.fixture(scope="module")
def packed_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("FASTPERSIST_FRAME_BYTES", SMALL_FRAMES)
    try:
        state = {"w": values(torch.float32, (40, 100), "smooth", 5),
                 "h": values(torch.bfloat16, (3000,), "smooth", 6)}
        p = tmp_path_factory.mktemp("packed-base") / "c"
        fastpersist.save(state, p, compression="zstd")
    finally:
        mp.undo()
    return p, state


@settings(max_examples=60)
@given(data=st.data())
def test_mutated_frame_indexes_load_exactly_or_are_refused(
        packed_base: tuple[Path, dict[str, Any]], data: st.DataObject,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    import shutil

    base, state = packed_base
    ckpt = tmp_path_factory.mktemp("mut") / "c"
    shutil.copytree(base, ckpt)
    doc = read_doc(ckpt)
    for _ in range(data.draw(st.integers(1, 3))):
        t = doc["tensors"][data.draw(st.integers(0, len(doc["tensors"]) - 1))]
        frames_ = t["frames"]
        where = data.draw(st.sampled_from(["frame", "stored_length", "offset", "drop", "dup"]))
        if not frames_ and where in ("frame", "drop", "dup"):
            continue  # every frame dropped already
        if where == "frame":
            f = frames_[data.draw(st.integers(0, len(frames_) - 1))]
            k = data.draw(st.integers(0, 4))
            # An earlier mutation may have left a non-integer here already.
            near = [f[k] + 1, f[k] - 1] if isinstance(f[k], int) else []
            f[k] = data.draw(st.sampled_from([0, -1, *near, 1 << 62, 2**32,
                                              "x", None, frames_[0][k]]))
        elif where in ("stored_length", "offset"):
            t[where] = data.draw(st.sampled_from([0, t[where] + 1, t[where] - 1, 1 << 40]))
        elif where == "drop":
            frames_.pop(data.draw(st.integers(0, len(frames_) - 1)))
        else:
            frames_.append(list(frames_[-1]))
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    try:
        back = fastpersist.load(ckpt)
    except fastpersist.CheckpointError:
        return
    assert same(back, state)
