"""Bad input gets a clear, specific error, and loses nothing.

Full disks (a small tmpfs, and a loop-mounted ext4 where the C engine uses
O_DIRECT), read-only filesystems, missing and foreign targets, corrupted
checkpoints, and values that would need pickle. Where the engine does the
I/O, each test runs against both engines (FASTPERSIST_ENGINE is read at each
call). Mounting needs root and the mount tools; those tests skip without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support import Mounter, flip_bit

import fastpersist
from fastpersist import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DiskFullError,
    ManifestError,
    PickleNotAllowedError,
    TruncatedFileError,
    UnsupportedValueError,
)
from fastpersist.engine import get_engine
from fastpersist.storage.commit import find_leftovers
from fastpersist.tensors import checkpoint, verifying

DATA = "data-00000.safetensors"
MANIFEST = "manifest.json"
MIB = 1 << 20


@pytest.fixture(params=["native", "python"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        pytest.importorskip("fastpersist._engine", reason="the C engine is not built")
    monkeypatch.setenv("FASTPERSIST_ENGINE", request.param)
    return request.param


def versioned(version: int, mib: int) -> dict[str, Any]:
    """A state of about `mib` MiB whose every value says which version it is."""
    return {
        "version": version,
        "weights": [torch.full((MIB // 4,), float(version) + i) for i in range(max(1, mib))],
    }


def assert_version(path: Path, version: int, mib: int) -> None:
    loaded = fastpersist.load(path)
    expected = versioned(version, mib)
    assert loaded["version"] == version
    assert len(loaded["weights"]) == len(expected["weights"])
    for a, b in zip(loaded["weights"], expected["weights"], strict=True):
        assert torch.equal(a, b)


def listing(d: Path) -> dict[str, bytes | None]:
    """Every path under d, with the contents of files."""
    return {
        str(p.relative_to(d)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
        for p in sorted(d.rglob("*"))
    }


# --- mounts -------------------------------------------------------------------------------


@pytest.fixture
def mounter() -> Any:
    m = Mounter([])
    yield m
    m.unmount_all()


def free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bfree * st.f_frsize


def assert_space_returns(d: Path, before: int) -> None:
    """Free space is back to `before`: the failed save leaked no file."""
    deadline = time.monotonic() + 10
    while True:
        os.sync()
        now = free_bytes(d)
        if now >= before or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now >= before, f"{(before - now) // 1024} KiB not given back after the failed save"


def fill(d: Path) -> Path:
    """Write a file until the filesystem is full."""
    filler = d / "filler"
    chunk = bytes(MIB)
    with open(filler, "wb", buffering=0) as f:
        for size in (MIB, 4096, 512, 1):
            try:
                while True:
                    f.write(chunk[:size])
            except OSError as exc:
                assert exc.errno == 28, exc
    return filler


# --- ENOSPC --------------------------------------------------------------------------------

# (filesystem, its size, MiB of the checkpoint that fits, MiB of the one that does not)
FILESYSTEMS = {"tmpfs": (8, 1, 12), "ext4": (48, 4, 64)}


@pytest.fixture(params=sorted(FILESYSTEMS))
def small_fs(request: pytest.FixtureRequest, mounter: Mounter, tmp_path: Path
             ) -> tuple[str, Path, int, int]:
    kind = request.param
    size, fits, too_big = FILESYSTEMS[kind]
    mnt = tmp_path / "mnt"
    if kind == "tmpfs":
        mounter.tmpfs(mnt, f"{size}m")
    else:
        mounter.ext4(mnt, tmp_path / "fs.img", size)
    return kind, mnt, fits, too_big


def test_ext4_mount_uses_direct_io(mounter: Mounter, tmp_path: Path) -> None:
    """The ENOSPC tests on ext4 exercise the C engine's O_DIRECT path."""
    pytest.importorskip("fastpersist._engine", reason="the C engine is not built")
    mnt = mounter.ext4(tmp_path / "mnt", tmp_path / "fs.img", FILESYSTEMS["ext4"][0])
    result = get_engine("native").write_file(str(mnt / "probe"), [(bytes(8192), 0)], 8192)
    assert result.direct


def test_disk_full_on_replace_keeps_the_old_checkpoint(
    engine: str, small_fs: tuple[str, Path, int, int]
) -> None:
    _, mnt, fits, too_big = small_fs
    ckpts = mnt / "ckpts"
    target = ckpts / "ck"
    fastpersist.save(versioned(1, fits), target)
    before = free_bytes(mnt)
    with pytest.raises(DiskFullError) as info:
        fastpersist.save(versioned(2, too_big), target)
    assert "no space" in str(info.value).lower()
    assert str(target) in str(info.value)
    assert isinstance(info.value, OSError) and info.value.errno in (28, 122)
    assert_version(target, 1, fits)
    assert sorted(p.name for p in ckpts.iterdir()) == ["ck"]  # no staging leftovers
    assert_space_returns(mnt, before)
    # The disk is usable again: a save that fits still works.
    fastpersist.save(versioned(3, fits), target)
    assert_version(target, 3, fits)


def test_disk_full_on_a_new_path_leaves_nothing(
    engine: str, small_fs: tuple[str, Path, int, int]
) -> None:
    _, mnt, fits, too_big = small_fs
    ckpts = mnt / "ckpts"
    fastpersist.save(versioned(1, fits), ckpts / "ck")
    before = free_bytes(mnt)
    with pytest.raises(DiskFullError, match=r"(?i)no space"):
        fastpersist.save(versioned(2, too_big), ckpts / "new")
    assert sorted(p.name for p in ckpts.iterdir()) == ["ck"]
    assert_space_returns(mnt, before)
    assert_version(ckpts / "ck", 1, fits)


def test_completely_full_disk(engine: str, small_fs: tuple[str, Path, int, int]) -> None:
    """With not a byte free, even a tiny save fails cleanly, and loads still work."""
    _, mnt, fits, _ = small_fs
    ckpts = mnt / "ckpts"
    fastpersist.save(versioned(1, fits), ckpts / "ck")
    filler = fill(mnt)
    try:
        for name in ("ck", "new"):
            with pytest.raises(DiskFullError, match=r"(?i)no space"):
                fastpersist.save({"w": torch.ones(1024), "n": 1}, ckpts / name)
            assert sorted(p.name for p in ckpts.iterdir()) == ["ck"]
        assert_version(ckpts / "ck", 1, fits)
    finally:
        filler.unlink()


def test_disk_full_leaves_no_created_parents(
    engine: str, small_fs: tuple[str, Path, int, int]
) -> None:
    """save() creates missing parents; a failed save must not leave them behind."""
    _, mnt, _, too_big = small_fs
    with pytest.raises(DiskFullError):
        fastpersist.save(versioned(1, too_big), mnt / "runs" / "a" / "ck")
    assert not (mnt / "runs").exists()


# --- read-only filesystems -----------------------------------------------------------------


@pytest.fixture(params=["tmpfs-remount-ro", "ro-bind-mount"])
def readonly_ckpts(request: pytest.FixtureRequest, mounter: Mounter, tmp_path: Path) -> Path:
    """A read-only directory (holding checkpoint `ck`, version 1) that stops root too."""
    if request.param == "tmpfs-remount-ro":
        mnt = mounter.tmpfs(tmp_path / "mnt", "16m")
        fastpersist.save(versioned(1, 1), mnt / "ck")
        mounter.remount_ro(mnt)
        return mnt
    src = tmp_path / "src"
    fastpersist.save(versioned(1, 1), src / "ck")
    return mounter.bind_ro(src, tmp_path / "ro")


def test_read_only_filesystem(engine: str, readonly_ckpts: Path) -> None:
    ckpts = readonly_ckpts
    before = listing(ckpts)
    for target in (ckpts / "ck", ckpts / "new", ckpts / "a" / "b" / "ck"):
        with pytest.raises(CheckpointPermissionError) as info:
            fastpersist.save(versioned(2, 1), target)
        assert isinstance(info.value, PermissionError)
        assert "read-only" in str(info.value).lower()
        assert str(ckpts) in str(info.value)
    assert listing(ckpts) == before
    # Reading needs no write access.
    assert_version(ckpts / "ck", 1, 1)
    report = verifying.verify(ckpts / "ck", get_engine())
    assert report.ok, report.problems


# --- missing and foreign paths -------------------------------------------------------------


def test_load_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        fastpersist.load(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nope") in str(info.value)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.read_manifest(tmp_path / "nope")


def test_load_a_file(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        fastpersist.load(f)
    assert f.read_bytes() == b"not a checkpoint"


@pytest.mark.parametrize("contents", ["empty", "other-files"])
def test_load_directory_without_manifest(tmp_path: Path, contents: str) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    if contents == "other-files":
        (d / DATA).write_bytes(b"\0" * 4096)
    with pytest.raises(CheckpointNotFoundError, match=MANIFEST):
        fastpersist.load(d)
    with pytest.raises(CheckpointNotFoundError, match=MANIFEST):
        checkpoint.read_manifest(d)


def _foreign_directory(d: Path) -> Path:
    target = d / "results"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("precious")
    (target / "sub" / "model.pt").write_bytes(os.urandom(1000))
    return target


def _foreign_file(d: Path) -> Path:
    target = d / "model.pt"
    target.write_bytes(b"precious")
    return target


NOT_A_CHECKPOINT = r"exists and is not a (fastpersist )?checkpoint"
FOREIGN = {"directory-without-manifest": _foreign_directory, "regular-file": _foreign_file}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_save_over_something_else_leaves_it_untouched(engine: str, tmp_path: Path, kind: str
                                                      ) -> None:
    target = FOREIGN[kind](tmp_path)
    before = listing(tmp_path)
    with pytest.raises(CheckpointError) as info:
        fastpersist.save(versioned(1, 1), target)
    assert str(target) in str(info.value)
    assert re.search(NOT_A_CHECKPOINT, str(info.value)), str(info.value)
    assert listing(tmp_path) == before  # untouched, and no staging leftover
    assert find_leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_save_over_something_else_raises_exists_error(tmp_path: Path, kind: str) -> None:
    target = FOREIGN[kind](tmp_path)
    with pytest.raises(CheckpointExistsError, match=NOT_A_CHECKPOINT):
        fastpersist.save(versioned(1, 1), target)


# --- corruption ----------------------------------------------------------------------------

STATE = {
    "model": {
        "a": torch.arange(4096, dtype=torch.float32),
        "b": torch.arange(1000, dtype=torch.int64) * 3,
    },
    "step": 7,
}


@pytest.fixture
def ckpt(engine: str, tmp_path: Path) -> Path:
    p = tmp_path / "ck"
    fastpersist.save(STATE, p)
    return p


def record(p: Path, name: str) -> Any:
    (rec,) = [t for t in checkpoint.read_manifest(p).tensors if t.name == name]
    return rec


@pytest.mark.parametrize("how", ["by-one-byte", "by-half"])
def test_truncated_data_file(ckpt: Path, how: str) -> None:
    size = (ckpt / DATA).stat().st_size
    os.truncate(ckpt / DATA, size - 1 if how == "by-one-byte" else size // 2)
    with pytest.raises(TruncatedFileError, match="truncated") as info:
        fastpersist.load(ckpt)
    assert DATA in str(info.value)
    with pytest.raises(TruncatedFileError):
        fastpersist.load(ckpt, verify=False)


def test_missing_data_file(ckpt: Path) -> None:
    (ckpt / DATA).unlink()
    with pytest.raises(CorruptCheckpointError, match=f"{DATA} is missing"):
        fastpersist.load(ckpt)


def test_extra_byte_appended(ckpt: Path) -> None:
    with open(ckpt / DATA, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCheckpointError, match="the manifest says") as info:
        fastpersist.load(ckpt)
    assert not isinstance(info.value, TruncatedFileError)
    assert DATA in str(info.value)


@pytest.mark.parametrize(("name", "bit"), [("model.a", 0), ("model.b", 7)])
def test_flipped_bit_in_a_tensor(ckpt: Path, name: str, bit: int) -> None:
    rec = record(ckpt, name)
    flip_bit(ckpt / DATA, rec.offset + rec.length // 2 + 1, bit)
    with pytest.raises(ChecksumMismatchError) as info:
        fastpersist.load(ckpt)
    assert info.value.file == DATA
    assert info.value.tensor == name
    assert DATA in str(info.value) and repr(name) in str(info.value)
    # Without verification the load succeeds, and the damage is exactly one element.
    key = name.split(".")[1]
    loaded = fastpersist.load(ckpt, verify=False)
    assert int((loaded["model"][key] != STATE["model"][key]).sum()) == 1
    # fpctl verify's code path names it too.
    report = verifying.verify(ckpt, get_engine())
    assert not report.ok and any(repr(name) in p for p in report.problems)


@pytest.mark.parametrize("where", ["json", "padding"])
def test_flipped_bit_in_the_header(ckpt: Path, where: str) -> None:
    f = checkpoint.read_manifest(ckpt).files[0]
    offset = 12 if where == "json" else f.data_start - 1
    flip_bit(ckpt / DATA, offset, 1)
    with pytest.raises(ChecksumMismatchError, match="safetensors header") as info:
        fastpersist.load(ckpt)
    assert info.value.file == DATA
    assert info.value.tensor == "<header>"
    # The tensors themselves are intact.
    loaded = fastpersist.load(ckpt, verify=False)
    assert torch.equal(loaded["model"]["a"], STATE["model"]["a"])


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc[key] = value

    return edit


def _offset_beyond(doc: dict[str, Any]) -> None:
    doc["tensors"][0]["offset"] = doc["files"][0]["size"] + 4096


def _escaping_name(doc: dict[str, Any]) -> None:
    doc["files"][0]["name"] = "../" + DATA
    for t in doc["tensors"]:
        t["file"] = "../" + DATA


MANIFEST_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None] | bytes, str]] = {
    "not-json": (b'{"format": "fastpersist-checkpoint", ', "not valid JSON"),
    "not-utf8": (b"\xff\xfe\x00garbage", "not valid JSON"),
    "not-an-object": (b"[1, 2, 3]", "top level is not an object"),
    "wrong-format": (_set("format", "torch-zip"), "'format' is 'torch-zip'"),
    "newer-schema": (_set("schema_version", 99), "schema version 99 is newer"),
    "offset-beyond-file": (_offset_beyond, "outside the data section"),
    "escaping-file-name": (_escaping_name, r"bad or duplicate file name '\.\./"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_bad_manifest(ckpt: Path, case: str) -> None:
    edit, message = MANIFEST_EDITS[case]
    path = ckpt / MANIFEST
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    else:
        doc = json.loads(path.read_bytes())
        edit(doc)
        path.write_text(json.dumps(doc))
    # A decoy beside the checkpoint: an escaping name must not make it read this.
    shutil.copy(ckpt / DATA, ckpt.parent / DATA)
    with pytest.raises(ManifestError, match=message) as info:
        fastpersist.load(ckpt)
    assert str(ckpt) in str(info.value)
    with pytest.raises(ManifestError, match=message):
        checkpoint.read_manifest(ckpt)


# --- values that need pickle ---------------------------------------------------------------


class Custom:
    pass


@dataclass
class Point:
    x: int
    y: int


class Trap:
    """Unpickling this creates a directory: proof that the pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


UNSUPPORTED: dict[str, tuple[Callable[[], Any], str]] = {
    "custom-object": (lambda: {"model": {"extra": {"obj": Custom()}}}, "model.extra.obj"),
    "lambda": (lambda: {"opt": {"fn": lambda x: x}}, "opt.fn"),
    "complex128": (lambda: {"w": {"z": torch.zeros(3, dtype=torch.complex128)}}, "w.z"),
    "set-in-list": (lambda: {"cfg": [1, 2, {"tags": {"a"}}]}, "cfg.2.tags"),
    # No data to copy: torch's own copy would fail mid-save with NotImplementedError.
    "meta-tensor": (lambda: {"model": {"w": torch.empty(3, 4, device="meta")}}, "model.w"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_value(tmp_path: Path, case: str) -> None:
    make, key_path = UNSUPPORTED[case]
    state = {"ok": torch.ones(4), **make()}
    target = tmp_path / "runs" / "ck"
    with pytest.raises(UnsupportedValueError) as info:
        fastpersist.save(state, target)
    assert isinstance(info.value, TypeError)
    assert str(info.value).startswith(f"{key_path}:"), str(info.value)
    assert "allow_pickle=True" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # not even the parent directory


def test_a_meta_tensor_is_pickled_with_allow_pickle_as_torch_save_does(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match=r"^model\.w: a tensor on the meta device"):
        fastpersist.save({"model": {"w": torch.empty(3, 4, device="meta")}}, tmp_path / "a")
    state = {"model": {"w": torch.empty(3, 4, device="meta"), "b": torch.ones(2)}}
    fastpersist.save(state, tmp_path / "ck", allow_pickle=True)
    loaded = fastpersist.load(tmp_path / "ck", allow_pickle=True)
    w = loaded["model"]["w"]
    assert w.is_meta and w.shape == (3, 4) and w.dtype == torch.float32
    assert torch.equal(loaded["model"]["b"], torch.ones(2))


def test_unsupported_value_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    fastpersist.save(versioned(1, 1), target)
    before = listing(tmp_path)
    with pytest.raises(UnsupportedValueError):
        fastpersist.save({"a": Custom()}, target)
    assert listing(tmp_path) == before


def test_pickle_needs_opt_in_on_load(engine: str, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    target = tmp_path / "ck"
    state = {"w": torch.arange(10.0), "cfg": Point(1, 2), "trap": Trap(marker)}
    fastpersist.save(state, target, allow_pickle=True)
    assert not marker.exists()

    for verify in (True, False):
        with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
            fastpersist.load(target, verify=verify)
        assert not marker.exists(), "load() ran the pickle without allow_pickle=True"

    loaded = fastpersist.load(target, allow_pickle=True)
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["cfg"] == Point(1, 2)
    assert marker.is_dir()  # the trap was real: allow_pickle=True does run it


def test_errors_are_checkpoint_errors() -> None:
    for cls in (CheckpointNotFoundError, CheckpointExistsError, CheckpointPermissionError,
                DiskFullError, CorruptCheckpointError, ManifestError, ChecksumMismatchError,
                TruncatedFileError, UnsupportedValueError, PickleNotAllowedError):
        assert issubclass(cls, CheckpointError)
