"""Compression on the way to the store (tier/compress.py, tier_compression="zstd",
the default): a raw checkpoint becomes exactly what a local save with
compression="zstd" writes, streamed in parts with bounded memory; a checkpoint
compressed locally is sent as it is; a local file that does not match its
CRC32Cs is never uploaded. Against a real S3 server (moto, a subprocess)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_support import keys

import fastpersist
from fastpersist.errors import TierError
from fastpersist.format.manifest import Manifest
from fastpersist.storage import dirs
from fastpersist.tensors.checkpoint import read_manifest as read_local_manifest
from fastpersist.tier.checked import LocalCorruption
from fastpersist.tier.client import S3
from fastpersist.tier.remote import read_manifest
from fastpersist.tier.upload import Uploaded, upload_checkpoint
from fastpersist.tier.url import TierURL

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(4 * MIB))  # several data files
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(256 << 10))


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(4 * MIB, generator=g),  # 16 MiB, ~14 MiB stored: 3 parts
            "bf16": torch.randn(MIB, generator=g).bfloat16(), "zeros": torch.zeros(5000),
            "ints": torch.arange(100), "empty": torch.zeros(0), "step": 4}


def _upload(client: S3, path: Path, url: TierURL, compression: str | None) -> Uploaded:
    fd = os.open(path, dirs.DIR_FLAGS)
    try:
        return upload_checkpoint(client, fd, str(path), url, compression)
    finally:
        os.close(fd)


def _objects(s3: Any, prefix: str) -> dict[str, bytes]:
    return {k.rsplit("/", 1)[1]: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read()
            for k in keys(s3.client, s3.bucket, prefix)}


def test_a_raw_checkpoint_is_uploaded_as_a_compressed_save_would_write_it(
        s3: Any, tmp_path: Path) -> None:
    state = _state()
    fastpersist.save(state, tmp_path / "raw")
    fastpersist.save(state, tmp_path / "zstd", compression="zstd")
    client, url = S3(), TierURL.parse(s3.url).child("step-1")
    done = _upload(client, tmp_path / "raw", url, "zstd")
    stored = _objects(s3, "ckpts/step-1/")
    local = {p.name: p.read_bytes() for p in (tmp_path / "zstd").iterdir()}
    assert stored.keys() == local.keys() and len(local) > 2
    for name, data in local.items():
        if name != "manifest.json":
            assert stored[name] == data, name  # byte for byte
    remote = Manifest.from_json(stored["manifest.json"], "remote")
    mine = Manifest.from_json(local["manifest.json"], "local")
    assert (remote.files, remote.tensors, remote.tree) == (mine.files, mine.tensors, mine.tree)
    assert done.bytes == sum(len(v) for k, v in stored.items() if k != "manifest.json")
    assert done.bytes < done.source_bytes
    head = s3.client.head_object(Bucket=s3.bucket, Key="ckpts/step-1/data-00000.fpz")
    assert head["Metadata"] == {"fastpersist-codec": "zstd-bytegroup-v1"}
    big = next(f for f in remote.files if any(t.name == "big" and t.file == f.name
                                              for t in remote.tensors))
    etag = s3.client.head_object(Bucket=s3.bucket, Key=f"ckpts/step-1/{big.name}")["ETag"]
    assert etag.strip('"').endswith("-3")  # part 1 (header first, sent last), parts 2, 3
    loaded = fastpersist.load(str(url))
    assert loaded["step"] == 4 and all(torch.equal(loaded[k], state[k]) for k in state
                                       if k != "step")
    # Again: the remote manifest records which local one it was made from.
    again = _upload(client, tmp_path / "raw", url, "zstd")
    assert again.already and again.bytes == 0


def test_a_locally_compressed_checkpoint_goes_as_it_is(s3: Any, tmp_path: Path) -> None:
    fastpersist.save(_state(), tmp_path / "zstd", compression="zstd")
    _upload(S3(), tmp_path / "zstd", TierURL.parse(s3.url).child("s"), "zstd")
    assert _objects(s3, "ckpts/s/") == {p.name: p.read_bytes()
                                       for p in (tmp_path / "zstd").iterdir()}


def test_a_corrupt_local_file_is_not_uploaded(s3: Any, tmp_path: Path) -> None:
    fastpersist.save(_state(), tmp_path / "raw")
    manifest = Manifest.from_json((tmp_path / "raw/manifest.json").read_bytes(), "x")
    for name in ("bf16", "ints"):  # a compressed tensor, and one stored raw
        rec = next(t for t in manifest.tensors if t.name == name)
        with open(tmp_path / "raw" / rec.file, "r+b") as f:
            f.seek(rec.offset + 3)
            byte = f.read(1)
            f.seek(rec.offset + 3)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(LocalCorruption, match=rf"tensor '{name}' in {rec.file} is "
                           "corrupt on the local disk"):
            _upload(S3(), tmp_path / "raw", TierURL.parse(s3.url).child("c"), "zstd")
        with open(tmp_path / "raw" / rec.file, "r+b") as f:
            f.seek(rec.offset + 3)
            f.write(byte)
    assert not any(k.endswith("manifest.json") for k in keys(s3.client, s3.bucket))
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_a_failed_part_leaves_no_manifest_and_no_multipart_upload(
        s3: Any, tmp_path: Path) -> None:
    fastpersist.save(_state(), tmp_path / "raw")
    client = S3()

    def fail(params: Any, **_: Any) -> None:
        if params["PartNumber"] == 2:
            raise ConnectionError("injected: the network went away")

    client.client.meta.events.register("before-parameter-build.s3.UploadPart", fail)
    url = TierURL.parse(s3.url).child("f")
    with pytest.raises(TierError, match="part 2"):
        _upload(client, tmp_path / "raw", url, "zstd")
    assert not any(k.endswith("manifest.json") for k in keys(s3.client, s3.bucket))
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    done = _upload(S3(), tmp_path / "raw", url, "zstd")  # the next attempt
    assert not done.already and read_manifest(S3(), url)[0].files[0].name.endswith(".fpz")


@pytest.mark.parametrize(("compression", "kept", "resent"),
                         [("zstd", [2], [1, 3]),  # part 1, with the header, goes last
                          ("none", [1, 2], [3, 4])])
def test_an_upload_cut_short_by_a_kill_resumes_without_sending_its_parts_again(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str,
        kept: list[int], resent: list[int]) -> None:
    """The uploader dies at part 3 of the big object (its multipart upload left
    open, as a SIGKILL leaves it); the next upload takes that upload up, keeps
    the parts in the store and sends the rest."""
    state = _state()
    fastpersist.save(state, tmp_path / "raw")
    url = TierURL.parse(s3.url).child("r")
    with monkeypatch.context() as m:
        m.setenv("FASTPERSIST_TIER_CONCURRENCY", "1")  # parts 1 and 2 are in before part 3
        dying = S3()

    def die_at_part_3(params: Any, **_: Any) -> None:
        if params["PartNumber"] == 3:
            raise ConnectionError("injected: the uploader is killed")

    def killed(**_: Any) -> None:  # a killed process aborts nothing
        raise ConnectionError("injected: the uploader is killed")

    dying.client.meta.events.register("before-parameter-build.s3.UploadPart", die_at_part_3)
    dying.client.meta.events.register("before-call.s3.AbortMultipartUpload", killed)
    with pytest.raises(TierError, match="the uploader is killed"):
        _upload(dying, tmp_path / "raw", url, compression)
    (left,) = s3.client.list_multipart_uploads(Bucket=s3.bucket)["Uploads"]
    had = s3.client.list_parts(Bucket=s3.bucket, Key=left["Key"], UploadId=left["UploadId"])
    assert [p["PartNumber"] for p in had["Parts"]] == kept

    sent: list[int] = []
    client = S3()
    client.client.meta.events.register("before-parameter-build.s3.UploadPart",
                                       lambda params, **_: sent.append(params["PartNumber"]))
    done = _upload(client, tmp_path / "raw", url, compression)
    assert sorted(sent) == resent
    remote = read_manifest(S3(), url)[0]
    big = next(f for f in remote.files if f.name == left["Key"].rsplit("/", 1)[1])
    assert done.bytes == sum(f.size for f in remote.files) - sum(
        p["Size"] for p in had["Parts"])
    assert big.size > 2 * 5 * MIB
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    loaded = fastpersist.load(str(url))
    for k in ("big", "bf16", "ints", "zeros"):
        assert torch.equal(loaded[k], state[k]), k


def test_parts_that_differ_from_the_interrupted_uploads_are_sent_again(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open upload of the same key with other bytes (another checkpoint of
    that name, other knobs) is taken up, but none of its parts is kept."""
    fastpersist.save(_state(), tmp_path / "raw")
    url = TierURL.parse(s3.url).child("d")
    client = S3()
    manifest = read_local_manifest(tmp_path / "raw")
    big = max(manifest.files, key=lambda f: f.size).name.replace(".safetensors", ".fpz")
    key = url.key(big)
    upload = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    s3.client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload, PartNumber=2,
                          Body=b"\0" * (5 * MIB))
    sent: list[int] = []
    client.client.meta.events.register("before-parameter-build.s3.UploadPart",
                                       lambda params, **_: sent.append(params["PartNumber"]))
    done = _upload(client, tmp_path / "raw", url, "zstd")
    assert sorted(sent) == [1, 2, 3]
    assert done.bytes == sum(f.size for f in read_manifest(S3(), url)[0].files)
    assert fastpersist.load(str(url))["big"].shape == (4 * MIB,)
