"""Restore from the fastest verified copy (loading/chain.py, copies.py): the
daemon's memory, then the disk, then the object store, each CRC-checked, a
failed one warned about and passed over. Real daemons, a real S3 server
(moto), bytes flipped in real files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_support import Daemon, serving
from tier_support import keys

import fastpersist
from fastpersist.cli import main as fpctl
from fastpersist.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from fastpersist.format.manifest import Manifest
from fastpersist.tensors import memory_read

MIB = 1 << 20


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64 << 10, generator=g), "w": torch.randn(MIB // 4, generator=g),
            "b": torch.arange(11 + seed), "step": seed}


def digests(obj: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            if isinstance(v, torch.Tensor) else repr(v) for k, v in obj.items()}


def until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def flip(directory: Path, manifest: Manifest, tensor: str = "w", at: int = 1000) -> str:
    """Flip byte `at` of `tensor` in its data file under `directory`; the file's name."""
    r = next(r for r in manifest.tensors if r.name == tensor)
    with open(directory / r.file, "r+b") as f:
        f.seek(r.offset + at)
        byte = f.read(1)
        f.seek(r.offset + at)
        f.write(bytes([byte[0] ^ 0x40]))
    return r.file


def disk_manifest(ckpt: Path) -> Manifest:
    return Manifest.from_json((ckpt / "manifest.json").read_bytes(), str(ckpt))


def runtime_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]


@pytest.fixture
def node(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon with a memory tier and an object-store tier (compressed, the default)."""
    with serving(Daemon(tmp_path, "--memory-tier-count", "2", "--memory-tier-bytes", "64M",
                        "--tier", s3.url), monkeypatch) as d:
        yield d


def saved_everywhere(d: Daemon, s3: Any, name: str, seed: int) -> Path:
    """A checkpoint saved through the daemon: on disk, in its memory, and uploaded."""
    ckpt = d.root / name
    fastpersist.save(state(seed), ckpt, daemon=d.address)
    until(f"{name} uploaded", lambda: f"ckpts/{name}/manifest.json" in keys(s3.client, s3.bucket))
    return ckpt


@pytest.mark.slow
def test_memory_then_disk_then_the_store(node: Daemon, s3: Any) -> None:
    """The memory copy corrupt: the disk is read. The disk corrupt too: the
    store's (compressed) copy is read, bit for bit, each fall a warning."""
    ckpt = saved_everywhere(node, s3, "step-1", 1)
    memory, _ = memory_read.find(node.address, ckpt)
    assert memory is not None
    flip(memory.copy, memory.manifest())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert digests(fastpersist.load(ckpt, daemon=node.address)) == digests(state(1))
    said = runtime_warnings(caught)
    assert len(said) == 1 and "copy in memory failed" in said[0] and "from disk" in said[0]
    data_file = flip(ckpt, disk_manifest(ckpt))
    shown: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fastpersist.load(ckpt, daemon=node.address, progress=shown.append)
    assert digests(out) == digests(state(1))
    # Bytes read again from the next copy are not reported twice.
    assert sum(shown) == disk_manifest(ckpt).tensor_bytes, shown
    said = runtime_warnings(caught)
    assert len(said) == 2, said  # one a fall
    assert "copy in memory failed" in said[0] and "reading it from disk" in said[0]
    assert "disk failed (" in said[1] and f"'w' in {data_file}" in said[1]
    assert said[1].endswith("reading it from the object store's copy (fastpersistd's tier)")


@pytest.mark.slow
def test_a_lost_node_directory_loads_from_the_store(node: Daemon, s3: Any) -> None:
    ckpt = saved_everywhere(node, s3, "run/step-2", 2)
    client = node.client()
    client.delete("run/step-2")  # the node's copy and the daemon's memory gone
    client.close()
    assert not ckpt.exists()
    with pytest.warns(RuntimeWarning, match="disk failed .*reading it from the object store"):
        out = fastpersist.load(ckpt, daemon=node.address)
    assert digests(out) == digests(state(2))
    # Without a daemon (so no tier known) it is not found, as before.
    with pytest.raises(CheckpointNotFoundError):
        fastpersist.load(ckpt, daemon="")
    # Not in the store either: the disk's error, saying the store has none.
    with pytest.raises(CheckpointNotFoundError) as raised:
        fastpersist.load(node.root / "run" / "step-3", daemon=node.address)
    message = str(raised.value)
    assert message.startswith(f"{node.root / 'run' / 'step-3'}: no copy could be read (disk: "
                              "no checkpoint at"), message
    assert "not there: the peers' replicas (fastpersistd at " in message  # it has no peers
    assert f"the object store's copy (fastpersistd's tier) (no checkpoint at " \
           f"{s3.url}/run/step-3: it has no manifest.json" in message


@pytest.mark.slow
def test_every_copy_corrupt_lists_each_copy(node: Daemon, s3: Any) -> None:
    ckpt = saved_everywhere(node, s3, "step-3", 3)
    memory, _ = memory_read.find(node.address, ckpt)
    assert memory is not None
    flip(memory.copy, memory.manifest())
    flip(ckpt, disk_manifest(ckpt))
    remote = f"ckpts/step-3/{disk_manifest(ckpt).files[0].name.removesuffix('.safetensors')}.fpz"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=remote)["Body"].read())
    body[-100] ^= 0x40
    s3.client.put_object(Bucket=s3.bucket, Key=remote, Body=bytes(body))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError) as raised:
            fastpersist.load(ckpt, daemon=node.address)
    message = str(raised.value)
    assert message.startswith(f"{ckpt}: no copy could be read (")
    for what in ("fastpersistd's copy in memory: ", "disk: ", "the object store's copy"):
        assert what in message, message
    assert message.count("'w'") >= 2, message  # the tensor named for each copy


@pytest.mark.slow
def test_into_filled_in_part_is_filled_again(node: Daemon, s3: Any) -> None:
    """Each copy corrupt in "w" but the store's (compressed): the memory
    copy and the disk each fill the caller's "w" with their bad bytes first."""
    ckpt = saved_everywhere(node, s3, "step-4", 4)
    memory, _ = memory_read.find(node.address, ckpt)
    assert memory is not None
    flip(memory.copy, memory.manifest())
    flip(ckpt, disk_manifest(ckpt), tensor="w")
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in state(4).items()}
    ptrs = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fastpersist.load(ckpt, daemon=node.address, into=into)
    assert digests(out) == digests(state(4))
    assert {k: v.data_ptr() for k, v in out.items() if isinstance(v, torch.Tensor)} == ptrs


def test_a_stopped_daemon_is_timed_out_and_the_disk_read(daemon: Daemon) -> None:
    """SIGSTOP: the daemon takes the connection and never answers; the load
    gives it its lookup timeout and reads the disk."""
    ckpt = daemon.root / "step-5"
    fastpersist.save(state(5), ckpt, daemon=daemon.address)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = fastpersist.load(ckpt, daemon=daemon.address)
        assert digests(out) == digests(state(5))
        # The disk corrupt too: asking it for its tier times out as well, and
        # the disk's error is raised, saying so.
        flip(ckpt, disk_manifest(ckpt))
        with pytest.raises(ChecksumMismatchError) as raised:
            fastpersist.load(ckpt, daemon=daemon.address)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    message = str(raised.value)
    assert message.startswith(f"{ckpt}: no copy could be read (disk: tensor 'w'"), message
    assert "cannot ask fastpersistd for its tier" in message and "not answering" in message


def test_a_store_copy_of_another_checkpoint_is_not_mixed_in(tmp_path: Path, s3: Any) -> None:
    """The store holds an older checkpoint of the same name: a corrupt disk
    copy does not fall through to it, and the error says why."""
    ck = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url)
    ck.save(6, state(6))
    assert ck.wait_for_tier(60)
    ck.close()
    path = ck.path_for(6)
    for f in path.iterdir():
        f.unlink()
    path.rmdir()
    fastpersist.save(state(60), path)  # saved again here, not uploaded
    flip(path, disk_manifest(path))
    with pytest.raises(ChecksumMismatchError) as raised:
        fastpersist.load(path, tier=f"{s3.url}/{path.name}")
    assert "another checkpoint of that name" in str(raised.value)
    assert raised.value.tensor == "w"


@pytest.mark.slow
def test_load_latest_reads_the_store_for_a_lost_or_corrupt_step(tmp_path: Path, s3: Any) -> None:
    ck = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url, tier_compression="none")
    for step in (1, 2):
        ck.save(step, state(step))
    assert ck.wait_for_tier(60)
    # The newest step's local copy corrupt: read from the store, not passed over.
    flip(ck.path_for(2), disk_manifest(ck.path_for(2)))
    with pytest.warns(RuntimeWarning, match="disk failed"):
        assert digests(ck.load_latest()) == digests(state(2))
    assert not ck.skipped
    # Gone: the store's copy of the newest step, not the older local one.
    for f in ck.path_for(2).iterdir():
        f.unlink()
    ck.path_for(2).rmdir()
    assert ck.latest() == f"{s3.url}/{ck.path_for(2).name}"
    assert digests(ck.load_latest()) == digests(state(2))
    ck.close()


@pytest.mark.slow
def test_fpctl_restore_reads_the_store(node: Daemon, s3: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = saved_everywhere(node, s3, "step-7", 7)
    monkeypatch.setenv("FASTPERSIST_DAEMON", node.address)
    memory, _ = memory_read.find(node.address, ckpt)
    assert memory is not None
    flip(memory.copy, memory.manifest())
    flip(ckpt, disk_manifest(ckpt))
    target = tmp_path / "out.pt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fpctl(["restore", str(ckpt), "--to", str(target)]) == 0
    said = runtime_warnings(caught)
    assert "reading it from disk" in said[0]
    assert "reading it from the object store" in said[-1]
    assert digests(torch.load(target)) == digests(state(7))


def test_fpctl_ls_shows_the_copies(node: Daemon, s3: Any, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    saved_everywhere(node, s3, "step-8", 8)
    fastpersist.save(state(9), node.root / "step-9", daemon="")  # on disk only
    capsys.readouterr()
    assert fpctl(["ls", str(node.root), "--daemon", node.address, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["step-8"]["copies"] == ["memory", "disk", "s3"]
    assert rows["step-9"]["copies"] == ["disk"]
    assert set(rows["step-8"]) == {"name", "path", "state", "bytes", "tensors",
                                   "created_unix", "latest", "copies"}
    assert fpctl(["ls", str(node.root), "--daemon", node.address]) == 0
    text = capsys.readouterr().out
    assert "COPIES" in text.splitlines()[0]
    line = next(x for x in text.splitlines() if x.startswith("step-8"))
    assert "memory,disk,s3" in line
    # Without the daemon: the disk alone, unless a tier is given.
    monkeypatch.delenv("FASTPERSIST_DAEMON", raising=False)
    assert fpctl(["ls", str(node.root), "--json"]) == 0
    assert {r["name"]: r["copies"] for r in json.loads(capsys.readouterr().out)} == {
        "step-8": ["disk"], "step-9": ["disk"]}
    assert fpctl(["ls", str(node.root), "--json", "--tier", s3.url]) == 0
    assert {r["name"]: r["copies"] for r in json.loads(capsys.readouterr().out)} == {
        "step-8": ["disk", "s3"], "step-9": ["disk"]}


@pytest.mark.slow
def test_a_distributed_checkpoint_falls_to_the_stores_compressed_copy(
        s3: Any, tmp_path: Path) -> None:
    """Saved by 4 gloo ranks, uploaded compressed: a chunk flipped on disk is
    read from the store's frames, whole and as a box (the records a
    resharding asks for, and the raw spans of them)."""
    from dist_support import full_tensors, ok, run_job

    from fastpersist.distributed import restore
    from fastpersist.loading.load import source_for
    from fastpersist.storage import dirs
    from fastpersist.tier.client import S3
    from fastpersist.tier.upload import upload_checkpoint
    from fastpersist.tier.url import TierURL

    ckpt = tmp_path / "ckpt"
    ok(run_job(tmp_path, "save", ["n0", "n0", "n1", "n1"],
               {"path": str(ckpt), "dp": 2, "tp": 2}))
    url = TierURL.parse(s3.url).child("dist")
    fd = os.open(ckpt, dirs.DIR_FLAGS)
    try:
        upload_checkpoint(S3(), fd, str(ckpt), url, "zstd")
    finally:
        os.close(fd)
    m = disk_manifest(ckpt)
    assert m.globals is not None
    for name in ("model.big", "model.embed"):  # embed: in row 11 (of 256 float32s)
        g = next(g for g in m.globals if g.name == name)
        first = next(c for c in g.chunks if not any(c.offsets))
        flip(ckpt, m, tensor=m.tensors[first.tensor].name, at=11 * 1024 + 8)
    with pytest.warns(RuntimeWarning, match="disk failed .*reading it from the object store"):
        loaded = fastpersist.load(ckpt, tier=str(url))
    assert torch.equal(loaded["model"]["big"], full_tensors()["big"])
    assert torch.equal(loaded["model"]["embed"], full_tensors()["embed"])
    index = next(i for i, g in enumerate(m.globals) if g.name == "model.embed")
    with pytest.warns(RuntimeWarning, match="reading it from the object store"):
        box = restore.read_boxes(source_for(ckpt, tier=str(url), daemon=""), m,
                                 {index: ((10, 0), (3, 256))}, verify=True)[index]
    assert torch.equal(box, full_tensors()["embed"][10:13])


def test_progress_counts_bytes_read_again_once(tmp_path: Path, s3: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Files read from disk before the corrupt one are read again from the
    store: the caller's progress is not told of them twice."""
    monkeypatch.setenv("FASTPERSIST_FILE_BYTES", str(256 << 10))
    ck = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url)
    ck.save(1, state(1))
    assert ck.wait_for_tier(60)
    ck.close()
    path = ck.path_for(1)
    m = disk_manifest(path)
    by_name = {r.name: r.file for r in m.tensors}
    assert [f.name for f in m.files].index(by_name["w"]) > [f.name for f in m.files].index(
        by_name["a"])  # "a"'s file is read (and counted) before "w"'s fails
    flip(path, m, tensor="w", at=8)
    shown: list[int] = []
    with pytest.warns(RuntimeWarning, match=f"disk failed .*{by_name['w']}"):
        out = fastpersist.load(path, tier=f"{s3.url}/{path.name}", progress=shown.append)
    assert digests(out) == digests(state(1))
    assert sum(shown) == m.tensor_bytes, (sum(shown), m.tensor_bytes)


@pytest.mark.slow
def test_load_latest_through_a_daemon_reads_its_tier_for_a_lost_run(node: Daemon,
                                                                    s3: Any) -> None:
    """A node's run directory lost: a Checkpointer through the daemon (no
    tier of its own) finds the newest step in the daemon's --tier."""
    import shutil

    ck = fastpersist.Checkpointer(node.root / "run", daemon=node.address)
    for step in (1, 2):
        ck.save(step, state(step)).result()
    ck.close()
    until("both uploaded", lambda: {f"ckpts/run/{ck.path_for(s).name}/manifest.json"
                                    for s in (1, 2)} <= set(keys(s3.client, s3.bucket)))
    shutil.rmtree(node.root / "run")
    again = fastpersist.Checkpointer(node.root / "run", daemon=node.address)
    assert again.latest() == f"{s3.url}/run/{ck.path_for(2).name}"
    assert digests(again.load_latest()) == digests(state(2))
    again.close()


def test_the_error_of_the_last_copy_lists_every_copy(tmp_path: Path) -> None:
    """A Chain whose copies all fail to open: the last one's error, of its
    class (an OSError's errno kept), naming each copy and why; a copy that
    is not there is said so, and is not the error raised."""
    import errno

    from fastpersist.errors import CheckpointIOError
    from fastpersist.loading.chain import Chain, Copy, NoCopy, Opened

    def raising(exc: Exception) -> Callable[[], Opened]:
        def open_() -> Opened:
            raise exc
        return open_

    where = str(tmp_path / "step-1")
    chain = Chain(where, [
        Copy("disk", "disk", raising(CorruptCheckpointError(f"{where}: a bad manifest"))),
        Copy("the copy on peer p1", "peer", raising(CheckpointIOError(errno.EIO, "p1: EIO"))),
        Copy("the object store's copy", "s3", raising(NoCopy("no --tier"))),
    ])
    with pytest.raises(CheckpointIOError) as raised:
        chain.manifest()
    assert raised.value.errno == errno.EIO
    assert raised.value.strerror == (f"{where}: no copy could be read (disk: a bad manifest; "
                                     "the copy on peer p1: p1: EIO; not there: the object "
                                     "store's copy (no --tier))")


def test_load_latest_passes_over_a_corrupt_step_the_store_does_not_hold(
        tmp_path: Path, s3: Any) -> None:
    """The newest step corrupt here and not in the store (its upload not
    finished: the manifest written last is not there): passed over as before,
    the older step loaded, not a CheckpointNotFoundError from the store."""
    ck = fastpersist.Checkpointer(tmp_path / "run", tier=s3.url)
    for step in (1, 2):
        ck.save(step, state(step))
    assert ck.wait_for_tier(60)
    name = ck.path_for(2).name
    s3.client.delete_object(Bucket=s3.bucket, Key=f"ckpts/{name}/manifest.json")
    flip(ck.path_for(2), disk_manifest(ck.path_for(2)))
    assert digests(ck.load_latest()) == digests(state(1))
    assert [s.path for s in ck.skipped] == [ck.path_for(2)]
    assert "not there: the object store's copy" in ck.skipped[0].reason
    ck.close()


@pytest.mark.slow
def test_a_store_that_is_down_is_tried_and_named(tmp_path: Path, s3: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk corrupt and the store unreachable (nothing listens at its
    endpoint): the store's error is raised (the last copy's), naming the
    disk's corruption too; nothing waits beyond the client's bounded tries."""
    from tier_support import free_port

    from fastpersist.errors import TierError

    path = tmp_path / "step-1"
    fastpersist.save(state(1), path)
    flip(path, disk_manifest(path))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TierError) as raised:
        fastpersist.load(path, tier=f"{s3.url}/step-1")
    message = str(raised.value)
    assert message.startswith(f"{path}: no copy could be read (disk: tensor 'w'"), message
    assert f"the object store's copy {s3.url}/step-1: " in message


def test_fpctl_ls_with_a_stopped_daemon_shows_the_disk(daemon: Daemon,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    fastpersist.save(state(1), daemon.root / "step-1", daemon=daemon.address)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        capsys.readouterr()
        assert fpctl(["ls", str(daemon.root), "--daemon", daemon.address, "--json"]) == 0
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    out, err = capsys.readouterr()
    assert [r["copies"] for r in json.loads(out)] == [["disk"]]
    assert "copies in fastpersistd's memory not shown" in err and "not answering" in err
