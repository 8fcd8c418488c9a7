"""Peer daemons for the replication tests: real fastpersistd processes on TCP
(TLS, one token for the job), each with its own root and --shm-dir, and a
raw Replicate client that sends what a test wants (wrong job, wrong CRC, a
stream that stops half-way).

    group = PeerGroup(tmp_path)
    a = group.add("n0", "rack-a", "--replicas", "2", peers=[b, c])  # peers added earlier
    group.start_all()
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import tls_support
from daemon_raw import close_remote_savers
from daemon_support import Daemon

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist._proto import fastpersist_pb2_grpc as pb_grpc
from fastpersist.checksum import crc32c
from fastpersist.format.manifest import MANIFEST_NAME, Manifest

MIB = 1 << 20
REPLICA_PREFIX = "fastpersistd-replica-"


class Node:
    def __init__(self, daemon: Daemon, name: str, port: int, files: dict[str, Path]) -> None:
        self.daemon, self.name, self.port, self.files = daemon, name, port, files

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"https://{self.target}"

    def replicas(self) -> list[pb.ReplicaInfo]:
        with self.channel() as ch:
            return list(pb_grpc.FastPersistStub(ch).Replicas(pb.ReplicasRequest(),
                                                             timeout=30).replicas)

    def complete(self) -> list[tuple[str, str]]:
        return sorted((r.node, r.path) for r in self.replicas() if r.complete)

    def replica_dirs(self) -> list[Path]:
        return sorted(p for p in self.daemon.shm_dir.iterdir()
                      if p.name.startswith(REPLICA_PREFIX))

    def channel(self, token: str | None = "", cert: Path | None = None) -> grpc.Channel:
        """token "": the group's; None: none."""
        files = self.files
        creds = grpc.ssl_channel_credentials(files["cert"].read_bytes())
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(
                token or files["token"].read_text().strip()))
        return grpc.secure_channel(self.target, creds, [("grpc.use_local_subchannel_pool", 1),
                                                        ("grpc.max_send_message_length", -1)])


def peer_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PeerGroup]:
    """The body of a test module's `group` fixture: a PeerGroup whose TLS CA and
    token this process's clients use (no proxy in the way), and every
    daemon and remote saver closed after the test."""
    for var in ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    g = PeerGroup(tmp_path)
    monkeypatch.setenv("FASTPERSIST_DAEMON_CA_FILE", str(g.files["cert"]))
    monkeypatch.setenv("FASTPERSIST_DAEMON_TOKEN_FILE", str(g.files["token"]))
    try:
        yield g
    finally:
        close_remote_savers()
        g.cleanup()


class PeerGroup:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.files = tls_support.server_files(tmp_path)
        self.nodes: list[Node] = []

    def add(self, name: str, domain: str, *args: str, peers: Sequence[Node] = (),
            job: str = "job-1", token: Path | None = None, start: bool = True,
            root: Path | None = None) -> Node:
        port = tls_support.free_port()
        (self.tmp / name).mkdir(parents=True, exist_ok=True)
        peer_args = [a for p in peers for a in ("--peer", p.target)]
        daemon = Daemon(self.tmp / name, "--listen", f"127.0.0.1:{port}",
                        "--tls-cert", str(self.files["cert"]), "--tls-key", str(self.files["key"]),
                        "--token-file", str(token or self.files["token"]),
                        "--peer-tls-ca", str(self.files["cert"]),
                        "--node-name", name, "--failure-domain", domain, "--job", job,
                        *peer_args, *args, root=root)
        node = Node(daemon, name, port, self.files)
        self.nodes.append(node)
        if start:
            daemon.start()
        return node

    def cleanup(self) -> None:
        for n in self.nodes:
            n.daemon.cleanup()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def header_of(checkpoint: Path, *, node: str = "raw", job: str = "job-1",
              path: str | None = None) -> tuple[pb.ReplicaHeader, list[bytes]]:
    """A Replicate header of the committed checkpoint directory, and its files' bytes."""
    manifest = (checkpoint / MANIFEST_NAME).read_bytes()
    m = Manifest.from_json(manifest, str(checkpoint))
    header = pb.ReplicaHeader(job=job, node=node, failure_domain="x",
                              path=path if path is not None else checkpoint.name,
                              manifest=manifest, committed_unix=time.time())
    blobs = []
    for f in m.files:
        header.files.add(name=f.name, size=f.size)
        blobs.append((checkpoint / f.name).read_bytes())
    return header, blobs


def chunks(header: pb.ReplicaHeader, blobs: list[bytes], size: int = MIB,
           corrupt_at: int | None = None) -> Iterator[pb.ReplicaChunk]:
    """The header, then every file in `size` chunks; corrupt_at: the chunk
    (counted from 0 over all files) whose first byte is flipped after its CRC."""
    yield pb.ReplicaChunk(header=header)
    k = 0
    for i, blob in enumerate(blobs):
        for off in range(0, len(blob), size):
            data = bytearray(blob[off:off + size])
            crc = crc32c(bytes(data))
            if k == corrupt_at:
                data[0] ^= 0xFF
            yield pb.ReplicaChunk(data=pb.ReplicaData(file=i, offset=off, data=bytes(data),
                                                      crc32c=crc))
            k += 1


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
