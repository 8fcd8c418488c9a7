"""compression="zstd" through fastpersistd: the daemon packs what a client staged.

The daemon writes the same packed files an in-process save writes (one plan,
codec/packing.py), byte for byte; every API passes compression along; a file
streamed for being larger than the staging budget is written raw beside the
packed ones; malformed requests are refused; and a client never accepts a
raw checkpoint from a daemon that ignored its request (an older one).
The trainer killed after the hand-over of a compressed save is in
test_daemon_crash.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from daemon_support import Daemon
from test_daemon import _close_remote_savers, assert_same, same_files

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.errors import DaemonError
from fastpersist.format.manifest import MANIFEST_NAME
from fastpersist.tensors.checkpoint import read_manifest

MIB = 1 << 20


def trained_like(seed: int = 0) -> dict[str, Any]:
    """Weights whose exponent bytes repeat (as trained ones' do): they compress."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16),
                  "v": torch.randn(300_000, generator=g) * 1e-3,
                  "b": torch.arange(300, dtype=torch.int64),
                  "tiny": torch.randn(17, generator=g)},
        "step": 12, "name": "adamw",
    }


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != MANIFEST_NAME)


def test_the_daemon_writes_what_an_in_process_save_writes(daemon: Daemon,
                                                          tmp_path: Path) -> None:
    state = trained_like()
    fastpersist.save(state, daemon.root / "ck", daemon=daemon.address, compression="zstd")
    fastpersist.save(state, tmp_path / "local", daemon="", compression="zstd")
    assert data_files(daemon.root / "ck") == ["data-00000.fpz"]
    same_files(daemon.root / "ck", tmp_path / "local")
    manifest = read_manifest(daemon.root / "ck")
    assert {t.name: t.frames is not None for t in manifest.tensors} == {
        "model.w": True, "model.v": True, "model.b": False, "model.tiny": False}
    assert manifest.files[0].size < 0.9 * sum(t.length for t in manifest.tensors)
    assert_same(state, fastpersist.load(daemon.root / "ck"))
    done = subprocess.run([sys.executable, "-m", "fastpersist.cli", "verify",
                           str(daemon.root / "ck")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_async_save_and_checkpointer_compress_through_the_daemon(daemon: Daemon) -> None:
    state = trained_like(1)
    expected = {k: v.clone() for k, v in state["model"].items()}
    future = fastpersist.async_save(state, daemon.root / "a", daemon=daemon.address,
                                    compression="zstd")
    for t in state["model"].values():
        t.zero_()  # right after the return: the daemon owns a snapshot
    future.result(timeout=60)
    assert data_files(daemon.root / "a") == ["data-00000.fpz"]
    assert_same(expected, fastpersist.load(daemon.root / "a")["model"])

    with fastpersist.Checkpointer(daemon.root / "run", keep_last=2, daemon=daemon.address,
                                  compression="zstd") as ck:
        for step in range(3):
            ck.save(step, {**trained_like(step), "step": step})
        ck.wait()
        assert ck.steps() == [1, 2]
        assert ck.load_latest()["step"] == 2
        latest = ck.latest()
    assert latest is not None and data_files(latest) == ["data-00000.fpz"]


def test_a_streamed_file_is_written_raw_beside_packed_ones(
        daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 4 MiB budget: 1 MiB tensors go staged (packed by the daemon); the 8 MiB one
    # is too large for any staging and goes over SubmitStream, written as it comes.
    monkeypatch.setenv("FASTPERSIST_STAGING_BUDGET", str(4 * MIB))
    state = {f"t{i}": torch.full((MIB // 4,), float(i)) for i in range(4)}
    state["big"] = torch.arange(2 * MIB, dtype=torch.float32)
    fastpersist.async_save(state, daemon.root / "ck", daemon=daemon.address,
                           compression="zstd").result(60)
    names = data_files(daemon.root / "ck")
    assert any(n.endswith(".fpz") for n in names), names
    assert any(n.endswith(".safetensors") for n in names), names
    records = {t.name: t for t in read_manifest(daemon.root / "ck").tensors}
    assert records["big"].frames is None and records["big"].file.endswith(".safetensors")
    assert records["t0"].frames is not None
    assert_same(state, fastpersist.load(daemon.root / "ck"))


def test_malformed_compression_requests_are_refused(daemon: Daemon) -> None:
    channel = grpc.insecure_channel("unix:" + str(daemon.socket))
    try:
        from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc

        stub = pb_grpc.FastPersistStub(channel)
        cases = {"lz4": ("lz4", 0), "zstd, unaligned frames": ("zstd", 4097),
                 "zstd, huge frames": ("zstd", 1 << 40)}
        for what, (compression, frame_bytes) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.Begin(pb.BeginRequest(path=f"bad/{len(what)}", client_id="t",
                                           staging_bytes=MIB, file_count=1,
                                           compression=compression, frame_bytes=frame_bytes),
                           timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "compression" in str(info.value.details()) or "frame_bytes" in str(
                info.value.details()), what
    finally:
        channel.close()
    assert not (daemon.root / "bad").exists() or not list((daemon.root / "bad").iterdir())


# A daemon from before Begin's compression field: it ignores the field (protobuf
# drops unknown fields), writes raw files and says nothing of compression.
_IGNORES_COMPRESSION = (
    "import fastpersist.daemon.service as s, fastpersist.daemon.checkpoints as c\n"
    "s.check_compression = lambda compression, frame_bytes: 0\n"
    "_status = c.Checkpoint.status\n"
    "c.Checkpoint.status = lambda self: {k: v for k, v in _status(self).items()\n"
    "                                    if k != 'compression'}\n"
)


def test_a_daemon_that_ignores_compression_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = Daemon(tmp_path, prelude=_IGNORES_COMPRESSION).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        with pytest.raises(DaemonError, match="does not compress") as info:
            fastpersist.save(trained_like(), d.root / "ck", daemon=d.address,
                             compression="zstd")
        assert info.value.code == "FAILED_PRECONDITION"
        assert not (d.root / "ck").exists()
        # Without compression it is as good a daemon as any.
        fastpersist.save(trained_like(), d.root / "ck", daemon=d.address)
        assert data_files(d.root / "ck") == ["data-00000.safetensors"]
    finally:
        _close_remote_savers()
        d.cleanup()


# The codec fails inside a frame's encoding, where the task's views of the
# client's shared memory are in the traceback.
_ENCODE_FAILS = (
    "import fastpersist.codec.frame as f\n"
    "def encode(*args, **kwargs):\n"
    "    raise MemoryError('injected: no memory for the frame')\n"
    "f.encode = encode\n"
)


def test_a_failing_encode_fails_the_checkpoint_and_the_daemon_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = Daemon(tmp_path, prelude=_ENCODE_FAILS).start()
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(d.shm_dir))
    try:
        with pytest.raises(fastpersist.CheckpointError, match="injected"):
            # (The failure may come before the hand-over or after it; a
            # TimeoutError instead: the daemon's writer got stuck.)
            fastpersist.async_save(trained_like(), d.root / "ck", daemon=d.address,
                                   compression="zstd").result(timeout=60)
        assert not (d.root / "ck").exists()
        # Nothing stuck: the same daemon writes the next checkpoint (raw).
        fastpersist.save(trained_like(), d.root / "ck", daemon=d.address)
        assert_same(trained_like(), fastpersist.load(d.root / "ck"))
        assert not [e for e in d.events() if e.get("event") == "worker-error"]
    finally:
        _close_remote_savers()
        d.cleanup()


def test_the_clients_frame_size_is_the_daemons(daemon: Daemon, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon runs with the default 4 MiB frames; this client asks for 64 KiB ones.
    monkeypatch.setenv("FASTPERSIST_FRAME_BYTES", str(64 << 10))
    state = trained_like(2)
    fastpersist.save(state, daemon.root / "ck", daemon=daemon.address, compression="zstd")
    fastpersist.save(state, tmp_path / "local", daemon="", compression="zstd")
    same_files(daemon.root / "ck", tmp_path / "local")
    w = next(t for t in read_manifest(daemon.root / "ck").tensors if t.name == "model.w")
    assert w.frames is not None and len(w.frames) == w.length // (64 << 10)
    assert {f.raw_length for f in w.frames} == {64 << 10}
