"""Single files (issue 36, item 1): torch.save files and one safetensors file
by name, file objects, and torch's callable map_location.

Every file here is real: written by torch.save or by safetensors' own
save_file, read back by torch.load and safetensors.torch.load_file, cut
short or corrupted on disk; the kill test SIGKILLs a real process mid-save.
"""

from __future__ import annotations

import collections
import io
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from crc32c import crc32c
from support import Mounter

import fastpersist
from fastpersist.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DiskFullError,
    PickleNotAllowedError,
    TruncatedFileError,
    UnknownFileFormatError,
    UnsupportedPathError,
    UnsupportedValueError,
)


class Opaque:  # a value only pickle can store
    def __init__(self, n: int) -> None:
        self.n = n


def trained_state() -> dict[str, Any]:
    """A model's and an Adam optimizer's state after a step, as a trainer saves it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
            "meta": collections.OrderedDict(name="run", betas=(0.9, 0.99), dtype=torch.bfloat16)}


def same(a: Any, b: Any) -> bool:
    """Equality through nested containers, tensors by value, dtype and shape;
    container types must match too (a tuple stays a tuple)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.device == b.device and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """same(), in any key order: a safetensors header keeps no order."""
    return same(dict(sorted(a.items())), dict(sorted(b.items())))


def flat() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"w": torch.randn(300, 70), "b": torch.arange(5, dtype=torch.int16),
            "h": torch.randn(33).to(torch.bfloat16), "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5, dtype=torch.float64)}


def header_of(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


# -- torch.save files --------------------------------------------------------------


@pytest.mark.parametrize("legacy,protocol", [(False, 2), (True, 2), (True, 5)],
                         ids=["zip", "legacy", "legacy-protocol-5"])
def test_load_reads_a_torch_save_file(tmp_path: Path, legacy: bool, protocol: int) -> None:
    state = trained_state()
    f = tmp_path / "model.pt"
    torch.save(state, f, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    if protocol > 2:  # torch's weights_only unpickler reads protocol 2 only
        with pytest.warns(UserWarning), pytest.raises(PickleNotAllowedError, match="opcode"):
            fastpersist.load(f)
        assert same(fastpersist.load(f, allow_pickle=True), state)
        return
    assert same(fastpersist.load(f), torch.load(f))
    assert same(fastpersist.load(f, map_location="cpu")["model"], state["model"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_not_called_corruption(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    torch.save(flat(), f)
    with pytest.raises(CheckpointError, match="map_location='cpu'") as info:
        fastpersist.load(f, map_location="cuda:0")
    assert not isinstance(info.value, CorruptCheckpointError) and str(f) in str(info.value)


def test_a_pickle_in_a_torch_file_needs_allow_pickle(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    torch.save({"w": torch.ones(2), "extra": Opaque(3)}, f)
    with pytest.raises(PickleNotAllowedError) as info:
        fastpersist.load(f)
    message = str(info.value)
    assert str(f) in message and "Opaque" in message and "allow_pickle=True" in message
    loaded = fastpersist.load(f, allow_pickle=True)
    assert loaded["extra"].n == 3 and torch.equal(loaded["w"], torch.ones(2))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_truncated_torch_file_is_named(tmp_path: Path, legacy: bool) -> None:
    f = tmp_path / "model.pt"
    torch.save(flat(), f, _use_new_zipfile_serialization=not legacy)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(TruncatedFileError, match="truncated") as info:
        fastpersist.load(f)
    assert str(f) in str(info.value)


def test_a_zip_that_is_not_a_torch_file(tmp_path: Path) -> None:
    import zipfile

    f = tmp_path / "model.pt"
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("notes.txt", "not a model")
    with pytest.raises(CorruptCheckpointError, match=r"torch\.load cannot read") as info:
        fastpersist.load(f)
    assert str(f) in str(info.value)


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors"])
def test_every_cut_of_a_file_is_an_error(tmp_path: Path, kind: str) -> None:
    """A file cut at any byte raises a CheckpointError (truncated, corrupt, or
    of no known kind), never another exception and never a load."""
    state = {"w": torch.randn(40, 10), "b": torch.arange(7)}
    full = tmp_path / ("full.safetensors" if kind == "safetensors" else "full.pt")
    if kind == "safetensors":
        fastpersist.save(state, full)
    else:
        torch.save({**state, "meta": {"x": (1, 2.5, "s")}}, full,
                   _use_new_zipfile_serialization=kind == "zip")
    raw = full.read_bytes()
    cut = tmp_path / ("cut" + full.suffix)
    for n in sorted({*range(0, 200), *range(200, len(raw), 7), len(raw) - 1}):
        cut.write_bytes(raw[:n])
        with pytest.raises((CorruptCheckpointError, UnknownFileFormatError)):
            fastpersist.load(cut)


@pytest.mark.parametrize("contents", [b"not a checkpoint, nor a model", b""])
def test_a_file_of_no_known_kind(tmp_path: Path, contents: bytes) -> None:
    f = tmp_path / "weights.pt"
    f.write_bytes(contents)
    with pytest.raises(UnknownFileFormatError, match=r"neither a torch\.save file, a safetensors "
                       "file nor a fastpersist checkpoint") as info:
        fastpersist.load(f)
    assert str(f) in str(info.value)
    assert isinstance(info.value, CheckpointNotFoundError)
    assert f.read_bytes() == contents


def test_save_to_a_pt_name_writes_a_torch_file(tmp_path: Path) -> None:
    state = trained_state()
    f = tmp_path / "sub" / "model.pt"  # a missing parent is made, as for directories
    fastpersist.save(state, f)
    assert f.is_file()
    assert same(torch.load(f, weights_only=True), state)  # torch reads it, pickle-free
    assert same(fastpersist.load(f), state)
    assert sorted(p.name for p in f.parent.iterdir()) == ["model.pt"]  # no leftovers
    fastpersist.save({"step": 8}, f)  # replaces the torch file it wrote
    assert fastpersist.load(f) == {"step": 8}


def test_save_to_a_pt_name_refuses_what_needs_pickle(tmp_path: Path) -> None:
    for value, what in [(Opaque(1), "Opaque"), (np.arange(3), "numpy")]:
        f = tmp_path / "model.pt"
        with pytest.raises(UnsupportedValueError, match=what) as info:
            fastpersist.save({"w": torch.ones(1), "x": value}, f)
        assert str(f) in str(info.value)
        assert list(tmp_path.iterdir()) == []
    fastpersist.save({"x": Opaque(5)}, tmp_path / "model.pt", allow_pickle=True)
    assert fastpersist.load(tmp_path / "model.pt", allow_pickle=True)["x"].n == 5


def test_save_to_a_file_name_never_replaces_something_else(tmp_path: Path) -> None:
    precious = tmp_path / "notes.bin"
    precious.write_bytes(b"precious")
    with pytest.raises(CheckpointExistsError, match=r"not a checkpoint or a torch\.save file"):
        fastpersist.save(flat(), precious)
    theirs = tmp_path / "model.safetensors"
    torch.save(flat(), theirs)  # a torch file under a safetensors name
    with pytest.raises(CheckpointExistsError, match="not a checkpoint or a safetensors file"):
        fastpersist.save(flat(), theirs)
    assert precious.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.bin"]


def test_an_existing_directory_stays_a_checkpoint_directory(tmp_path: Path) -> None:
    d = tmp_path / "old.pt"
    fastpersist.save(flat(), d)  # neither exists yet: a file
    assert d.is_file()
    d.unlink()
    d.mkdir()  # a directory by that name (a checkpoint an older version made)
    fastpersist.save(flat(), d)
    assert (d / "manifest.json").is_file()
    assert same(fastpersist.load(d), flat())


def test_async_save_refuses_a_file_name(tmp_path: Path) -> None:
    for target in (tmp_path / "m.pt", tmp_path / "m.safetensors", io.BytesIO()):
        with pytest.raises(UnsupportedPathError, match="use save"):
            fastpersist.async_save(flat(), target)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_single_files_take_no_directory_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="compression"):
        fastpersist.save(flat(), tmp_path / "m.safetensors", compression="zstd")
    fastpersist.save(flat(), tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match="into"):
        fastpersist.load(tmp_path / "m.safetensors", into=flat())
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


# -- one safetensors file --------------------------------------------------------


def test_save_writes_one_standard_safetensors_file(tmp_path: Path) -> None:
    state = flat()
    f = tmp_path / "model.safetensors"
    fastpersist.save(state, f)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert same_tensors(safetensors.torch.load_file(f), state)  # safetensors' own reader
    data_start, header = header_of(f)
    assert data_start % 4096 == 0  # the data section is aligned for direct I/O
    crcs = json.loads(header["__metadata__"]["fastpersist.crc32c"])
    raw = f.read_bytes()
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            assert crcs[name] == f"{crc32c(raw[data_start + begin:data_start + end]):08x}"
    assert sorted(crcs) == sorted(state)
    assert same_tensors(fastpersist.load(f), state)
    buffer = io.BytesIO(raw)  # the same bytes through a file object
    assert same_tensors(fastpersist.load(buffer), state)


def test_safetensors_file_bytes_are_the_same_from_either_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C engine (O_DIRECT where it can) and the buffered reference engine,
    its oracle, write the same file, byte for byte."""
    written = []
    for engine in ("native", "python"):
        monkeypatch.setenv("FASTPERSIST_ENGINE", engine)
        f = tmp_path / f"{engine}.safetensors"
        fastpersist.save(flat(), f)
        written.append(f.read_bytes())
    assert written[0] == written[1]


def test_safetensors_save_takes_tied_and_strided_tensors(tmp_path: Path) -> None:
    w = torch.randn(6, 4)
    state = {"w": w, "tied": w, "t": w.t(), "row": w[2]}
    fastpersist.save(state, tmp_path / "m.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "m.safetensors")
    ours = fastpersist.load(tmp_path / "m.safetensors")
    for loaded in (theirs, ours):
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("bad", ["nested", "value", "key", "list"])
def test_safetensors_holds_a_flat_dict_of_tensors(tmp_path: Path, bad: str) -> None:
    obj: Any = {"nested": {"a": {"w": torch.ones(1)}}, "value": {"w": torch.ones(1), "step": 3},
                "key": {1: torch.ones(1)}, "list": [torch.ones(1)]}[bad]
    f = tmp_path / "m.safetensors"
    with pytest.raises(UnsupportedValueError, match="safetensors") as info:
        fastpersist.save(obj, f)
    assert str(f) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_a_third_party_safetensors_file_loads(tmp_path: Path) -> None:
    state = flat()
    f = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(state, f, metadata={"format": "pt"})
    assert same_tensors(fastpersist.load(f), state)


def test_a_crc_mismatch_in_our_safetensors_file(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    fastpersist.save(flat(), f)
    data_start, header = header_of(f)
    begin, _ = header["w"]["data_offsets"]
    raw = bytearray(f.read_bytes())
    raw[data_start + begin + 100] ^= 0x10  # one bit of w, on disk
    f.write_bytes(raw)
    with pytest.raises(ChecksumMismatchError) as info:
        fastpersist.load(f)
    assert info.value.tensor == "w" and str(f) in str(info.value)
    with pytest.raises(ChecksumMismatchError):
        fastpersist.load(io.BytesIO(bytes(raw)))
    assert fastpersist.load(f, verify=False)["w"].shape == (300, 70)  # asked not to check


def test_fastpersist_crcs_copied_into_an_edited_file_are_explained(tmp_path: Path) -> None:
    # The common edit: read a file fastpersist wrote, change a tensor, write it
    # back with safetensors keeping the file's metadata (and so its CRC32Cs).
    fastpersist.save({"w": torch.zeros(4, 4), "b": torch.zeros(4)}, tmp_path / "m.safetensors")
    with safetensors.safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["w"] += 1
    edited = tmp_path / "edited.safetensors"
    safetensors.torch.save_file(tensors, str(edited), metadata=meta)
    for source in (edited, io.BytesIO(edited.read_bytes())):
        with pytest.raises(ChecksumMismatchError, match=r"'w'.*fastpersist CRC32Cs.*metadata "
                           r"was copied from another file.*verify=False"):
            fastpersist.load(source)
    assert torch.equal(fastpersist.load(edited, verify=False)["w"], tensors["w"])


def test_a_truncated_safetensors_file(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    fastpersist.save(flat(), f)
    raw = f.read_bytes()
    data_start, _ = header_of(f)
    for cut in (len(raw) - 1, data_start + 10, 100, 9):
        f.write_bytes(raw[:cut])
        with pytest.raises(TruncatedFileError, match="truncated") as info:
            fastpersist.load(f)
        assert str(f) in str(info.value)


def test_a_corrupt_safetensors_header(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    fastpersist.save(flat(), f)
    raw = bytearray(f.read_bytes())
    data_start, header = header_of(f)
    at = raw.index(b'"shape"')
    raw[at:at + 7] = b'"shap\xff"'  # not UTF-8
    f.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors file") as info:
        fastpersist.load(f)
    assert str(f) in str(info.value)
    # Valid JSON whose offsets leave a hole in the data: refused, not misread.
    header["w"]["data_offsets"][1] -= 4
    text = json.dumps(header).encode()
    text += b" " * (data_start - 8 - len(text))
    f.write_bytes(struct.pack("<Q", len(text)) + text + bytes(raw[data_start:]))
    with pytest.raises(CorruptCheckpointError, match="'w' lies at"):
        fastpersist.load(f)


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A 16 MiB filesystem: tmpfs (which refuses O_DIRECT: the buffered
    fallback) or ext4 on a loop device (O_DIRECT). Root only; skips without."""
    m = Mounter([])
    mnt = tmp_path / "mnt"
    if request.param == "tmpfs":
        m.tmpfs(mnt, "16m")
    else:
        m.ext4(mnt, tmp_path / "fs.img", 16)
    yield mnt
    m.unmount_all()


@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_disk_full_keeps_the_old_file(small_fs: Path, name: str) -> None:
    target = small_fs / name
    old = {"w": torch.arange(256 * 1024, dtype=torch.float32)}  # 1 MiB: fits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tmpfs: buffered, said once
        fastpersist.save(old, target)
        before = target.read_bytes()
        with pytest.raises(DiskFullError) as info:
            fastpersist.save({"w": torch.ones(6 << 20)}, target)  # 24 MiB: does not
    assert str(target) in str(info.value)
    assert target.read_bytes() == before
    assert sorted(p.name for p in small_fs.iterdir() if p.name != "lost+found") == [name]
    assert same(fastpersist.load(target), old)


# -- file objects ----------------------------------------------------------------


def test_file_objects_round_trip(tmp_path: Path) -> None:
    state = trained_state()
    buffer = io.BytesIO()
    fastpersist.save(state, buffer)
    buffer.seek(0)
    assert same(fastpersist.load(buffer), state)
    buffer.seek(0)
    assert same(torch.load(buffer, weights_only=True), state)  # torch's own format
    with open(tmp_path / "state.bin", "wb") as out:
        fastpersist.save(state, out)
    with open(tmp_path / "state.bin", "rb") as src:
        assert same(fastpersist.load(src), state)
    theirs = io.BytesIO()
    torch.save(state, theirs)
    theirs.seek(0)
    assert same(fastpersist.load(theirs), state)


def test_a_file_object_that_cannot_seek(tmp_path: Path) -> None:
    state = trained_state()
    buffer = io.BytesIO()
    fastpersist.save(state, buffer)
    r, w = os.pipe()
    with os.fdopen(w, "wb") as writer:
        writer.write(buffer.getvalue())
    with os.fdopen(r, "rb") as reader:
        assert same(fastpersist.load(reader), state)


def test_bad_file_objects(tmp_path: Path) -> None:
    with pytest.raises(UnknownFileFormatError, match=r"neither a torch\.save stream nor a "
                       "safetensors file"):
        fastpersist.load(io.BytesIO(b"hello, world" * 10))
    buffer = io.BytesIO()
    fastpersist.save({"w": torch.ones(1000)}, buffer)
    with pytest.raises(TruncatedFileError):
        fastpersist.load(io.BytesIO(buffer.getvalue()[:500]))
    with pytest.raises(UnsupportedValueError):
        fastpersist.save({"x": Opaque(1)}, io.BytesIO())
    pickled = io.BytesIO()
    torch.save({"x": Opaque(2)}, pickled)
    pickled.seek(0)
    with pytest.raises(PickleNotAllowedError, match="Opaque"):
        fastpersist.load(pickled)


def test_a_text_mode_file_object_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    fastpersist.save({"w": torch.ones(3)}, tmp_path / "ok.pt")
    with open(tmp_path / "t.pt", "w") as text:
        text.write("kept")
        text.flush()
        with pytest.raises(UnsupportedPathError, match=r"t\.pt.*text mode.*binary"):
            fastpersist.save({"w": torch.ones(3)}, text)
    assert (tmp_path / "t.pt").read_text() == "kept"  # nothing written into it
    with open(tmp_path / "ok.pt") as text, \
            pytest.raises(UnsupportedPathError, match=r"ok\.pt.*text mode.*binary"):
        fastpersist.load(text)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("m.pt", (tmp_path / "ok.pt").read_bytes())
    with zipfile.ZipFile(archive).open("m.pt") as member:  # binary, though its mode is "r"
        assert torch.equal(fastpersist.load(member)["w"], torch.ones(3))
    for stream in (io.StringIO(), io.StringIO("text")):
        with pytest.raises(UnsupportedPathError, match=r"StringIO.*text mode"):
            fastpersist.save({"w": torch.ones(3)}, stream)
        with pytest.raises(UnsupportedPathError, match=r"StringIO.*text mode"):
            fastpersist.load(stream)


# -- callable map_location ---------------------------------------------------------


def test_callable_map_location_on_every_kind(tmp_path: Path) -> None:
    state = flat()
    w = torch.randn(4, 4)
    tied = {"w": w, "tied": w, "row": w[1], "np": np.arange(3), "b": torch.ones(2)}
    fastpersist.save(tied, tmp_path / "ckpt")
    fastpersist.save(state, tmp_path / "m.safetensors")
    torch.save(state, tmp_path / "m.pt")
    for source, expected in [(tmp_path / "ckpt", tied), (tmp_path / "m.safetensors", state),
                             (tmp_path / "m.pt", state)]:
        calls: list[tuple[str, str]] = []

        def keep(storage: Any, location: str, calls: list[tuple[str, str]] = calls) -> Any:
            calls.append((type(storage).__name__, location))
            return storage

        loaded = fastpersist.load(source, map_location=keep)
        assert calls and set(calls) == {("UntypedStorage", "cpu")}, source
        for k, v in expected.items():
            got = loaded[k]
            assert np.array_equal(got, v) if isinstance(v, np.ndarray) else torch.equal(got, v)
        for device in ("meta", {"cpu": "meta"}):  # a device, a dict: as before, every kind
            assert fastpersist.load(source, map_location=device)["b"].device.type == "meta"
        # None: the saved device, as torch.load does.
        assert same(fastpersist.load(source, map_location=lambda s, loc: None)["b"],
                    expected["b"])
    for source in (tmp_path / "ckpt", tmp_path / "m.safetensors", tmp_path / "m.pt"):
        with pytest.raises(CheckpointError, match=r"map_location.*failed.*") as info:
            fastpersist.load(source, map_location=lambda s, loc: torch.ones(3))
        assert str(source) in str(info.value)
    loaded = fastpersist.load(tmp_path / "ckpt", map_location=lambda s, loc: s)
    assert loaded["tied"] is loaded["w"]  # ties survive, as with a device map_location
    assert loaded["row"].untyped_storage().data_ptr() == loaded["w"].untyped_storage().data_ptr()
    assert isinstance(loaded["np"], np.ndarray)  # numpy values never go through it
    with pytest.raises(CheckpointError, match=r"map_location\(storage, 'cpu'\) failed"):
        fastpersist.load(tmp_path / "ckpt", map_location=lambda s, loc: 3)


# -- a kill during a save ------------------------------------------------------------

_SAVER = textwrap.dedent("""
    import os, sys, time, torch, fastpersist
    torch.manual_seed(int(sys.argv[2]))
    state = {f"t{i}": torch.randn(16 << 20) for i in range(8)}  # 512 MiB
    # The save stops before its rename over the target and waits for the kill:
    # on a loaded machine the parent may see the temporary file only after the
    # whole write (it used to miss it, and the save finished unkilled).
    replace = os.replace
    def held(src, dst, *a, **k):
        if os.fspath(dst) == sys.argv[1]:
            while True:
                time.sleep(60)
        return replace(src, dst, *a, **k)
    os.replace = held
    print("ready", flush=True)
    fastpersist.save(state, sys.argv[1])
""")


def _kill_mid_save(target: Path, seed: int) -> None:
    """Start a save of 512 MiB to `target` and SIGKILL it once its temporary
    file exists: the write under way, or, seen late, done and held before the
    rename (_SAVER)."""
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(target), str(seed)],
                            stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(f".{target.name}.fp-tmp-")
                      for p in target.parent.iterdir()):
            assert proc.poll() is None, "the save finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.05)  # into the write
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["m.safetensors", "m.pt"])
def test_sigkill_during_a_single_file_save(big_tmp: Path, name: str) -> None:
    target = big_tmp / name
    _kill_mid_save(target, 1)  # no old file: none appears
    assert not target.exists()
    old = {"w": torch.arange(1000.0)}
    fastpersist.save(old, target)
    before = target.read_bytes()
    _kill_mid_save(target, 2)  # the old file stays whole
    assert target.read_bytes() == before
    assert [p for p in big_tmp.iterdir() if p.name.startswith(f".{name}.fp-tmp-")]  # mid-write
    assert same(fastpersist.load(target), old)
    visible = [p.name for p in big_tmp.iterdir() if not p.name.startswith(".")]
    assert visible == [name]
    subprocess.run([sys.executable, "-m", "fastpersist.cli", "gc", str(big_tmp)], check=True,
                   capture_output=True)
    assert [p.name for p in big_tmp.iterdir()] == [name]  # fpctl gc took the temporary
