"""Checkpointer(tier="s3://..."): uploads in the background after each local
commit, never holding up the trainer, never letting local retention delete a
checkpoint's only copy, and never failing silently. Against a real S3 server
(moto, a subprocess)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_support import MotoServer, environment, keys, make_bucket

import fastpersist
from fastpersist.errors import TierError
from fastpersist.tier.client import client_for
from fastpersist.tier.remote import entries
from fastpersist.tier.url import TierURL

MIB = 1 << 20


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((MIB // 4,), float(step)), "step": step}


class Gate:
    """Holds every upload request of `client` at its first data PutObject
    until open() (requests of other operations pass)."""

    def __init__(self, s3_client: Any, operation: str = "PutObject") -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        s3_client.meta.events.register(f"before-parameter-build.s3.{operation}", self._hold)

    def _hold(self, params: Any, **_: Any) -> None:
        if str(params.get("Key", "")).endswith((".safetensors", ".fpz")):
            self.reached.set()
            assert self.opened.wait(60), "the gate was never opened"

    def open(self) -> None:
        self.opened.set()


def _remote_names(url: str) -> list[str]:
    return [e.name for e in entries(client_for(), TierURL.parse(url)) if e.committed]


def test_uploads_each_checkpoint_after_its_commit(s3: Any, tmp_path: Path) -> None:
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url)
    ckpt.save(1, _state(1)).result()  # waited for
    ckpt.save(2, _state(2))  # not waited for
    assert ckpt.wait_for_tier(60)
    status = ckpt.tier_status()
    assert status is not None and status.ok and status.pending == ()
    assert status.uploaded == 2 and status.last_error is None
    ckpt.close()
    assert _remote_names(s3.url) == ["step-00000001", "step-00000002"]
    for step in (1, 2):  # the round trip, sync and async
        loaded = fastpersist.load(f"{s3.url}/step-{step:08d}")
        assert loaded["step"] == step and torch.equal(loaded["w"], _state(step)["w"])
    # Compressed on the way (tier_compression="zstd", the default); the local copy is raw.
    local = tmp_path / "run" / "step-00000002"
    stored = keys(s3.client, s3.bucket, "ckpts/step-00000002/")
    assert sorted(p.name for p in local.iterdir()) == ["data-00000.safetensors", "manifest.json"]
    assert sorted(stored) == ["ckpts/step-00000002/data-00000.fpz",
                              "ckpts/step-00000002/manifest.json"]
    assert stored["ckpts/step-00000002/data-00000.fpz"] < (
        local / "data-00000.safetensors").stat().st_size // 10  # a constant tensor
    assert status.bytes_uploaded < 2 * MIB // 10


def test_tier_compression_none_uploads_the_files_as_they_are(s3: Any, tmp_path: Path) -> None:
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, tier_compression="none")
    ckpt.save(1, _state(1))
    ckpt.close()
    local = tmp_path / "run" / "step-00000001"
    stored = keys(s3.client, s3.bucket, "ckpts/step-00000001/")
    assert stored == {f"ckpts/step-00000001/{p.name}": p.stat().st_size for p in local.iterdir()}
    with pytest.raises(ValueError, match="tier_compression"):
        fastpersist.Checkpointer(tmp_path / "x", tier=s3.url, tier_compression="lz4")


def test_the_save_does_not_wait_for_the_upload(s3: Any, tmp_path: Path) -> None:
    gate = Gate(client_for().client)
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url)
    try:
        ckpt.save(1, _state(1)).result(timeout=30)  # durable locally, upload held
        assert gate.reached.wait(30)
        status = ckpt.tier_status()
        assert status is not None and status.pending == (str(tmp_path / "run/step-00000001"),)
        assert status.uploading == str(tmp_path / "run/step-00000001")
        assert _remote_names(s3.url) == []  # no manifest: not visible
    finally:
        gate.open()
    assert ckpt.wait_for_tier(60)
    ckpt.close()
    assert _remote_names(s3.url) == ["step-00000001"]


def test_local_retention_keeps_checkpoints_not_uploaded_yet(s3: Any, tmp_path: Path) -> None:
    gate = Gate(client_for().client)
    root = tmp_path / "run"
    ckpt = fastpersist.Checkpointer(root, keep_last=1, tier=s3.url)
    try:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).result(timeout=30)
        # keep_last=1 would leave step 3 alone; the others are not uploaded yet.
        assert sorted(p.name for p in root.glob("step-*")) == [
            "step-00000001", "step-00000002", "step-00000003"]
    finally:
        gate.open()
    assert ckpt.wait_for_tier(60)
    ckpt.close()
    # Once uploaded, retention deletes them locally; the store keeps all three.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003"]
    assert _remote_names(s3.url) == ["step-00000001", "step-00000002", "step-00000003"]


def test_failures_are_reported_and_keep_the_local_copies(s3: Any, tmp_path: Path) -> None:
    root = tmp_path / "run"
    url = f"s3://no-such-bucket-{s3.bucket[:30]}/ckpts"
    ckpt = fastpersist.Checkpointer(root, keep_last=1, tier=url)
    for step in (1, 2):
        ckpt.save(step, _state(step)).result(timeout=30)
    assert not ckpt.wait_for_tier(3)
    status = ckpt.tier_status()
    assert status is not None and not status.ok and status.failures >= 1
    assert "NoSuchBucket" in (status.last_error or "")
    with pytest.raises(TierError, match=r"not uploaded to .*step-00000001.*NoSuchBucket"):
        ckpt.close()
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000002"]
    # The bucket appears; the next Checkpointer on the root uploads both.
    make_bucket(s3.endpoint, url.split("/")[2])
    again = fastpersist.Checkpointer(root, keep_last=1, tier=url)
    assert again.wait_for_tier(60)
    again.close()
    assert _remote_names(url) == ["step-00000001", "step-00000002"]


def test_tier_keep_last(s3: Any, tmp_path: Path) -> None:
    ckpt = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, tier_keep_last=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, _state(step)).result(timeout=30)
        assert ckpt.wait_for_tier(60)
    ckpt.close()
    assert _remote_names(s3.url) == ["step-00000003", "step-00000004"]
    assert not any("step-00000001" in k for k in keys(s3.client, s3.bucket))


def test_tier_needs_an_in_process_checkpointer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fastpersistd --tier"):
        fastpersist.Checkpointer(tmp_path, tier="s3://b/p", daemon="unix:///nowhere.sock")
    with pytest.raises(ValueError, match="not a valid component"):
        fastpersist.Checkpointer(tmp_path, tier="s3://bucket/a/../b")


def test_the_store_killed_mid_upload_and_restarted(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server = MotoServer(tmp_path).start()
    try:
        for name, value in environment(server.endpoint, tmp_path).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
        make_bucket(server.endpoint, "killed")
        gate = Gate(client_for().client, "UploadPart")
        root = tmp_path / "run"
        ckpt = fastpersist.Checkpointer(root, tier="s3://killed/ckpts")
        # 20 MiB of float32, about 17 MiB compressed: a multipart upload.
        state = {"w": torch.randn(5 * MIB), "step": 1}
        ckpt.save(1, state).result(timeout=30)
        assert gate.reached.wait(30)
        server.kill()  # mid-upload: parts in flight
        gate.open()
        deadline = time.monotonic() + 30
        while (ckpt.tier_status() or pytest.fail()).failures == 0:
            assert time.monotonic() < deadline, "the failure was not reported"
            time.sleep(0.1)
        assert not ckpt.tier_status().ok  # type: ignore[union-attr]
        server.start()  # an empty store (moto keeps nothing): the upload starts over
        client = make_bucket(server.endpoint, "killed")
        assert ckpt.wait_for_tier(60), ckpt.tier_status()
        ckpt.close()
        assert sorted(keys(client, "killed")) == ["ckpts/step-00000001/data-00000.fpz",
                                                  "ckpts/step-00000001/manifest.json"]
        assert client.list_multipart_uploads(Bucket="killed").get("Uploads", []) == []
        assert torch.equal(fastpersist.load("s3://killed/ckpts/step-00000001")["w"], state["w"])
    finally:
        server.kill()
