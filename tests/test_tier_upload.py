"""The tier's upload of one checkpoint (fastpersist/tier/upload.py), against a
real S3 server (moto, a subprocess): data files in parallel parts, the
manifest last and conditional, nothing visible before it, abandoned multipart
uploads aborted or swept."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_support import keys

import fastpersist
from fastpersist.errors import TierError
from fastpersist.storage import dirs
from fastpersist.tier.checked import LocalCorruption
from fastpersist.tier.client import S3
from fastpersist.tier.remote import entries, read_manifest
from fastpersist.tier.retention import incomplete, keep_last, sweep_uploads
from fastpersist.tier.upload import NotUploadable, upload_checkpoint
from fastpersist.tier.url import TierURL

MIB = 1 << 20


def _save(path: Path, seed: int = 0, mib: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {"big": torch.randn(mib * MIB // 4, generator=g),
             "small": torch.arange(10, dtype=torch.int64) + seed}
    fastpersist.save(state, path)
    return state


def _upload(s3: S3, path: Path, url: TierURL) -> Any:
    fd = os.open(path, dirs.DIR_FLAGS)
    try:
        return upload_checkpoint(s3, fd, str(path), url)
    finally:
        os.close(fd)


def test_upload_copies_every_file_and_then_the_manifest(s3: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    _save(ckpt)
    client = S3()
    calls: list[tuple[str, str, Any]] = []
    client.client.meta.events.register(
        "before-parameter-build.s3.*",
        lambda model, params, **_: calls.append((model.name, params.get("Key"),
                                                 params.get("IfNoneMatch"))))
    url = TierURL.parse(s3.url).child("step-00000001")
    done = _upload(client, ckpt, url)
    assert not done.already and done.files == 1
    stored = keys(s3.client, s3.bucket)
    local = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    assert stored == {f"ckpts/step-00000001/{n}": size for n, size in local.items()}
    for name in local:
        body = s3.client.get_object(Bucket=s3.bucket, Key=f"ckpts/step-00000001/{name}")["Body"]
        assert body.read() == (ckpt / name).read_bytes()
    writes = [(op, key, cond) for op, key, cond in calls
              if op in ("PutObject", "CompleteMultipartUpload")]
    assert writes[-1] == ("PutObject", "ckpts/step-00000001/manifest.json", "*")
    assert all(not key.endswith("manifest.json") for _, key, _ in writes[:-1])
    # Uploading again sends nothing: the store holds these manifest bytes.
    again = _upload(client, ckpt, url)
    assert again.already and again.bytes == 0
    assert read_manifest(client, url)[1] == (ckpt / "manifest.json").read_bytes()


def test_large_files_go_in_parallel_parts(s3: Any, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, mib=12)
    _upload(S3(), ckpt, TierURL.parse(s3.url).child(ckpt.name))
    head = s3.client.head_object(Bucket=s3.bucket,
                                 Key="ckpts/step-00000001/data-00000.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # three parts of 5 MiB
    assert head["Metadata"] == {"fastpersist-codec": "raw"}


def test_a_failed_upload_leaves_no_manifest_and_no_multipart_upload(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    ckpt = tmp_path / "step-00000001"
    _save(ckpt, mib=12)
    client = S3()
    parts = []

    def fail_second_part(params: Any, **_: Any) -> None:
        parts.append(params["PartNumber"])
        if params["PartNumber"] == 2:
            raise ConnectionError("injected: the network went away")

    client.client.meta.events.register("before-parameter-build.s3.UploadPart", fail_second_part)
    with pytest.raises(TierError, match="step-00000001"):
        _upload(client, ckpt, TierURL.parse(s3.url).child(ckpt.name))
    assert not any(k.endswith("manifest.json") for k in keys(s3.client, s3.bucket))
    # s3transfer aborted its multipart upload.
    assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []
    (entry,) = entries(client, TierURL.parse(s3.url)) or [None]
    assert entry is None or not entry.committed


def test_sweep_aborts_abandoned_multipart_uploads(s3: Any) -> None:
    # moto reports every upload as initiated in 2010, so "old" is all this
    # server can show; the age cut-off is sweep_uploads' own comparison.
    old = s3.client.create_multipart_upload(Bucket=s3.bucket, Key="ckpts/step-1/data")
    s3.client.create_multipart_upload(Bucket=s3.bucket, Key="elsewhere/data")
    assert sweep_uploads(S3(), TierURL.parse(s3.url), older_than=3600) == ["ckpts/step-1/data"]
    left = s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["elsewhere/data"]
    assert old["UploadId"] not in [u["UploadId"] for u in left]


def test_conditional_put(s3: Any) -> None:
    client = S3()
    url = TierURL.parse(s3.url)
    assert client.put_new(url, "x", b"1")
    assert not client.put_new(url, "x", b"2")
    assert client.get(url, "x", 10) == b"1"


def test_a_checkpoint_saved_again_replaces_the_remote_one(s3: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    client = S3()
    url = TierURL.parse(s3.url).child(ckpt.name)
    _save(ckpt, seed=1)
    _upload(client, ckpt, url)
    _save(ckpt, seed=2)  # replaced locally
    done = _upload(client, ckpt, url)
    assert done.replaced and not done.already
    for name in ("manifest.json", "data-00000.safetensors"):
        body = s3.client.get_object(Bucket=s3.bucket, Key=f"ckpts/{ckpt.name}/{name}")["Body"]
        assert body.read() == (ckpt / name).read_bytes()


def test_what_cannot_be_uploaded(s3: Any, tmp_path: Path) -> None:
    client = S3()
    url = TierURL.parse(s3.url)
    (tmp_path / "step-1").mkdir()
    with pytest.raises(NotUploadable, match="not a committed checkpoint"):
        _upload(client, tmp_path / "step-1", url.child("step-1"))
    ckpt = tmp_path / "step-2"
    _save(ckpt)
    with open(ckpt / "data-00000.safetensors", "ab") as f:
        f.write(b"x")
    with pytest.raises(LocalCorruption, match="its manifest says"):
        _upload(client, ckpt, url.child("step-2"))
    assert keys(s3.client, s3.bucket) == {}


def test_remote_keep_last_deletes_the_manifest_first(s3: Any, tmp_path: Path) -> None:
    client = S3()
    url = TierURL.parse(s3.url)
    for step in (1, 2, 3, 4):
        _save(tmp_path / f"step-{step}", seed=step)
        _upload(client, tmp_path / f"step-{step}", url.child(f"step-{step}"))
    kept = keep_last(client, url, 3, keep=2)
    assert kept.kept == (3, 2) and kept.deleted == ("step-1",)  # 4 is higher: not counted
    assert [e.name for e in entries(client, url)] == ["step-2", "step-3", "step-4"]
    # An upload that died before its manifest: gc's business once old enough.
    s3.client.put_object(Bucket=s3.bucket, Key="ckpts/step-5/data-00000.safetensors", Body=b"x")
    assert incomplete(client, url, older_than=3600) == []
    assert [e.name for e in incomplete(client, url, older_than=-1)] == ["step-5"]
