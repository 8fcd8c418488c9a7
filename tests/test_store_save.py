"""Saving straight to the object store: save/async_save("s3://...") (issue 36,
item 3), against a real moto server process, with faults from a proxy
(tier_faults.py) and a real SIGKILL of a saving process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_faults import FaultProxy, Rule, Rules, wait_until
from tier_support import keys

import fastpersist
from fastpersist.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    StoreCredentialsError,
    StoreURLError,
    TierError,
    UnsupportedPathError,
)
from fastpersist.saving import registry

MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part


@pytest.fixture(autouse=True)
def _parts(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(PART))
    yield
    registry.close_shared()


def _state(seed: int, mib: int = 12) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(mib * MIB // 4, generator=g),
                      "b": torch.arange(1000, dtype=torch.int16) + seed,
                      "h": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
            "empty": torch.empty(0), "step": seed, "name": "run"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def _uploads(s3: Any) -> list[str]:
    return [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]


def test_save_and_async_save_write_what_load_and_safetensors_read(
        s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(8 * MIB))  # two data files
    state = _state(1)
    url = f"{s3.url}/step-1"
    fastpersist.save(state, url)
    objects = keys(s3.client, s3.bucket, "ckpts/step-1/")
    assert sorted(objects) == ["ckpts/step-1/data-00000.safetensors",
                               "ckpts/step-1/data-00001.safetensors",
                               "ckpts/step-1/manifest.json"]
    assert _equal(fastpersist.load(url), state)
    assert not _uploads(s3)
    # Each data object is the file a local save writes: a safetensors file.
    from safetensors.torch import load as st_load

    body = s3.client.get_object(Bucket=s3.bucket, Key="ckpts/step-1/data-00000.safetensors")
    assert torch.equal(st_load(body["Body"].read())["model.w"], state["model"]["w"])
    later = _state(2)
    future = fastpersist.async_save(later, f"{s3.url}/step-2")
    later["model"]["w"].zero_()  # after the snapshot: not in the checkpoint
    future.result()
    assert _equal(fastpersist.load(f"{s3.url}/step-2"), _state(2))
    assert "s3://" in repr(future)


def test_a_checkpoint_saved_again_is_replaced_never_mixed(s3: Any) -> None:
    url = f"{s3.url}/x"
    fastpersist.save(_state(1), url)
    smaller = {"only": torch.arange(10)}
    fastpersist.save(smaller, url)
    assert _equal(fastpersist.load(url), smaller)


@pytest.mark.parametrize("url,error", [
    ("s3://", StoreURLError), ("s3:///prefix/step-1", StoreURLError),
    ("s3://bucket/a/../b", StoreURLError), ("s3://bucket//b", StoreURLError),
    ("s3://bucket", UnsupportedPathError), ("s3://bucket/", UnsupportedPathError)])
def test_a_url_without_a_bucket_or_with_a_bad_key_is_refused(s3: Any, url: str,
                                                             error: type) -> None:
    if "bucket" in url:
        url = url.replace("bucket", s3.bucket)
    with pytest.raises(error, match=r"bucket|component|prefix"):
        fastpersist.save({"a": torch.ones(3)}, url)
    assert not keys(s3.client, s3.bucket)


def test_a_bucket_that_does_not_exist(s3: Any) -> None:
    with pytest.raises(BucketNotFoundError, match="'no-such-bucket-36c' does not exist"
                       ) as info:
        fastpersist.async_save({"a": torch.ones(3)}, "s3://no-such-bucket-36c/p/step-1")
    assert isinstance(info.value, CheckpointNotFoundError)


def test_no_credentials_names_the_settings(s3: Any, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreCredentialsError, match="AWS_ACCESS_KEY_ID"):
        fastpersist.save({"a": torch.ones(3)}, f"{s3.url}/step-1")
    assert not keys(s3.client, s3.bucket)


def test_server_errors_are_retried_then_raised_leaving_nothing(
        s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultProxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        # One 5xx per kind of request: retried, the save succeeds.
        proxy.schedule = Rules(Rule("UploadPart", "500"), Rule("PutObject", "503"),
                               Rule("CompleteMultipartUpload", "500"))
        fastpersist.save(_state(1), f"{s3.url}/step-1")
        assert proxy.stats.faults["500"] == 2 and proxy.stats.faults["503"] == 1
        # A store that keeps failing: a TierError naming the object, nothing visible.
        proxy.schedule = Rules(Rule("UploadPart", "500", times=1000, after=1))
        with pytest.raises(TierError, match=r"step-2/data-00000.safetensors.*InternalError"):
            fastpersist.save(_state(2), f"{s3.url}/step-2")
        # The manifest put fails for good: the data is up, the checkpoint is not.
        proxy.schedule = Rules(Rule("PutObject", "500", times=1000, key="manifest"))
        with pytest.raises(TierError, match=r"manifest\.json"):
            fastpersist.async_save(_state(3), f"{s3.url}/step-3").result()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert sorted(k for k in keys(s3.client, s3.bucket) if k.endswith("manifest.json")) == [
        "ckpts/step-1/manifest.json"]
    assert not _uploads(s3)  # the failed multipart uploads were aborted
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(f"{s3.url}/step-3")
    assert _equal(fastpersist.load(f"{s3.url}/step-1"), _state(1))


def test_every_part_and_the_manifest_carry_a_checksum_the_store_checks(
        s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 (>= 1.36) sends each part's CRC32 (x-amz-checksum-crc32), which S3
    checks before it stores the part: a part damaged on the way is refused."""
    seen: list[tuple[str, str]] = []
    with FaultProxy(s3.endpoint) as proxy:
        proxy.schedule = lambda req: seen.append(  # type: ignore[func-returns-value]
            (req.operation, req.headers.get("x-amz-checksum-crc32", ""))) or None
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        fastpersist.save(_state(1), f"{s3.url}/step-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    sent = [(op, crc) for op, crc in seen if op in ("UploadPart", "PutObject")]
    assert [op for op, _ in sent].count("UploadPart") == 3  # 12 MiB and a header, 5 MiB parts
    assert all(crc for _, crc in sent), sent


def test_the_next_data_file_is_sent_while_the_one_before_is_completed(
        s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data files' uploads overlap: completing one (a long request, the
    store assembles the object) does not stop the next one's parts. The
    store holds data-00000's completion until a part of data-00001 arrives."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(8 * MIB))  # a file per big tensor
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(3 * MIB, generator=g), "b": torch.randn(3 * MIB, generator=g)}
    second_file_sent = threading.Event()
    overlapped: list[bool] = []

    def hold(req: Any) -> None:
        if req.operation == "UploadPart" and req.key.endswith("data-00001.safetensors"):
            second_file_sent.set()
        if req.operation == "CompleteMultipartUpload" and \
                req.key.endswith("data-00000.safetensors"):
            overlapped.append(second_file_sent.wait(30))  # a bound, not a measure
        return None

    with FaultProxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.schedule = hold
        fastpersist.save(state, f"{s3.url}/step-1")
        assert overlapped == [True]
        # A part of the second file that keeps failing while the first one is
        # completed: the save fails naming it, and leaves no checkpoint and no
        # open upload behind.
        proxy.schedule = Rules(Rule("UploadPart", "500", times=1000, key="data-00001"))
        with pytest.raises(TierError, match=r"step-2/data-00001.safetensors.*InternalError"):
            fastpersist.save(state, f"{s3.url}/step-2")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert _equal(fastpersist.load(f"{s3.url}/step-1"), state)
    assert not any(k.endswith("manifest.json") for k in keys(s3.client, s3.bucket, "ckpts/step-2/"))
    assert not _uploads(s3)


_SAVER = textwrap.dedent("""
    import sys, torch, fastpersist
    sys.path.insert(0, sys.argv[1])
    from test_store_save import _state
    fastpersist.save(_state(2, 40), sys.argv[2])
    print("saved", flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_upload_leaves_no_checkpoint_and_the_next_save_resumes(
        s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process saving 40 MiB is SIGKILLed while its upload hangs
    after three parts (of 9): step-2 is not visible, step-1 is intact; a save of the
    same state to step-2 takes up the open upload, sending only the parts
    the store does not hold."""
    fastpersist.save(_state(1), f"{s3.url}/step-1")
    with FaultProxy(s3.endpoint, stall_s=120) as proxy:
        proxy.schedule = Rules(Rule("UploadPart", "stall", times=1000, after=3))
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint,
               "FASTPERSIST_TIER_TIMEOUT": "120", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(Path(__file__).parent),
                                 f"{s3.url}/step-2"], env=env, start_new_session=True)
        try:
            wait_until("the upload to hang", lambda: proxy.stats.faults["stall"] >= 1)
            wait_until("three parts stored", lambda: any(
                len(s3.client.list_parts(Bucket=s3.bucket, Key=u["Key"],
                                         UploadId=u["UploadId"]).get("Parts", [])) >= 3
                for u in s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])))
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        proxy.schedule = Rules()
    assert "ckpts/step-2/manifest.json" not in keys(s3.client, s3.bucket)
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(f"{s3.url}/step-2")
    assert _equal(fastpersist.load(f"{s3.url}/step-1"), _state(1))
    assert _uploads(s3) == ["ckpts/step-2/data-00000.safetensors"]
    with FaultProxy(s3.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        fastpersist.save(_state(2, 40), f"{s3.url}/step-2")
        sent = proxy.stats.operations["UploadPart"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert sent <= 9 - 3, f"{sent} parts sent again of 9, 3 were in the store"
    assert not _uploads(s3)
    assert _equal(fastpersist.load(f"{s3.url}/step-2"), _state(2, 40))
    manifest = json.loads(s3.client.get_object(
        Bucket=s3.bucket, Key="ckpts/step-2/manifest.json")["Body"].read())
    assert [f["name"] for f in manifest["files"]] == ["data-00000.safetensors"]


def _small(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _steps_in_store(s3: Any, prefix: str) -> set[str]:
    return {k.split("/")[2] for k in keys(s3.client, s3.bucket, prefix)}


def test_checkpointer_in_the_store_retention_latest_and_resume(s3: Any) -> None:
    root = f"{s3.url}/run"
    with fastpersist.Checkpointer(root, keep_last=2, keep_every=3) as ckpt:
        assert ckpt.latest() is None
        for step in range(1, 6):
            ckpt.save(step, _small(step)).result()
        assert ckpt.steps() == [3, 4, 5]
        with pytest.raises(fastpersist.CheckpointExistsError, match="step 5 is already saved"):
            ckpt.save(5, _small(5))
    # Deleted ones are gone whole: no object of step 1 or 2 is left.
    assert _steps_in_store(s3, "ckpts/run/") == {"step-00000003", "step-00000004",
                                                  "step-00000005"}
    again = fastpersist.Checkpointer(root, keep_last=2, keep_every=3)
    assert again.latest() == f"{root}/step-00000005"
    assert again.load_latest()["step"] == 5
    s3.client.delete_object(Bucket=s3.bucket, Key="ckpts/run/step-00000005/data-00000.safetensors")
    assert again.latest() == f"{root}/step-00000004"
    assert [s.path for s in again.skipped] == [f"{root}/step-00000005"]
    assert again.load_latest()["step"] == 4
    strict = fastpersist.Checkpointer(root, strict=True)
    with pytest.raises(fastpersist.CorruptCheckpointError, match="step-00000005"):
        strict.latest()
    again.close()
    strict.close()


def test_checkpointer_in_the_store_removes_what_killed_saves_of_older_steps_left(
        s3: Any) -> None:
    root = f"{s3.url}/run"
    s3.client.put_object(Bucket=s3.bucket, Key="ckpts/run/step-00000006/data-00000.safetensors",
                         Body=b"half")
    for step in (7, 9):
        s3.client.create_multipart_upload(
            Bucket=s3.bucket, Key=f"ckpts/run/step-{step:08d}/data-00000.safetensors")
    with fastpersist.Checkpointer(root) as ckpt:
        ckpt.save(8, _small(8)).result()
    assert _steps_in_store(s3, "ckpts/run/") == {"step-00000008"}
    # A newer step's upload is left to be taken up when that step is saved again.
    assert _uploads(s3) == ["ckpts/run/step-00000009/data-00000.safetensors"]


def test_should_save_in_the_store(s3: Any) -> None:
    """should_save as Checkpointer's: on save_every's interval and not saved yet,
    counting steps already in the store (a restarted job) and this one's saves."""
    root = f"{s3.url}/run"
    with fastpersist.Checkpointer(root) as first:
        first.save(4, _small(4)).result()
    with fastpersist.Checkpointer(root, save_every=2) as ckpt:
        assert [s for s in range(1, 9) if ckpt.should_save(s)] == [2, 6, 8]
        ckpt.save(6, _small(6))
        assert not ckpt.should_save(6)
        assert ckpt.should_save(8)
    with pytest.raises(ValueError, match="save_every"):
        fastpersist.Checkpointer(root, save_every=0)


@pytest.mark.parametrize("option", [{"tier": "s3://other/x"}, {"daemon": "unix:///x.sock"},
                                    {"compression": "zstd"}, {"memory_every": 2},
                                    {"keep_best": 2}])
def test_checkpointer_in_the_store_refuses_what_it_cannot_do(s3: Any,
                                                             option: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(option))}=.*object store"):
        fastpersist.Checkpointer(f"{s3.url}/run", **option)
    with pytest.raises(StoreURLError, match="no bucket"):
        fastpersist.Checkpointer("s3:///run")


def test_a_state_without_tensors_and_an_empty_one(s3: Any) -> None:
    for name, state in (("plain", {"step": 3, "name": "x", "lr": [0.1, 0.2]}), ("empty", {})):
        fastpersist.save(state, f"{s3.url}/{name}")
        assert fastpersist.load(f"{s3.url}/{name}") == state


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt", "model.bin"])
def test_a_single_file_name_in_the_store_is_refused_not_saved_as_a_checkpoint(
        s3: Any, name: str) -> None:
    url = f"{s3.url}/{name}"
    for save in (fastpersist.save, fastpersist.async_save):
        with pytest.raises(UnsupportedPathError, match=re.escape(url) + r".*single file.*"
                           r"local path.*checkpoint.*s3://") as info:
            save({"w": torch.ones(4, 8)}, url)
        assert isinstance(info.value, fastpersist.CheckpointError)
    assert not keys(s3.client, s3.bucket)


def test_loading_a_single_file_object_in_the_store_says_load_reads_checkpoints_there(
        s3: Any) -> None:
    from safetensors.torch import save as st_save

    s3.client.put_object(Bucket=s3.bucket, Key="ckpts/x.safetensors",
                         Body=st_save({"w": torch.ones(2)}))
    url = f"{s3.url}/x.safetensors"
    with pytest.raises(CheckpointNotFoundError, match=re.escape(url) + r".*single "
                       r"\.safetensors object.*download it to a local path"):
        fastpersist.load(url)
