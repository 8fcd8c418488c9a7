"""Peer replication, the sending half: every committed checkpoint to R peers.

After the daemon commits a checkpoint (a save, a job it published, or its
node's prepared part of a node-local job, published), after_commit.py hands
its path to add(): that only queues it, so a save never waits for a peer.
A background thread sends the node's data files of it (those in the
directory: a node-local checkpoint's other files are on their nodes) with the
manifest to --replicas peers (peers.py: who, and in which order: outside this
node's failure domain first; a replica placed inside it is logged as
`replication-same-domain` and counted). The peers are sent to in parallel.
A peer that does not answer Info within peers.INFO_TIMEOUT, fails, or does
not finish within --replication-timeout is given up for this round and the
next one in order is tried; a round that ends with fewer than R copies is
tried again after a backoff (1 s, doubling, MAX_ROUNDS rounds), sending only
to peers that do not hold it yet; then it is given up (logged, counted).
Every span the manifest has a CRC32C for (header, tensors, frames) is
checked as it is read for sending (tier/checked.py): a checkpoint that
rotted on this disk is never sent (`replication-corrupt`, given up).
Data chunks (4 MiB, each with its CRC32C) are read into one reused buffer
and go as wire bytes written here (replica_wire.py), not through protobuf's
copies. A newer checkpoint committed at the same path takes the older one's
place in the queue. What is queued is lost with the daemon: replication is a copy for
speed, the disk (and the object store) remain the durable ones.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c
from ..errors import ManifestError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..storage import dirs
from ..tier.checked import CheckedFile, LocalCorruption
from . import logs, peers, replica_manifest, replica_wire
from .metrics import Metrics
from .paths import PathError
from .peers import Peer, PeerSettings, TokenBucket
from .rootfs import Root

# A data file to send: its descriptor, record and the records of its tensors.
File = tuple[int, FileRecord, list[TensorRecord]]

CHUNK = 4 << 20
REPLICATE = "/fastpersist.v1.FastPersist/Replicate"
MAX_ROUNDS = 6
FIRST_BACKOFF = 1.0


@dataclass
class Pending:
    relpath: str
    committed_unix: float
    done: set[str] = field(default_factory=set)  # peers' node names that hold it
    rounds: int = 0
    not_before: float = 0.0  # time.monotonic()


class Replicator:
    def __init__(self, root: Root, settings: PeerSettings, metrics: Metrics) -> None:
        self.root, self.settings, self.metrics = root, settings, metrics
        self.bucket = TokenBucket(settings.rate)
        self._cond = threading.Condition()
        self._pending: dict[str, Pending] = {}
        self._stop = False
        self._peers: list[str] = [t for t, _ in peers.resolve(settings)]
        # Sends (R at a time) and Info calls to every peer (all at once).
        self._senders = ThreadPoolExecutor(max(8, settings.replicas),
                                           thread_name_prefix="fpd-replicate")
        self._thread = threading.Thread(target=self._run, name="fpd-replication", daemon=True)

    def start(self) -> Replicator:
        self._thread.start()
        return self

    def add(self, relpath: str) -> None:
        """ROOT/relpath was committed: replicate it (in the background)."""
        with self._cond:
            self._pending[relpath] = Pending(relpath, time.time())
            self.metrics.replication_pending.set(len(self._pending))
            self._cond.notify_all()

    def status(self) -> tuple[list[str], int]:
        """(the peers last resolved, checkpoints pending)."""
        with self._cond:
            return list(self._peers), len(self._pending)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._senders.shutdown(wait=False, cancel_futures=True)

    # -- the thread ---------------------------------------------------------------

    def _next(self) -> Pending | None:
        with self._cond:
            while not self._stop:
                now = time.monotonic()
                due = [p for p in self._pending.values() if p.not_before <= now]
                if due:
                    return max(due, key=lambda p: p.committed_unix)  # newest first
                wait = min((p.not_before - now for p in self._pending.values()), default=None)
                self._cond.wait(wait)
            return None

    def _run(self) -> None:
        while (p := self._next()) is not None:
            try:
                finished = self._round(p)
            except LocalCorruption as exc:  # never sent: a peer must not hold rot
                logs.error("replication-corrupt", path=p.relpath, file=exc.file,
                           tensor=exc.tensor, error=str(exc))
                self.metrics.replication_failures.labels(reason="local-corrupt").inc()
                finished = True
            except Exception as exc:  # never dies: logged, counted, given up
                logs.error("replication-failed", path=p.relpath, error=repr(exc))
                self.metrics.replication_failures.labels(reason="error").inc()
                finished = True
            with self._cond:
                if self._pending.get(p.relpath) is not p:
                    continue  # a newer commit at the path took its place
                if finished:
                    del self._pending[p.relpath]
                else:
                    p.rounds += 1
                    if p.rounds >= MAX_ROUNDS:
                        del self._pending[p.relpath]
                        logs.error("replication-given-up", path=p.relpath, copies=len(p.done),
                                   wanted=self.settings.replicas)
                        self.metrics.replication_failures.labels(reason="given-up").inc()
                        self.metrics.replication_copies.observe(len(p.done))
                    else:
                        p.not_before = time.monotonic() + FIRST_BACKOFF * 2 ** (p.rounds - 1)
                self.metrics.replication_pending.set(len(self._pending))

    def _round(self, p: Pending) -> bool:
        """One round for p; whether it is over (done, or nothing to send)."""
        opened = self._open(p.relpath)
        if opened is None:
            return True
        header, manifest, fds = opened
        try:
            candidates = self._candidates(p)
            order, outside = peers.placement(self.settings, candidates, p.relpath)
            need = self.settings.replicas - len(p.done)
            tried = 0
            while need > 0 and tried < len(order):
                batch = order[tried:tried + need]
                tried += len(batch)
                for peer, ok in zip(batch, self._senders.map(
                        lambda q: self._send(q, header, manifest, fds), batch), strict=True):
                    if ok:
                        p.done.add(peer.node)
                        need -= 1
                        if self.settings.domain and order.index(peer) >= outside:
                            logs.warning("replication-same-domain", path=p.relpath,
                                         peer=peer.target, failure_domain=peer.domain,
                                         reason="too few peers outside this failure domain")
                            self.metrics.replication_same_domain.inc()
        finally:
            for fd, _, _ in fds:
                os.close(fd)
        if need > 0:
            logs.warning("replication-short", path=p.relpath, copies=len(p.done),
                         wanted=self.settings.replicas, round=p.rounds + 1)
            return False
        lag = time.time() - p.committed_unix
        self.metrics.replication_lag.observe(lag)
        self.metrics.replication_copies.observe(len(p.done))
        logs.info("replicated", path=p.relpath, peers=sorted(p.done), seconds=round(lag, 3))
        return True

    def _candidates(self, p: Pending) -> list[Peer]:
        found: list[Peer] = []
        resolved = peers.resolve(self.settings)
        with self._cond:
            self._peers = [t for t, _ in resolved]
        # At once: a peer that is down costs a round peers.INFO_TIMEOUT, not one each.
        answers = list(self._senders.map(lambda t: peers.identify(self.settings, *t), resolved))
        for peer, why in answers:
            if peer is None:
                logs.info("replication-peer-skipped", path=p.relpath, reason=why)
            elif peer.node not in p.done and all(q.node != peer.node for q in found):
                found.append(peer)
        return found

    def _open(self, relpath: str) -> tuple[pb.ReplicaHeader, bytes, list[File]] | None:
        """The header (without the manifest: replica_manifest.py puts it in),
        the manifest and (descriptor, size) of each data file to send; None
        when the checkpoint is gone (deleted, replaced by a directory...)."""
        parts = relpath.split("/")
        try:
            parent = self.root.open_dir(parts[:-1])
            try:
                fd = self.root.checkpoint_dir(parent, parts[-1])
            finally:
                os.close(parent)
        except (OSError, PathError) as exc:
            logs.info("replication-skipped", path=relpath, reason=str(exc))
            return None
        try:
            data = dirs.read_regular(MANIFEST_NAME, fd, MAX_MANIFEST_BYTES)
            manifest = Manifest.from_json(data, relpath)
            header = pb.ReplicaHeader(job=self.settings.job, node=self.settings.node,
                                      failure_domain=self.settings.domain, path=relpath,
                                      committed_unix=time.time())
            fds: list[File] = []
            try:
                for f in manifest.files:
                    try:
                        file_fd = os.open(f.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                          dir_fd=fd)
                    except FileNotFoundError:
                        if f.node is not None:
                            continue  # another node's file of a node-local checkpoint
                        raise
                    fds.append((file_fd, f, [t for t in manifest.tensors if t.file == f.name]))
                    header.files.add(name=f.name, size=f.size)
            except BaseException:
                for file_fd, _, _ in fds:
                    os.close(file_fd)
                raise
        except (OSError, ManifestError) as exc:
            logs.error("replication-skipped", path=relpath, reason=str(exc))
            self.metrics.replication_failures.labels(reason="unreadable").inc()
            return None
        finally:
            os.close(fd)
        return header, data, fds

    def _send(self, peer: Peer, header: pb.ReplicaHeader, manifest: bytes, fds: list[File]
              ) -> bool:
        ch = peers.channel(self.settings, peer.target)
        rot: list[LocalCorruption] = []
        inline = replica_manifest.INLINE_MAX
        try:
            # Not the stub's: data chunks go as bytes encoded here (replica_wire.py).
            replicate = ch.stream_unary(REPLICATE, request_serializer=replica_wire.encode_chunk,
                                        response_deserializer=pb.ReplicateResponse.FromString)
            while True:
                try:
                    replicate(self._chunks(header, manifest, fds, rot, inline),
                              timeout=self.settings.timeout)
                    return True
                except grpc.RpcError as exc:
                    if rot or inline != replica_manifest.INLINE_MAX \
                            or len(manifest) > replica_manifest.OLD_INLINE_MAX \
                            or not replica_manifest.older_peer_refused(exc, len(manifest), inline):
                        raise
                # An older peer: once more, the manifest in the header, as it takes it.
                logs.info("replication-older-peer", path=header.path, peer=peer.target,
                          manifest_bytes=len(manifest))
                inline = replica_manifest.OLD_INLINE_MAX
        except grpc.RpcError as exc:
            if rot:  # gRPC cancelled the call for it: the reason is ours
                raise rot[0] from None
            error = (exc.details() or "")[:500]
            if replica_manifest.older_peer_refused(exc, len(manifest), inline):
                error += f" ({replica_manifest.OLD_PEER_HINT})"
            logs.warning("replication-attempt-failed", path=header.path, peer=peer.target,
                         code=exc.code().name, error=error)
            self.metrics.replication_failures.labels(reason="attempt").inc()
            return False
        finally:
            ch.close()

    def _chunks(self, header: pb.ReplicaHeader, manifest: bytes, fds: list[File],
                rot: list[LocalCorruption], inline: int) -> Iterator[pb.ReplicaChunk | bytes]:
        """The header and the manifest (replica_manifest.py), then each file
        in order, every span a CRC32C covers checked against the manifest as
        it is read (tier/checked.py: a file that rotted on this disk is not
        sent). A data chunk is read into one buffer, reused, and goes encoded
        (its one copy: replica_wire.py)."""
        yield from replica_manifest.header_and_parts(header, manifest, inline)
        buf = memoryview(bytearray(CHUNK))
        for index, (fd, f, records) in enumerate(fds):
            try:
                checked = CheckedFile(fd, f, records, header.path)
                offset = 0
                while offset < f.size:
                    n = min(CHUNK, f.size - offset)
                    data = buf[:n]
                    checked.read_into(offset, data)
                    self.bucket.take(n)
                    yield replica_wire.encode_data(index, offset, data, crc32c(data))
                    self.metrics.replication_bytes.labels(direction="sent").inc(n)
                    offset += n
            except LocalCorruption as exc:
                rot.append(exc)
                raise
