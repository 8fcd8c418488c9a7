"""Every byte an upload sends is checked against the manifest's CRC32Cs (issue
33 item 3): a checkpoint corrupted on the local disk is never uploaded,
never reported uploaded, never lets the store's keep_last delete the older
good copies, and is named loudly (log, status, metric: file and tensor),
whether it goes compressed on the way, as it is (tier_compression="none"),
or was saved compressed. Against a real S3 server (moto) and a real daemon."""

from __future__ import annotations

import itertools
import logging
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon
from tier_support import free_port, keys

import fastpersist
from fastpersist.errors import TierError
from fastpersist.format.manifest import Manifest, TensorRecord
from fastpersist.storage import dirs
from fastpersist.tier.client import S3
from fastpersist.tier.upload import upload_checkpoint
from fastpersist.tier.url import TierURL

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(256 << 10))


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(3 * MIB, generator=g),  # 12 MiB: three parts
            "ints": torch.arange(100) + step, "step": step}


def _record(ckpt: Path, name: str) -> TensorRecord:
    manifest = Manifest.from_json((ckpt / "manifest.json").read_bytes(), str(ckpt))
    return next(t for t in manifest.tensors if t.name == name)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def _corrupt_big(ckpt: Path) -> str:
    """Flip a byte of tensor "big" in its third part (11 MiB in, or in a
    stored frame of it); returns its file's name."""
    r = _record(ckpt, "big")
    if r.frames is None:
        at = r.offset + 11 * MIB
    else:
        frame = r.frames[len(r.frames) * 9 // 10]
        at = r.offset + frame.stored_offset + frame.stored_length // 2
    _flip(ckpt / r.file, at)
    return r.file


def _manifests(s3: Any) -> list[str]:
    return sorted(k.removesuffix("/manifest.json") for k in keys(s3.client, s3.bucket)
                  if k.endswith("/manifest.json"))


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize(("saved", "sent"), [(None, "none"), ("zstd", "zstd"),
                                             ("zstd", "none"), (None, "zstd")])
def test_a_corrupt_checkpoint_is_never_uploaded_nor_replaces_good_ones(
        s3: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, saved: str | None,
        sent: str) -> None:
    """Before: with tier_compression="none", or a checkpoint saved compressed,
    the corrupt step 2 was uploaded, reported tier-uploaded, and the store's
    keep_last=1 then deleted the good step 1."""
    root = tmp_path / "run"
    for step in (1, 2):
        fastpersist.save(_state(step), root / f"step-{step:08d}", compression=saved)
    bad_file = _corrupt_big(root / "step-00000002")
    caplog.set_level(logging.INFO, "fastpersist.tier")
    # Queues both at start, newest first: step 2 goes first.
    ckpt = fastpersist.Checkpointer(root, keep_last=1, tier=s3.url, tier_keep_last=1,
                                    tier_compression=sent)
    assert ckpt.wait_for_tier(60)
    assert _manifests(s3) == ["ckpts/step-00000001"]
    assert torch.equal(fastpersist.load(f"{s3.url}/step-00000001")["big"], _state(1)["big"])
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    status = ckpt.tier_status()
    assert status is not None and status.uploaded == 1 and status.pending == ()
    (corrupt,) = status.corrupt
    assert corrupt.startswith(f"{root / 'step-00000002'}: ")
    assert "tensor 'big'" in corrupt and bad_file in corrupt
    (line,) = [r for r in caplog.records if "tier-upload-corrupt" in r.getMessage()]
    assert line.levelno == logging.ERROR
    assert f"file={bad_file}" in line.getMessage() and "tensor=big" in line.getMessage()
    assert not any("tier-uploaded path=" + str(root / "step-00000002") in r.getMessage()
                   for r in caplog.records)
    # The corrupt copy is kept (never confirmed uploaded); step 1, uploaded, may go.
    ckpt.save(3, _state(3)).result()
    assert ckpt.wait_for_tier(60)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert _manifests(s3) == ["ckpts/step-00000003"]
    with pytest.raises(TierError, match="step-00000002"):
        ckpt.close()


def _upload(path: Path, url: TierURL) -> Any:
    fd = os.open(path, dirs.DIR_FLAGS)
    try:
        return upload_checkpoint(S3(), fd, str(path), url, None)
    finally:
        os.close(fd)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_byte_of_a_data_file_is_under_a_crc(tmp_path: Path, compression: str | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The spans the upload checks tile each data file that saves write: no
    byte goes up unchecked."""
    from fastpersist.tier.checked import spans

    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(4 * MIB))  # several files
    state = {**_state(1), "half": torch.randn(333).half(), "flags": torch.ones(3).bool(),
             "empty": torch.zeros(0)}
    fastpersist.save(state, tmp_path / "c", compression=compression)
    manifest = Manifest.from_json((tmp_path / "c/manifest.json").read_bytes(), "c")
    assert len(manifest.files) > 1
    for f in manifest.files:
        covered = [(s.start, s.end) for s in spans(f, [t for t in manifest.tensors
                                                        if t.file == f.name]) if s.end > s.start]
        assert covered[0][0] == 0 and covered[-1][1] == f.size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_bytes_under_no_crc_go_as_zeros(tmp_path: Path) -> None:
    """A layout with gaps (none of ours has one; a future writer might): the
    gaps are sent as zeros, never as whatever the disk holds there."""
    from fastpersist.checksum import crc32c
    from fastpersist.format.manifest import FileRecord
    from fastpersist.tier.checked import CheckedFile, LocalCorruption

    body = bytes(range(256)) * 2  # 512 bytes: header [0, 100), a tensor [200, 300)
    path = tmp_path / "data"
    path.write_bytes(body)
    f = FileRecord("data", len(body), 100, crc32c(body[:100]))
    t = TensorRecord("t", "data", 200, 100, "U8", (100,), crc32c(body[200:300]))
    fd = os.open(path, os.O_RDONLY)
    try:
        checked = CheckedFile(fd, f, [t], "ckpt")
        sent = b"".join(bytes(checked.read(at, min(64, len(body) - at)))
                        for at in range(0, len(body), 64))
        assert sent == body[:100] + bytes(100) + body[200:300] + bytes(212)
        wrong = TensorRecord("t", "data", 200, 100, "U8", (100,), crc32c(body[201:301]))
        checked = CheckedFile(fd, f, [wrong], "ckpt")
        with pytest.raises(LocalCorruption, match="tensor 't' in data is corrupt") as info:
            for at in range(0, len(body), 64):
                checked.read(at, min(64, len(body) - at))
        assert (info.value.file, info.value.tensor) == ("data", "t")
    finally:
        os.close(fd)


def test_a_bad_header_is_named(s3: Any, tmp_path: Path) -> None:
    from fastpersist.tier.checked import LocalCorruption

    ckpt = tmp_path / "step-00000002"
    fastpersist.save(_state(1), ckpt)
    _flip(ckpt / "data-00000.safetensors", 20)  # inside the safetensors header
    fd = os.open(ckpt, dirs.DIR_FLAGS)
    try:
        with pytest.raises(LocalCorruption, match=r"the header of data-00000\.safetensors is "
                           "corrupt on the local disk") as info:
            upload_checkpoint(S3(), fd, str(ckpt), TierURL.parse(s3.url).child(ckpt.name),
                              None)
    finally:
        os.close(fd)
    assert (info.value.file, info.value.tensor) == ("data-00000.safetensors", "<header>")
    assert keys(s3.client, s3.bucket) == {}


def test_the_daemon_names_a_corrupt_checkpoint_in_its_log_and_metrics(
        s3: Any, tmp_path: Path) -> None:
    root = tmp_path / "root"
    for step in (1, 2):
        fastpersist.save(_state(step), root / "run" / f"step-{step:08d}")
    bad_file = _corrupt_big(root / "run" / "step-00000002")
    port = free_port()
    d = Daemon(tmp_path, "--tier", s3.url, "--tier-compression", "none", "--tier-keep-last",
               "1", "--metrics-listen", f"127.0.0.1:{port}", root=root).start()
    try:
        (line,) = _until("the corrupt one reported", lambda: d.events("tier-upload-corrupt"))
        assert line["level"] == "error" and line["path"] == "run/step-00000002"
        assert (line["file"], line["tensor"]) == (bad_file, "big")
        _until("step 1 uploaded", lambda: d.events("tier-uploaded"))  # logged after the put
        assert _manifests(s3) == ["ckpts/run/step-00000001"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert 'fastpersist_tier_uploads_total{result="corrupt"} 1.0' in metrics
        assert 'fastpersist_tier_uploads_total{result="uploaded"} 1.0' in metrics
        assert d.events("tier-uploaded")[0]["path"] == "run/step-00000001"
        assert len(d.events("tier-uploaded")) == 1
    finally:
        d.cleanup()
