"""fastpersistd --tier: the daemon uploads what it commits, keeps what is not
uploaded, reports failures, and after a SIGKILL uploads what was left. Against
real processes: the daemon and an S3 server (moto)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon
from tier_support import free_port, keys, make_bucket

import fastpersist
from fastpersist.cli import main as fpctl

MIB = 1 << 20


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _manifests(s3: Any) -> list[str]:
    return sorted(k.removesuffix("/manifest.json") for k in keys(s3.client, s3.bucket)
                  if k.endswith("/manifest.json"))


def _status(d: Daemon, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert fpctl(["daemon", "status", "--daemon", d.address, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.fixture
def daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Starts daemons on one root (and one shared-memory directory, this
    process's clients' too)."""
    started: list[Daemon] = []

    def start(*args: str, prelude: str = "") -> Daemon:
        d = Daemon(tmp_path, *args, root=tmp_path / "root", prelude=prelude,
                   shm_dir=started[0].shm_dir if started else None).start()
        monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
        started.append(d)
        return d

    yield start
    from fastpersist.saving.registry import close_shared

    close_shared(abort=True)
    for d in started:
        d.cleanup()


def test_the_daemon_uploads_what_it_commits(s3: Any, daemons: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    d = daemons("--tier", s3.url, "--tier-keep-last", "1", "--metrics-listen",
                f"127.0.0.1:{port}")
    ckpt = fastpersist.Checkpointer(d.root / "run", daemon=d.address)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((1000,), float(step)), "step": step}).result()
        # Each uploaded before the next commits: a step 2 committed first would
        # be uploaded first (newest first), and step 1 then skipped as
        # superseded (tier_keep_last=1), as seen once under load.
        _until(f"step {step} uploaded",
               lambda step=step: _status(d, capsys)["tier"]["uploaded"] == step)
    ckpt.close()
    _until("step 2 uploaded and step 1 gone from the store",
           lambda: _manifests(s3) == ["ckpts/run/step-00000002"])
    loaded = fastpersist.load(f"{s3.url}/run/step-00000002")
    assert loaded["step"] == 2
    tier = _until("nothing pending", lambda: (t := _status(d, capsys)["tier"])["pending"] == 0
                  and t)
    assert tier["url"] == s3.url and tier["uploaded"] == 2 and tier["last_error"] == ""
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'fastpersist_tier_uploads_total{result="uploaded"} 2.0' in metrics
    assert "fastpersist_tier_pending 0.0" in metrics
    assert [e["path"] for e in d.events("tier-uploaded")] == ["run/step-00000001",
                                                              "run/step-00000002"]


def test_retention_keeps_what_is_not_uploaded(s3: Any, daemons: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bucket = f"later-{s3.bucket[:40]}"
    # No such bucket yet: uploads fail. Sent as they are (--tier-compression none).
    d = daemons("--tier", f"s3://{bucket}/ckpts", "--tier-compression", "none")
    root = d.root / "run"
    ckpt = fastpersist.Checkpointer(root, daemon=d.address, keep_last=1)
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((10,), float(step))}).result()
    assert sorted(p.name for p in root.glob("step-*")) == [
        "step-00000001", "step-00000002", "step-00000003"]
    tier = _until("failures reported", lambda: (t := _status(d, capsys)["tier"])["failing"] == 3
                  and t)
    assert tier["pending"] == 3 and "NoSuchBucket" in tier["last_error"]
    capsys.readouterr()
    assert fpctl(["daemon", "status", "--daemon", d.address]) == 0
    assert "3 checkpoint(s) to upload (3 failing)" in capsys.readouterr().out
    assert d.events("tier-upload-failed")
    make_bucket(s3.endpoint, bucket)  # the store is back: the retries succeed
    _until("the uploads", lambda: _status(d, capsys)["tier"]["pending"] == 0)
    assert sorted(k.rsplit("/", 1)[1] for k in keys(s3.client, bucket, "ckpts/run/step-00000001/")
                  ) == ["data-00000.safetensors", "manifest.json"]
    ckpt.save(4, {"w": torch.full((10,), 4.0)}).result()  # its retention may delete them now
    ckpt.close()
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004"]


def test_sigkill_mid_upload_and_restart(s3: Any, daemons: Any, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_TIER_PART_BYTES", str(5 * MIB))
    reached, gate = tmp_path / "reached", tmp_path / "gate"
    # In the daemon: hold its uploads at the first part until the gate exists.
    prelude = (
        "import os, pathlib, time\n"
        "from fastpersist.tier import client\n"
        "_init = client.S3.__init__\n"
        "def init(self, *a, **k):\n"
        "    _init(self, *a, **k)\n"
        "    def hold(params, **_):\n"
        f"        pathlib.Path({str(reached)!r}).touch()\n"
        f"        while not os.path.exists({str(gate)!r}): time.sleep(0.05)\n"
        "    self.client.meta.events.register('before-parameter-build.s3.UploadPart', hold)\n"
        "client.S3.__init__ = init\n")
    d = daemons("--tier", s3.url, prelude=prelude)
    # 20 MiB of float32 compress to about 17 MiB (the default, zstd): a multipart upload.
    state = {"w": torch.randn(5 * MIB), "step": 1}
    fastpersist.save(state, d.root / "run" / "step-00000001", daemon=d.address)
    _until("the upload to start", reached.exists)
    d.kill()  # SIGKILL, parts in flight
    assert _manifests(s3) == []  # nothing visible
    again = daemons("--tier", s3.url)  # the same root, no gate
    _until("the upload after the restart",
           lambda: _manifests(s3) == ["ckpts/run/step-00000001"])
    assert again.events("tier-start")[-1]["queued"] == 1
    loaded = fastpersist.load(f"{s3.url}/run/step-00000001")
    assert torch.equal(loaded["w"], state["w"])
