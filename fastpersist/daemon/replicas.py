"""Replicas this daemon holds for other nodes (the receiving half of peer replication).

A peer daemon sends a checkpoint it committed (Replicate: a header, then
each data file's bytes in order, every chunk with its CRC32C; replication.py
is the sender). The replica is kept in memory: a directory of its own in
--shm-dir ("fastpersistd-replica-HEX", flocked for the daemon's life, as the
memory tier's copies are) holding each data file byte for byte.

Identity: a replica is keyed by (node, path) and holds the manifest's bytes,
in memory and as manifest.json beside the data files (ReadReplica serves it);
one over 16 MiB (replica_manifest.INLINE_MAX) only in that file, so that a
large manifest is not held twice and the Replicas reply stays small.
It is visible (listed as complete, served by ReadReplica) only once every
file arrived whole and every chunk's CRC32C matched; a stream that breaks
off, or any refused chunk, removes what arrived, and nothing of it was ever
visible. A newer complete replica of the same (node, path) replaces the
older one.

Budget: --replica-bytes for all replicas, complete and arriving, each its
data files and its manifest.json. A replica's size is reserved from its
header; the oldest complete replicas are evicted
to make room (before a byte of the new one is written), the one of the
same (node, path) that the new one will replace first; what does not fit
beside the replicas still arriving is refused (RESOURCE_EXHAUSTED), as is
every replica when the budget is 0. A replica's files are only unlinked,
never rewritten: a ReadReplica that opened them before an eviction reads
the same bytes to its end.

Refused: a sender of another --job (PERMISSION_DENIED), names that are not
plain names, counts and sizes over the limits, chunks out of order
(INVALID_ARGUMENT), a chunk whose bytes do not match its CRC32C (DATA_LOSS).

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c
from ..errors import ManifestError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage import dirs
from ..storage.names import component_problem
from . import logs
from .metrics import Metrics
from .paths import PathError, parse
from .replica_manifest import INLINE_MAX
from .replica_wire import Data
from .requests import MAX_FILES, MAX_ID_BYTES, RequestError, invalid

REPLICA_PREFIX = "fastpersistd-replica-"
REPLICA_NAME = re.compile(r"^fastpersistd-replica-[0-9a-f]{1,64}$")
MAX_CHUNK = 4 << 20  # a data chunk's bytes (the sender sends 4 MiB ones)
MAX_FILE_NAME = 255


@dataclass
class Replica:
    node: str
    path: str
    manifest: bytes
    domain: str
    committed_unix: float
    files: list[tuple[str, int]]
    name: str = ""  # its directory in --shm-dir
    fd: int = -1
    size: int = 0  # its data files' bytes
    # What it holds of --replica-bytes: its data files and its manifest.json
    # (a 405B job's manifest is hundreds of MB, in the same memory).
    footprint: int = 0
    complete: bool = False
    received: int = 0  # bytes so far
    fds: dict[str, int] = field(default_factory=dict)
    digest: bytes = b""
    manifest_len: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return self.node, self.path

    @property
    def sha256(self) -> bytes:
        if not self.digest:  # once: a manifest may be up to 1 GiB
            self.digest = hashlib.sha256(self.manifest).digest()
        return self.digest

    @property
    def inline(self) -> bool:
        """Whether its manifest is held in memory (listed whole by Replicas);
        a larger one only in its file, read with ReadReplica."""
        return self.manifest_len <= INLINE_MAX


def _check_header(h: pb.ReplicaHeader, manifest_data: bytes, job: str
                  ) -> list[tuple[str, int]]:
    """The header's files, or RequestError."""
    if h.job != job:
        raise RequestError("PERMISSION_DENIED",
                           f"this fastpersistd keeps replicas of job {job!r} only; the sender "
                           f"is of job {h.job[:80]!r} (--job)")
    if not h.node or len(h.node) > MAX_ID_BYTES or any(ord(c) < 32 for c in h.node):
        raise invalid(f"a replica's node is 1 to {MAX_ID_BYTES} printable characters")
    if len(h.failure_domain) > MAX_ID_BYTES:
        raise invalid(f"a failure domain is at most {MAX_ID_BYTES} characters")
    try:
        parse(h.path)
    except PathError as exc:
        raise invalid(f"replica path: {exc}") from None
    try:
        manifest = Manifest.from_json(manifest_data, f"the replica of {h.path[:80]!r}")
    except ManifestError as exc:
        raise invalid(f"a replica's manifest must be a valid one: {exc}"[:500]) from None
    if not h.files or len(h.files) > MAX_FILES:
        raise invalid(f"a replica holds 1 to {MAX_FILES} data files, not {len(h.files)}")
    sizes = {f.name: f.size for f in manifest.files}
    seen: set[str] = set()
    for f in h.files:
        problem = component_problem(f.name) if len(f.name) <= MAX_FILE_NAME else "too long"
        if problem or f.name.startswith(".") or f.name in seen or f.name == MANIFEST_NAME:
            raise invalid(f"replica file {f.name[:80]!r} is not a plain, new name")
        if sizes.get(f.name) != f.size:
            raise invalid(f"replica file {f.name[:80]!r}: {f.size} bytes, not the manifest's")
        seen.add(f.name)
    return [(f.name, f.size) for f in h.files]


class ReplicaStore:
    """The replicas; thread-safe (its own lock)."""

    def __init__(self, shm_dir: Path, budget: int, job: str, metrics: Metrics) -> None:
        self.budget, self.job, self.metrics = budget, job, metrics
        self.shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._held: OrderedDict[tuple[str, str], Replica] = OrderedDict()  # oldest first
        self._arriving: set[int] = set()  # id() of replicas being received
        self._all: dict[int, Replica] = {}
        self._used = 0

    def usage(self) -> tuple[int, int]:
        """(bytes held or arriving, complete replicas held)."""
        with self._lock:
            return self._used, len(self._held)

    # -- receiving ------------------------------------------------------------

    def receive(self, header: pb.ReplicaHeader, manifest: bytes, chunks: Iterator[Data],
                kept: Callable[[], None] = lambda: None) -> Replica:
        """Receive one replica (Replicate: its header, its manifest, in the header
        or after it, replica_manifest.py); it is visible when this returns.
        kept() is called once the manifest is checked and in its file (counted
        in --replica-bytes), before the data: a large one is then no longer
        in the daemon's memory, and the call gives back its room for it."""
        if self.budget <= 0:
            raise RequestError("RESOURCE_EXHAUSTED",
                               "this fastpersistd keeps no replicas for other nodes "
                               "(--replica-bytes 0)")
        files = _check_header(header, manifest, self.job)
        size = sum(s for _, s in files)
        r = Replica(header.node, header.path, manifest, header.failure_domain,
                    header.committed_unix, files, size=size, footprint=size + len(manifest))
        self._reserve(r)
        try:
            r.name = REPLICA_PREFIX + secrets.token_hex(12)
            os.mkdir(r.name, 0o750, dir_fd=self.shm_fd)
            r.fd = dirs.open_dir(r.name, self.shm_fd)
            fcntl.flock(r.fd, fcntl.LOCK_EX)
            self._write_manifest(r)
            r.manifest_len, r.digest = len(manifest), hashlib.sha256(manifest).digest()
            del manifest  # (the caller passes its only reference)
            if not r.inline:
                r.manifest = b""  # not held twice: ReadReplica serves its file
            kept()
            self._write(r, chunks)
        except BaseException:
            self._discard(r)
            raise
        self._publish(r)
        return r

    def _reserve(self, r: Replica) -> None:
        victims = []
        with self._lock:
            if r.footprint > self.budget:
                raise RequestError("RESOURCE_EXHAUSTED",
                                   f"a replica of {r.footprint} bytes (its data files and "
                                   "manifest) is over --replica-bytes "
                                   f"({self.budget})")
            # The replica this one replaces goes first: it is of a checkpoint
            # its node has replaced already.
            if self._used + r.footprint > self.budget and r.key in self._held:
                victims.append(self._held.pop(r.key))
                self._used -= victims[-1].footprint
            while self._used + r.footprint > self.budget and self._held:
                victims.append(self._held.popitem(last=False)[1])
                self._used -= victims[-1].footprint
            if self._used + r.footprint > self.budget:
                self._used_gauges()
                raise RequestError("RESOURCE_EXHAUSTED",
                                   f"replicas arriving hold {self._used} of --replica-bytes "
                                   f"({self.budget}); no room for {r.footprint} bytes")
            self._used += r.footprint
            self._all[id(r)] = r
        self._remove(victims, "evicted")  # before a byte of the new one is written

    def _write(self, r: Replica, chunks: Iterator[Data]) -> None:
        index, offset = 0, 0
        order = r.files

        def skip_empty() -> None:
            nonlocal index
            while index < len(order) and order[index][1] == offset == 0:
                self._open_file(r, order[index][0])
                index += 1

        skip_empty()
        for chunk in chunks:
            data = chunk.data  # a view of the message grpcio received (replica_wire.py)
            n = len(data)
            if index >= len(order):
                raise invalid("a replica's chunks go past its last file")
            name, size = order[index]
            if chunk.file != index or chunk.offset != offset or not 0 < n <= MAX_CHUNK \
                    or offset + n > size:
                raise invalid(f"replica {r.path[:80]!r}: expected file {index} at {offset}, "
                              f"got file {chunk.file} at {chunk.offset} ({n} bytes)")
            if crc32c(data) != chunk.crc32c:
                self.metrics.replication_failures.labels(reason="received-crc").inc()
                raise RequestError("DATA_LOSS", f"replica {r.path[:80]!r}: file {name} at "
                                                f"{offset}: the chunk's CRC32C does not match")
            fd = r.fds.get(name) if offset else self._open_file(r, name)
            assert fd is not None
            os.pwrite(fd, data, offset)
            offset += n
            r.received += n
            self.metrics.replication_bytes.labels(direction="received").inc(n)
            if offset == size:
                index, offset = index + 1, 0
                skip_empty()
        if index < len(order):
            raise invalid(f"replica {r.path[:80]!r}: the stream ended at file {index} of "
                          f"{len(order)}, {r.received} of {r.size} bytes")

    def _write_manifest(self, r: Replica) -> None:
        """The manifest beside the data files: ReadReplica serves it, for a
        manifest too large for the Replicas reply (tensors/peer_manifest.py)."""
        fd = self._open_file(r, MANIFEST_NAME)
        view = memoryview(r.manifest)
        while view:
            view = view[os.write(fd, view):]

    def _open_file(self, r: Replica, name: str) -> int:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o640, dir_fd=r.fd)
        r.fds[name] = fd
        return fd

    def _publish(self, r: Replica) -> None:
        for fd in r.fds.values():
            os.close(fd)
        r.fds.clear()
        victims = []
        with self._lock:
            self._all.pop(id(r), None)
            old = self._held.pop(r.key, None)
            if old is not None:
                self._used -= old.footprint
                victims.append(old)
            r.complete = True
            self._held[r.key] = r
        self._remove(victims, "replaced")
        logs.info("replica-received", node=r.node, path=r.path, bytes=r.size,
                  failure_domain=r.domain)

    def _discard(self, r: Replica) -> None:
        for fd in r.fds.values():
            os.close(fd)
        r.fds.clear()
        with self._lock:
            if self._all.pop(id(r), None) is not None:
                self._used -= r.footprint
        self._remove([r], "incomplete")

    # -- serving ---------------------------------------------------------------

    def listing(self) -> list[Replica]:
        with self._lock:
            return [*self._held.values(), *self._all.values()]

    def open_files(self, node: str, path: str, sha256: bytes, names: set[str]
                   ) -> dict[str, tuple[int, int]]:
        """name -> (descriptor, size) of the complete replica's files `names`
        (the caller closes them); RequestError NOT_FOUND if it holds none."""
        with self._lock:
            r = self._held.get((node, path))
            if r is None or r.sha256 != sha256:
                raise RequestError("NOT_FOUND", f"this fastpersistd holds no complete replica "
                                                f"of {path[:80]!r} of node {node[:80]!r} "
                                                "with that manifest")
            sizes = {**dict(r.files), MANIFEST_NAME: r.manifest_len}
            unknown = names - sizes.keys()
            if unknown:
                raise RequestError("NOT_FOUND", f"the replica holds no data file "
                                                f"{sorted(unknown)[0][:80]!r}")
            out: dict[str, tuple[int, int]] = {}
            try:  # under the lock: an eviction unlinks after, and the descriptors live on
                for name in names:
                    out[name] = (os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                         dir_fd=r.fd), sizes[name])
            except OSError:
                for fd, _ in out.values():
                    os.close(fd)
                raise
            return out

    # -- shutdown, start ----------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            victims = list(self._held.values())
            self._held.clear()
            self._used = sum(r.footprint for r in self._all.values())
        self._remove(victims, "shutdown")

    def sweep(self) -> list[str]:
        """At start: remove the replicas a dead daemon left (nobody holds their lock)."""
        return dirs.sweep_unlocked(self.shm_fd, REPLICA_NAME)

    def _remove(self, victims: list[Replica], why: str) -> None:
        for r in victims:
            if r.fd < 0 and r.name:  # made, not opened
                with contextlib.suppress(OSError):
                    os.rmdir(r.name, dir_fd=self.shm_fd)
            if r.fd >= 0:
                try:
                    dirs.remove_tree(r.name, self.shm_fd)
                except OSError as exc:
                    logs.error("replica-not-removed", directory=r.name, error=str(exc))
                os.close(r.fd)
                r.fd = -1
            if why != "shutdown":
                logs.info("replica-dropped", node=r.node, path=r.path, reason=why)
        with self._lock:
            self._used_gauges()

    def _used_gauges(self) -> None:
        self.metrics.replica_bytes.set(self._used)
        self.metrics.replicas_held.set(len(self._held))


MAX_RANGES = 4096  # a ReadReplica's ranges


def read(store: ReplicaStore, request: pb.ReadReplicaRequest) -> Iterator[pb.ReplicaData]:
    """ReadReplica: the ranges' bytes in chunks of at most MAX_CHUNK, each with
    its CRC32C. Opens the files (or raises RequestError) before returning."""
    if len(request.ranges) > MAX_RANGES:
        raise invalid(f"a ReadReplica reads at most {MAX_RANGES} ranges")
    files = store.open_files(request.node, request.path, request.manifest_sha256,
                             {r.file for r in request.ranges})
    try:
        for r in request.ranges:
            size = files[r.file][1]
            if r.offset + r.length > size:
                raise invalid(f"range {r.offset}+{r.length} is past the end of {r.file[:80]!r} "
                              f"({size} bytes)")
    except BaseException:
        for fd, _ in files.values():
            os.close(fd)
        raise
    return _chunks(request, files)


def _chunks(request: pb.ReadReplicaRequest, files: dict[str, tuple[int, int]]
            ) -> Iterator[pb.ReplicaData]:
    try:
        for index, r in enumerate(request.ranges):
            fd, end, offset = files[r.file][0], r.offset + r.length, r.offset
            while offset < end:
                data = os.pread(fd, min(MAX_CHUNK, end - offset), offset)
                if not data:
                    raise OSError(f"{r.file} ended at {offset}")
                yield pb.ReplicaData(file=index, offset=offset, data=data, crc32c=crc32c(data))
                offset += len(data)
    finally:
        for fd, _ in files.values():
            os.close(fd)
