"""Peer replication between real fastpersistd processes on TCP (issue 35, items 2 and 3).

Every daemon has its own root and --shm-dir, serves TLS with the group's
token (tests/peer_support.py), and is told its peers with --peer. A sender
with --replicas R sends each committed checkpoint to R of them, outside its
failure domain first; a reader (fastpersist/tensors/peer_read.py) loads a
replica with every CRC32C checked.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tls_support
import torch
from grpc import StatusCode as Code
from peer_support import MIB, Node, PeerGroup, chunks, flip_byte, header_of, peer_group, wait_for

import fastpersist
from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.cli import main as fpctl
from fastpersist.daemon import peers
from fastpersist.errors import ChecksumMismatchError
from fastpersist.format.manifest import MANIFEST_NAME, Manifest
from fastpersist.loading.load import load_from
from fastpersist.tensors import peer_read


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerGroup]:
    yield from peer_group(tmp_path, monkeypatch)


def save(node: Node, name: str, state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch,
         **kw: object) -> Path:
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(node.daemon.shm_dir))
    target = node.daemon.root / name
    fastpersist.save(state, target, daemon=node.daemon.address, **kw)  # type: ignore[arg-type]
    return target


def state_of(seed: int, mib: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * MIB) // 4
    return {"w": torch.randn(n, generator=g), "b": torch.arange(1000, dtype=torch.int64) + seed,
            "h": torch.randn(3, 5, generator=g).half()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.decode().splitlines())
            if name and not name.startswith("#")}


def replicated(sender: Node, path: str, copies: int = 1) -> dict[str, object]:
    return wait_for(f"{path} replicated", lambda: next(
        (e for e in sender.daemon.events("replicated") if e["path"] == path
         and len(e["peers"]) >= copies), None))  # type: ignore[no-any-return]


@pytest.mark.slow
def test_replicates_to_r_peers_outside_the_failure_domain_first(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ports = [tls_support.free_port() for _ in range(2)]
    same = group.add("n1", "rack-a", "--replica-bytes", "64M")
    other_b = group.add("n2", "rack-b", "--replica-bytes", "64M",
                        "--metrics-listen", f"127.0.0.1:{ports[1]}")
    other_c = group.add("n3", "rack-c", "--replica-bytes", "64M")
    sender = group.add("n0", "rack-a", "--replicas", "2", "--metrics-listen",
                       f"127.0.0.1:{ports[0]}", peers=[same, other_b, other_c])
    save(sender, "step-1", state_of(1), monkeypatch)
    event = replicated(sender, "step-1", 2)
    assert sorted(event["peers"]) == ["n2", "n3"]  # type: ignore[arg-type]
    size = sum(p.stat().st_size for p in (sender.daemon.root / "step-1").glob("data-*"))
    sent, received = metrics(ports[0]), metrics(ports[1])
    assert sent['fastpersist_replication_bytes_total{direction="sent"}'] == 2 * size
    assert received['fastpersist_replication_bytes_total{direction="received"}'] == size
    assert sent["fastpersist_replication_lag_seconds_count"] == 1
    assert sent["fastpersist_replication_lag_seconds_sum"] > 0
    assert sent['fastpersist_replication_copies_bucket{le="1.0"}'] == 0
    assert sent['fastpersist_replication_copies_bucket{le="2.0"}'] == 1
    assert sent["fastpersist_replication_same_domain_total"] == 0
    assert sent["fastpersist_replication_pending"] == 0
    manifest_bytes = (sender.daemon.root / "step-1" / "manifest.json").stat().st_size
    assert received["fastpersist_replica_bytes"] == size + manifest_bytes  # both held in memory
    assert received["fastpersist_replicas_held"] == 1
    assert other_b.complete() == other_c.complete() == [("n0", "step-1")]
    assert same.replicas() == []
    assert not sender.daemon.events("replication-same-domain")
    info = sender.daemon.client().info()
    assert (info.node_name, info.failure_domain, info.job, info.replicas) == \
        ("n0", "rack-a", "job-1", 2)
    assert sorted(info.peers) == sorted([same.target, other_b.target, other_c.target])
    held = other_b.daemon.client().info()
    assert held.replicas_held == 1 and held.replica_bytes > MIB
    monkeypatch.setenv("FASTPERSIST_DAEMON", other_b.daemon.address)
    assert fpctl(["daemon", "status", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["replication"]
    assert (shown["node"], shown["failure_domain"], shown["held"], shown["held_bytes"]) == (
        "n2", "rack-b", 1, size + manifest_bytes)

    # With one other rack down, the second copy goes to the sender's own rack, and says so.
    other_c.daemon.kill()
    save(sender, "step-2", state_of(2), monkeypatch)
    event = replicated(sender, "step-2", 2)
    assert sorted(event["peers"]) == ["n1", "n2"]  # type: ignore[arg-type]
    assert [e["peer"] for e in sender.daemon.events("replication-same-domain")] == [same.target]
    assert ("n0", "step-2") in same.complete()


@pytest.mark.slow
def test_a_peer_source_loads_bit_exact_with_the_local_files_gone(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = group.add("n1", "b", "--replica-bytes", "64M")
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    raw, packed = state_of(3), state_of(4)
    for name, state, kw in (("step-1", raw, {}), ("step-2", packed, {"compression": "zstd"})):
        target = save(sender, name, state, monkeypatch, **kw)
        replicated(sender, name)
        for p in target.iterdir():  # the node's disk is gone
            p.unlink()
        target.rmdir()
        source, why = peer_read.find([holder.address], name, node="n0")
        assert source is not None, why
        assert_same(load_from(source), state)
    step2 = next(r for r in peer_read.replicas(holder.address) if r.path == "step-2")
    assert any(t.frames for t in Manifest.from_json(step2.manifest, "step-2").tensors)
    assert peer_read.find([holder.address], "step-9")[0] is None


@pytest.mark.slow
def test_a_checkpointer_on_a_node_whose_disk_is_gone_resumes_from_its_peers(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointer.latest()/load_latest() through a daemon whose root lost
    the run: the newest step the peers hold whole, read from them."""
    holder = group.add("n1", "b", "--replica-bytes", "64M")
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    monkeypatch.setenv("FASTPERSIST_SHM_DIR", str(sender.daemon.shm_dir))
    run = sender.daemon.root / "run"
    with fastpersist.Checkpointer(run, daemon=sender.daemon.address) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state_of(step)).result()
    replicated(sender, "run/step-00000002")
    shutil.rmtree(run)  # the node's disk is gone
    again = fastpersist.Checkpointer(run, daemon=sender.daemon.address)
    try:
        assert again.latest() == run / "step-00000002"
        with pytest.warns(RuntimeWarning, match="reading it from the peers' replicas"):
            assert_same(again.load_latest(), state_of(2))
    finally:
        again.close()


@pytest.mark.slow
def test_a_replica_with_wrong_bytes_is_caught_by_the_crc(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = group.add("n1", "b", "--replica-bytes", "64M")
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    save(sender, "step-1", state_of(5), monkeypatch)
    replicated(sender, "step-1")
    (directory,) = holder.replica_dirs()
    manifest = Manifest.from_json((sender.daemon.root / "step-1" / MANIFEST_NAME).read_bytes(),
                                  "m")
    w = next(t for t in manifest.tensors if t.name == "w")
    flip_byte(directory / w.file, w.offset + w.length // 2)
    source, why = peer_read.find([holder.address], "step-1")
    assert source is not None, why
    with pytest.raises(ChecksumMismatchError) as info:
        load_from(source)
    assert info.value.tensor == "w" and info.value.file == w.file
    flip_byte(directory / w.file, w.offset + w.length // 2)  # mended: it loads again
    flip_byte(directory / w.file, 3)  # the header's length field
    with pytest.raises(ChecksumMismatchError) as info:
        load_from(source)
    assert info.value.tensor == "<header>"


def _replicate(node: Node, messages: Iterator[pb.ReplicaChunk], token: str | None = ""
               ) -> grpc.RpcError:
    with node.channel(token) as ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.FastPersistStub(ch).Replicate(messages, timeout=60)
    return info.value  # type: ignore[no-any-return]


@pytest.mark.slow
def test_refused_replicas(group: PeerGroup, monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> None:
    """Wrong job, wrong token, escaping path, wrong CRC, over the budget or no budget:
    each refused with its code, and nothing left behind."""
    holder = group.add("n1", "b", "--replica-bytes", "3M")
    unbudgeted = group.add("n2", "b")
    local = group.add("n0", "a")
    ck = save(local, "step-1", state_of(6), monkeypatch)
    header, blobs = header_of(ck)
    bad_job, _ = header_of(ck, job="job-2")
    escaping, _ = header_of(ck, path="../outside")
    cases = [
        (holder, chunks(bad_job, blobs), "", Code.PERMISSION_DENIED, "job"),
        (holder, chunks(header, blobs), "not-the-token", Code.UNAUTHENTICATED, "token"),
        (holder, chunks(header, blobs), None, Code.UNAUTHENTICATED, "token"),
        (holder, chunks(escaping, blobs), "", Code.INVALID_ARGUMENT, ".."),
        (holder, chunks(header, blobs, corrupt_at=0), "", Code.DATA_LOSS, "CRC32C"),
        (unbudgeted, chunks(header, blobs), "", Code.RESOURCE_EXHAUSTED, "--replica-bytes 0"),
    ]
    for node, messages, token, code, text in cases:
        error = _replicate(node, messages, token)
        assert error.code() == code and text in (error.details() or ""), error
    big = save(local, "step-2", state_of(7, mib=4), monkeypatch)
    error = _replicate(holder, chunks(*header_of(big)))
    assert error.code() == Code.RESOURCE_EXHAUSTED and "over --replica-bytes" in (
        error.details() or "")
    assert holder.replicas() == [] and holder.replica_dirs() == []
    # The budget holds the manifest too: room for the data files alone is not enough.
    data = sum(p.stat().st_size for p in ck.glob("data-*"))
    tight = group.add("n3", "b", "--replica-bytes", str(data))
    error = _replicate(tight, chunks(header, blobs))
    assert error.code() == Code.RESOURCE_EXHAUSTED and "(its data files and manifest) is over" \
        in (error.details() or ""), error
    assert tight.replicas() == [] and tight.replica_dirs() == []

    # A daemon of another job, or with another token, replicates nothing to it.
    other = tmp_path / "other-token"
    other.write_text("another-token\n")
    for job, token in (("job-2", None), ("job-1", other)):
        sender = group.add(f"s-{job}-{token is None}", "a", "--replicas", "1", peers=[holder],
                           job=job, token=token)
        save(sender, "step-1", state_of(8), monkeypatch)
        wait_for("the peer skipped", lambda s=sender: s.daemon.events("replication-short"))
    assert holder.replicas() == []


RAW_SENDER = r"""
import sys, time, grpc
sys.path.insert(0, {tests!r})
from pathlib import Path
from peer_support import chunks, header_of
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.cli import main as fpctl
from fastpersist.daemon import peers
header, blobs = header_of(Path({ck!r}))
def messages():
    for i, m in enumerate(chunks(header, blobs, size=256 << 10)):
        if i == 3:
            print("half-way", flush=True)
            time.sleep(3600)
        yield m
creds = grpc.composite_channel_credentials(
    grpc.ssl_channel_credentials(open({cert!r}, "rb").read()),
    grpc.access_token_call_credentials(open({token!r}).read().strip()))
with grpc.secure_channel({target!r}, creds) as ch:
    pb_grpc.FastPersistStub(ch).Replicate(messages())
"""


@pytest.mark.slow
def test_a_stream_cut_off_leaves_no_visible_replica(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = group.add("n1", "b", "--replica-bytes", "64M")
    local = group.add("n0", "a")
    ck = save(local, "step-1", state_of(9), monkeypatch)
    proc = subprocess.Popen(
        [sys.executable, "-c", RAW_SENDER.format(
            tests=str(Path(__file__).parent), ck=str(ck), cert=str(group.files["cert"]),
            token=str(group.files["token"]), target=holder.target)],
        stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"half-way\n"
        arriving = wait_for("the replica arriving", holder.replicas)
        assert [(r.node, r.complete, r.manifest) for r in arriving] == [("raw", False, b"")]
        source, _ = peer_read.find([holder.address], "step-1")
        assert source is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_for("the cut-off replica gone", lambda: not holder.replicas())
    assert holder.replica_dirs() == []
    assert holder.daemon.client().info().replica_bytes == 0


@pytest.mark.slow
def test_a_stopped_or_dead_peer_does_not_block_a_save(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = group.add("n1", "b", "--replica-bytes", "64M")
    live = group.add("n2", "b", "--replica-bytes", "64M")
    dead = f"127.0.0.1:{tls_support.free_port()}"  # nobody listens
    sender = group.add("n0", "a", "--replicas", "1", "--peer", dead, peers=[stuck, live])
    assert stuck.daemon.proc is not None
    stuck.daemon.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        save(sender, "step-1", state_of(10), monkeypatch)
        assert (sender.daemon.root / "step-1" / MANIFEST_NAME).is_file()
        assert replicated(sender, "step-1")["peers"] == ["n2"]
        assert live.complete() == [("n0", "step-1")]
    finally:
        stuck.daemon.proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_the_oldest_replica_is_evicted_and_a_newer_one_replaces_its_path(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = group.add("n1", "b", "--replica-bytes", "3M")
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    for step in (1, 2, 3):
        save(sender, f"step-{step}", state_of(step), monkeypatch)
        replicated(sender, f"step-{step}")
    assert holder.complete() == [("n0", "step-2"), ("n0", "step-3")]
    assert len(holder.replica_dirs()) == 2
    assert [e["path"] for e in holder.daemon.events("replica-dropped")] == ["step-1"]
    first = next(r.manifest for r in holder.replicas() if r.path == "step-3")
    save(sender, "step-3", state_of(33), monkeypatch)  # the same path again
    wait_for("the newer step-3", lambda: any(
        r.path == "step-3" and r.complete and r.manifest != first for r in holder.replicas()))
    assert holder.complete() == [("n0", "step-2"), ("n0", "step-3")]
    source, why = peer_read.find([holder.address], "step-3")
    assert source is not None, why
    assert_same(load_from(source), state_of(33))


@pytest.mark.slow
def test_peers_from_dns(group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """--peers-dns NAME:PORT: every A record of NAME is a peer, its certificate
    checked for NAME (the test certificate's is localhost)."""
    holder = group.add("n1", "b", "--replica-bytes", "64M")
    sender = group.add("n0", "a", "--replicas", "1", "--peers-dns", f"localhost:{holder.port}")
    save(sender, "step-1", state_of(11), monkeypatch)
    assert replicated(sender, "step-1")["peers"] == ["n1"]
    assert holder.complete() == [("n0", "step-1")]
    assert list(sender.daemon.client().info().peers) == [holder.target]


def test_the_rate_limit_spaces_the_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """--replication-rate: a token bucket of one second's bytes (a fake clock)."""
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(peers.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(peers.time, "sleep", sleep)
    bucket = peers.TokenBucket(4 * MIB)
    for _ in range(4):
        bucket.take(MIB)  # the first second's burst
    assert slept == []
    for _ in range(8):
        bucket.take(MIB)
    assert sum(slept) == pytest.approx(2.0)
    peers.TokenBucket(0).take(1 << 40)  # unlimited
    assert sum(slept) == pytest.approx(2.0)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_each_node_replicates_its_own_files_of_a_node_local_job(
        group: PeerGroup, tmp_path: Path) -> None:
    """A node-local job on nodes a and b (two gloo ranks each, through each node's
    daemon): rank 0's node commits its part, b publishes its prepared part; each
    daemon sends its own node's files, which the holder keeps as (node, path)."""
    from dist_support import ok, run_job

    holder = group.add("c", "rack-c", "--replica-bytes", "256M")
    nodes = {n: group.add(n, f"rack-{n}", "--replicas", "1", peers=[holder],
                          root=tmp_path / "disks" / n) for n in ("a", "b")}
    env = {n: {"FASTPERSIST_DAEMON": d.daemon.address,
               "FASTPERSIST_SHM_DIR": str(d.daemon.shm_dir)} for n, d in nodes.items()}
    ok(run_job(tmp_path, "save", ["a", "a", "b", "b"],
               {"path": str(tmp_path / "disks" / "{node}" / "ckpt"), "node_local": True},
               env_by_node=env))
    for node in nodes.values():
        replicated(node, "ckpt")
    held = {r.node: r for r in peer_read.replicas(holder.address) if r.complete}
    assert sorted(held) == ["a", "b"]
    for n, node in nodes.items():
        ck = node.daemon.root / "ckpt"
        manifest = Manifest.from_json((ck / MANIFEST_NAME).read_bytes(), str(ck))
        mine = {f.name: f.size for f in manifest.files if f.node == n}
        assert mine and dict(held[n].files) == mine
        assert held[n].manifest == (ck / MANIFEST_NAME).read_bytes()
        source = peer_read.PeerSource(held[n])
        for f in manifest.files:
            if f.node != n:
                with pytest.raises(fastpersist.CheckpointError, match="holds no data file"):
                    source.check_file(f)
                continue
            buf = bytearray(f.size)
            source.read_ranges(f, [(memoryview(buf), 0)], checksum=False)
            assert bytes(buf) == (ck / f.name).read_bytes()


@pytest.mark.slow
def test_a_checkpoint_that_rotted_on_the_senders_disk_is_not_sent(
        group: PeerGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every span a CRC32C covers is checked as it is read for sending: a
    peer never holds a replica of bytes that do not match their manifest."""
    holder = group.add("n1", "b", "--replica-bytes", "64M", start=False)  # down for now
    sender = group.add("n0", "a", "--replicas", "1", peers=[holder])
    ck = save(sender, "step-1", state_of(12), monkeypatch)
    wait_for("a round short of its copy", lambda: sender.daemon.events("replication-short"))
    manifest = Manifest.from_json((ck / MANIFEST_NAME).read_bytes(), "m")
    w = next(t for t in manifest.tensors if t.name == "w")
    flip_byte(ck / w.file, w.offset + 12345)
    holder.daemon.start()
    (event,) = wait_for("the corruption found", lambda: sender.daemon.events(
        "replication-corrupt"), timeout=90)
    assert (event["file"], event["tensor"]) == (w.file, "w")
    assert holder.replicas() == [] and holder.replica_dirs() == []
    assert not sender.daemon.events("replicated")
