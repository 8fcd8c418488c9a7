"""A replica a peer lists (PeerReplica), and its manifest when too large for
the Replicas reply, read with ReadReplica.

A daemon lists a complete replica's manifest in its Replicas reply only up
to 16 MiB (daemon/replica_manifest.INLINE_MAX): a job's manifest may be up
to 1 GiB, and the reply, with every replica's manifest in it, is one gRPC
message of at most 64 MiB. A larger one is listed by its length and SHA-256
and read here as the replica's file "manifest.json" (the daemon keeps it
beside the data files), in CRC-checked chunks, then checked against the
SHA-256, so a replica is loadable whatever its manifest's size.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c
from ..errors import CorruptCheckpointError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME
from ..protocol.client import DaemonClient

READ_TIMEOUT = 600.0  # one ReadReplica stream


@dataclass(frozen=True)
class PeerReplica:
    """A replica a peer daemon holds: whose (node), of what (path), and its
    manifest (its SHA-256 tells copies apart; the bytes are read from the
    peer when first asked for, where the listing did not hold them)."""

    address: str
    node: str
    path: str
    nbytes: int  # of its files
    complete: bool
    failure_domain: str
    committed_unix: float
    files: Mapping[str, int]  # data file -> size
    sha256: bytes = b""  # of its manifest; empty unless complete
    listed: bytes = b""  # its manifest where the listing held it (up to 16 MiB)
    manifest_len: int = 0

    @functools.cached_property  # (kept in the instance's __dict__, not a field)
    def manifest(self) -> bytes:
        """Its manifest (empty unless complete). One over 16 MiB is read from
        the peer, once: a lookup lists every replica a peer holds, and a
        large job's manifest is hundreds of MB, so only the one chosen is read."""
        if self.listed or not self.complete or not self.manifest_len:
            return self.listed
        client = DaemonClient(self.address)
        try:
            return manifest_of(client, self.node, self.path, self.sha256, self.manifest_len,
                               READ_TIMEOUT)
        finally:
            client.close()


def listed_sha256(r: pb.ReplicaInfo) -> bytes:
    """A complete replica's manifest's SHA-256, as listed (or of the listed manifest)."""
    if not r.complete:
        return b""
    return r.manifest_sha256 or hashlib.sha256(r.manifest).digest()


def manifest_of(client: DaemonClient, node: str, path: str, sha256: bytes, length: int,
                timeout: float) -> bytes:
    """The manifest (`length` bytes, of this SHA-256) of node's replica of
    `path` that the peer at `client` holds, read as its file."""
    where = f"{client.address}: node {node}'s replica of {path}"
    if length > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: a manifest of {length} bytes is over "
                                     f"the {MAX_MANIFEST_BYTES} this version reads")
    request = pb.ReadReplicaRequest(node=node, path=path, manifest_sha256=sha256)
    request.ranges.add(file=MANIFEST_NAME, offset=0, length=length)
    parts: list[bytes] = []
    got = 0
    try:
        for chunk in client.stub.ReadReplica(request, timeout=timeout):
            data = chunk.data  # each access copies the bytes
            if chunk.file != 0 or chunk.offset != got or got + len(data) > length \
                    or crc32c(data) != chunk.crc32c:
                raise CorruptCheckpointError(f"{where}: its manifest came out of order or "
                                             f"with a wrong CRC32C (at {chunk.offset})")
            parts.append(data)
            got += len(data)
    except grpc.RpcError as exc:
        raise client.error(exc, f"cannot read the manifest of {where}") from None
    data = b"".join(parts)
    if hashlib.sha256(data).digest() != sha256:
        raise CorruptCheckpointError(f"{where}: its manifest ({got} of {length} "
                                     "bytes) does not match the SHA-256 the peer listed")
    return data


__all__ = ["READ_TIMEOUT", "PeerReplica", "listed_sha256", "manifest_of"]
