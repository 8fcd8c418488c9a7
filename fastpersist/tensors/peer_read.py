"""Reading a checkpoint from a replica that a peer fastpersistd holds
(daemon/replicas.py): a node that lost its disk, or a replacement node,
loads what its peers kept in memory.

    from fastpersist.tensors import peer_read
    for r in peer_read.replicas("https://peer-0:7070"):   # what a peer holds
        print(r.node, r.path, r.nbytes)
    source, why = peer_read.find(["https://peer-0:7070", "https://peer-1:7070"],
                                 "run/step-100", node="node-3")
    # source: a PeerSource (tensors/source.py's Source), or None and why not

Addresses and credentials are the daemon client's (protocol/channels.py):
https://HOST:PORT with FASTPERSIST_DAEMON_TOKEN_FILE, _CA_FILE and, for a
daemon asking for client certificates, _CERT_FILE and _KEY_FILE; or a local
daemon's unix:///PATH. The path is the one relative to the sending
daemon's --root (as Replicas lists it), and node its --node-name.

PeerSource makes the checks TierSource makes against an object store (each
data file's size against the manifest, its header against its CRC32C and
the records, every tensor's CRC32C: a mismatch is ChecksumMismatchError
naming file and tensor; compressed records through packed.read, every
frame checked). The bytes come by ReadReplica streams, straight into the
tensors' memory; each chunk also carries a CRC32C of its own, checked
as it arrives (a mismatch there is a ChecksumMismatchError too), and the
chunks' CRC32Cs combine into the tensor's, so no byte is read twice. A
replica the peer evicts or replaces between the listing and the read is
NOT_FOUND (CheckpointNotFoundError); a peer that is down or slow fails
within the timeout (DaemonUnavailableError). Either way a chain of sources
(memory, disk, peers, object store) goes on to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import grpc
import torch

from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c, crc32c_combine
from ..engine import Segment
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DaemonUnavailableError,
    ManifestError,
    TruncatedFileError,
)
from ..format import dtypes, safetensors_file
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..protocol.client import DaemonClient
from . import packed
from .committed import records_by_file
from .headers import header_problems, parse_header
from .mismatch import Mismatch, raise_for
from .peer_manifest import READ_TIMEOUT, PeerReplica, listed_sha256
from .plan import memory_of
from .source import Progress

LOOKUP_TIMEOUT = 5.0  # Replicas: a peer that does not answer in this long is passed over
MAX_RANGES = 4096  # per ReadReplica (the daemon's limit)
THREADS = 4  # data files read at once
GRACE = 1.0  # past LOOKUP_TIMEOUT: for a call's own deadline to fire and be reported


def replicas(address: str, timeout: float = LOOKUP_TIMEOUT) -> list[PeerReplica]:
    """The replicas the daemon at `address` holds (complete, and arriving)."""
    client = DaemonClient(address)
    try:
        try:
            reply = client.stub.Replicas(pb.ReplicasRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise client.error(exc, "cannot list the peer's replicas") from None
        return [PeerReplica(address, r.node, r.path, r.bytes, r.complete, r.failure_domain,
                            r.committed_unix, {f.name: f.size for f in r.files},
                            listed_sha256(r), r.manifest if r.complete else b"",
                            r.manifest_bytes or len(r.manifest))
                for r in reply.replicas]
    finally:
        client.close()


def find(addresses: Sequence[str], path: str, node: str | None = None,
         timeout: float = LOOKUP_TIMEOUT) -> tuple[PeerSource | None, str]:
    """A PeerSource of the newest complete replica of `path` (of `node`, if
    given) that any of the peers holds; else (None, why not)."""
    held_, why = held(addresses, timeout)
    found = [r for r in held_ if r.path == path and (node is None or r.node == node)]
    if not found:
        return None, "; ".join(why) or f"no peer holds a replica of {path}"
    return PeerSource(max(found, key=lambda r: r.committed_unix)), ""


def held(addresses: Sequence[str], timeout: float = LOOKUP_TIMEOUT
         ) -> tuple[list[PeerReplica], list[str]]:
    """The complete replicas the daemons at `addresses` hold, and why the
    ones that did not answer did not. All are asked at once, with one
    deadline: a peer that is down or blackholed costs `timeout` in all,
    not one each (a latest() on a node whose disk is gone asks them all)."""
    if not addresses:
        return [], []
    pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="fastpersist-peers")
    try:
        asked = [pool.submit(replicas, address, timeout) for address in addresses]
        wait(asked, timeout=timeout + GRACE)
    finally:
        pool.shutdown(wait=False)  # one still waiting ends at its own (the same) timeout
    found: list[PeerReplica] = []
    why: list[str] = []
    for address, future in zip(addresses, asked, strict=True):
        if not future.done():
            why.append(f"peer {address} did not answer within {timeout} s")
            continue
        try:
            found += [r for r in future.result() if r.complete]
        except CheckpointError as exc:
            why.append(str(exc))
    return found, why


def find_job(addresses: Sequence[str], path: str, timeout: float = LOOKUP_TIMEOUT
             ) -> tuple[PeerSource | None, str]:
    """A PeerSource of the whole checkpoint at `path` from the peers' replicas:
    of a node-local job, every node's files (each node replicated its own),
    of a single node's save, that node's; else (None, why not). See choose."""
    found, why = held(addresses, timeout)
    source, reason = choose(found, path)
    return source, "; ".join([*why, reason]) if source is None else ""


def choose(found: Sequence[PeerReplica], path: str) -> tuple[PeerSource | None, str]:
    """Of the complete replicas `found`, those of `path` as one PeerSource:
    only replicas of one manifest count, and only if together they hold
    every data file it lists. The newest such manifest is chosen, so a
    checkpoint whose replication was cut off on some node is never read in
    part. Else (None, why not)."""
    why: list[str] = []
    by_manifest: dict[bytes, list[PeerReplica]] = {}
    for r in found:
        if r.complete and r.path == path:
            by_manifest.setdefault(r.sha256, []).append(r)
    for _, group in sorted(by_manifest.items(), reverse=True,
                           key=lambda kv: max(r.committed_unix for r in kv[1])):
        try:  # (the manifest read here, from a peer that holds it, if not listed)
            manifest = Manifest.from_json(_manifest_of(group),
                                          f"the peers' replica of {path}")
        except CheckpointError as exc:
            why.append(str(exc))
            continue
        missing = [f.name for f in manifest.files if not any(f.name in r.files for r in group)]
        if not missing:
            return PeerSource(group), ""
        why.append(f"the peers' replicas of {path} (nodes "
                   f"{', '.join(sorted({r.node for r in group}))}) lack {len(missing)} of its "
                   f"{len(manifest.files)} data files ({missing[0]}, ...): a node's "
                   "replication did not finish")
    return None, "; ".join(why) or f"no peer holds a replica of {path}"


def _manifest_of(group: Sequence[PeerReplica]) -> bytes:
    """The manifest the replicas of `group` share: from the first whose peer
    gives it (one may be down, or have dropped the replica)."""
    errors: list[str] = []
    for r in group:
        try:
            return r.manifest
        except CheckpointError as exc:
            errors.append(str(exc))
    raise CheckpointNotFoundError("; ".join(errors))


class PeerSource:
    """A checkpoint's replica on a peer daemon, read over ReadReplica (see the
    module docstring). Build it from a listing: PeerSource(replica) with a
    PeerReplica from replicas(address), or find(addresses, path, node)."""

    def __init__(self, replica: PeerReplica | Sequence[PeerReplica],
                 timeout: float = READ_TIMEOUT) -> None:
        group = [replica] if isinstance(replica, PeerReplica) else list(replica)
        if not group or len({r.sha256 for r in group}) != 1:
            raise ValueError("a PeerSource needs replicas of one manifest")
        for r in group:
            if not r.complete:
                raise ValueError(f"the replica of {r.path} at {r.address} is not complete")
        # Several replicas (nodes' parts of a job, or one part on several
        # peers): each data file is read from the first that holds it, and
        # from the next one if that peer is down or dropped the replica.
        self.replicas, self.timeout = group, timeout
        self.replica = group[0]
        self.manifest_bytes = _manifest_of(group)  # the restore chain compares copies by it
        self._sha = self.replica.sha256  # (a manifest read is checked against it)
        self._manifest: Manifest | None = None

    @property
    def where(self) -> str:
        r = self.replica
        if len(self.replicas) == 1:
            return f"{r.address} (node {r.node}'s replica of {r.path})"
        return (f"peers {', '.join(sorted({x.address for x in self.replicas}))} (replicas of "
                f"{r.path} from nodes {', '.join(sorted({x.node for x in self.replicas}))})")

    def _holders(self, name: str) -> list[PeerReplica]:
        return [r for r in self.replicas if name in r.files]

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = Manifest.from_json(self.manifest_bytes, self.where)
        return self._manifest

    def read_tensors(self, manifest: Manifest, *, verify: bool, progress: Progress | None = None,
                     spans: Mapping[int, packed.Span] | None = None,
                     into: Mapping[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        result: list[torch.Tensor | None] = [None] * len(manifest.tensors)
        jobs = list(records_by_file(manifest))
        for f, _ in jobs:
            self.check_file(f)

        def one(job: tuple[FileRecord, list[int]]) -> None:
            f, indices = job
            for i, t in zip(indices, self._read_file(manifest, f, indices, verify, spans or {},
                                                     into or {}), strict=True):
                result[i] = t
            if progress:
                progress(sum(manifest.tensors[i].length for i in indices))

        with ThreadPoolExecutor(min(THREADS, max(1, len(jobs))),
                                thread_name_prefix="fastpersist-peer") as pool:
            list(pool.map(one, jobs))
        assert all(t is not None for t in result)  # every record belongs to one file
        return result  # type: ignore[return-value]

    def read_to_device(self, manifest: Manifest, device: torch.device, *, verify: bool,
                       ring_bytes: int, progress: Progress | None = None,
                       into: Mapping[int, torch.Tensor] | None = None
                       ) -> list[torch.Tensor] | None:
        return None  # received on the CPU, checked there; the load moves them

    def check_file(self, f: FileRecord) -> None:
        holders = self._holders(f.name)
        size = holders[0].files[f.name] if holders else None
        if size is None:
            written = f" (written on node {f.node})" if f.node else ""
            raise CorruptCheckpointError(f"{self.where}: the replica holds no data file "
                                         f"{f.name}{written}")
        if size < f.size:
            raise TruncatedFileError(f"{self.where}: data file {f.name} is truncated: {size} "
                                     f"bytes, the manifest says {f.size}")
        if size > f.size:
            raise CorruptCheckpointError(f"{self.where}: data file {f.name} is {size} bytes, "
                                         f"the manifest says {f.size}")

    def read_ranges(self, f: FileRecord, segments: Sequence[Segment], *, checksum: bool
                    ) -> list[int] | None:
        crcs = self._fetch(f.name, [(memoryview(b), off) for b, off in segments])
        return crcs if checksum else None

    # -- one file -------------------------------------------------------------------

    def _read_file(self, manifest: Manifest, f: FileRecord, indices: list[int], verify: bool,
                   spans: Mapping[int, packed.Span], into: Mapping[int, torch.Tensor]
                   ) -> list[torch.Tensor]:
        records = [manifest.tensors[i] for i in indices]
        self._check_header(f, records, verify)
        out: dict[int, torch.Tensor] = {}
        raw = [i for i in indices if manifest.tensors[i].frames is None]
        tensors = [into[i] if i in into else torch.empty(
            manifest.tensors[i].shape, dtype=dtypes.from_name(manifest.tensors[i].dtype))
            for i in raw]
        crcs = self._fetch(f.name, [(memory_of(t), manifest.tensors[i].offset)
                                    for i, t in zip(raw, tensors, strict=True)])
        if verify:
            raise_for([Mismatch(f.name, manifest.tensors[i].name, manifest.tensors[i].crc32c,
                                crc) for i, crc in zip(raw, crcs, strict=True)
                       if crc != manifest.tensors[i].crc32c], self.where)
        out.update(zip(raw, tensors, strict=True))
        encoded = [i for i in indices if manifest.tensors[i].frames is not None]
        if encoded:
            decoded, outcome = packed.read(
                self._reader(f.name), f, [manifest.tensors[i] for i in encoded], verify=verify,
                spans=[spans.get(i) for i in encoded])
            raise_for(outcome.mismatches, self.where)
            if outcome.undecodable:
                raise CorruptCheckpointError(f"{self.where}: {outcome.undecodable[0]}")
            out.update(zip(encoded, decoded, strict=True))
        return [out[i] for i in indices]

    def _check_header(self, f: FileRecord, records: list[TensorRecord], verify: bool) -> None:
        covered = bytearray(f.data_start)
        (crc,) = self._fetch(f.name, [(memoryview(covered), 0)])
        if verify and crc != f.header_crc32c:
            raise_for([Mismatch(f.name, "<header>", f.header_crc32c, crc)], self.where)
        try:
            data_start, entries, _ = parse_header(bytes(covered))
        except safetensors_file.HeaderError as exc:
            raise ManifestError(f"{self.where}: {f.name}: header: {exc}") from None
        problems = header_problems(f, records, data_start, entries)
        if problems:
            raise ManifestError(f"{self.where}: {problems[0]}")

    def _reader(self, name: str) -> Callable[[list[Segment]], None]:
        def read_stored(segments: list[Segment]) -> None:
            self._fetch(name, [(memoryview(b), off) for b, off in segments])

        return read_stored

    # -- the wire ---------------------------------------------------------------------

    def _fetch(self, name: str, segments: list[tuple[memoryview, int]]) -> list[int]:
        """Fill each (buffer, offset) of data file `name`; the CRC32C of each."""
        holders = self._holders(name)
        if not holders:
            raise CorruptCheckpointError(f"{self.where}: no replica holds data file {name}")
        for k, holder in enumerate(holders):
            crcs: list[int] = []
            client = DaemonClient(holder.address)
            try:
                for start in range(0, len(segments), MAX_RANGES):
                    crcs += self._stream(client, holder, name,
                                         segments[start:start + MAX_RANGES])
                return crcs
            except (DaemonUnavailableError, CheckpointNotFoundError):
                if k == len(holders) - 1:
                    raise  # the peer is down or dropped it, and no other holds it
            finally:
                client.close()
        raise AssertionError("unreachable")  # the last holder returned or raised

    def _stream(self, client: DaemonClient, r: PeerReplica, name: str,
                segments: list[tuple[memoryview, int]]) -> list[int]:
        request = pb.ReadReplicaRequest(node=r.node, path=r.path, manifest_sha256=self._sha)
        for buf, off in segments:
            request.ranges.add(file=name, offset=off, length=buf.nbytes)
        got = [0] * len(segments)
        crcs = [0] * len(segments)
        try:
            for chunk in client.stub.ReadReplica(request, timeout=self.timeout):
                data = chunk.data  # each access copies the bytes
                i, n = chunk.file, len(data)
                if i >= len(segments) or chunk.offset != segments[i][1] + got[i] \
                        or got[i] + n > segments[i][0].nbytes:
                    raise CorruptCheckpointError(
                        f"{self.where}: {name}: the peer sent bytes out of order (range {i} "
                        f"at {chunk.offset})")
                crc = crc32c(data)
                if crc != chunk.crc32c:
                    raise ChecksumMismatchError(
                        f"{self.where}: {name} at {chunk.offset}: a chunk's CRC32C "
                        f"{crc:#010x} is not the one sent with it ({chunk.crc32c:#010x})",
                        file=name, tensor="<chunk>")
                segments[i][0][got[i]:got[i] + n] = data
                crcs[i] = crc32c_combine(crcs[i], crc, n) if got[i] else crc
                got[i] += n
        except grpc.RpcError as exc:
            raise client.error(exc, f"cannot read {name} of {self.where}") from None
        short = next((i for i, (buf, _) in enumerate(segments) if got[i] != buf.nbytes), None)
        if short is not None:
            raise TruncatedFileError(f"{self.where}: {name}: the peer sent {got[short]} of "
                                     f"{segments[short][0].nbytes} bytes at "
                                     f"{segments[short][1]}")
        return crcs


__all__ = ["LOOKUP_TIMEOUT", "PeerReplica", "PeerSource", "choose", "find", "find_job", "held",
           "replicas"]
