"""A peer's replica's manifest too large for its Replicas reply, read with ReadReplica.

A daemon lists a complete replica's manifest in its Replicas reply only up
to 16 MiB (daemon/replica_manifest.INLINE_MAX): a job's manifest may be up
to 1 GiB, and the reply, with every replica's manifest in it, is one gRPC
message of at most 64 MiB. A larger one is listed by its length and SHA-256
and read here as the replica's file "manifest.json" (the daemon keeps it
beside the data files), in CRC-checked chunks, then checked against the
SHA-256, so a replica is loadable whatever its manifest's size.
"""

from __future__ import annotations

import hashlib

import grpc

from .._proto import fastpersist_pb2 as pb
from ..checksum import crc32c
from ..errors import CorruptCheckpointError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME
from ..protocol.client import DaemonClient


def manifest_of(client: DaemonClient, r: pb.ReplicaInfo, timeout: float) -> bytes:
    """The replica's manifest: the reply's, or read from the peer when the
    reply left it out (a complete replica with manifest_bytes but no manifest)."""
    if r.manifest or not r.complete or not r.manifest_bytes:
        return r.manifest
    where = f"{client.address}: node {r.node}'s replica of {r.path}"
    if r.manifest_bytes > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: a manifest of {r.manifest_bytes} bytes is over "
                                     f"the {MAX_MANIFEST_BYTES} this version reads")
    request = pb.ReadReplicaRequest(node=r.node, path=r.path, manifest_sha256=r.manifest_sha256)
    request.ranges.add(file=MANIFEST_NAME, offset=0, length=r.manifest_bytes)
    parts: list[bytes] = []
    got = 0
    try:
        for chunk in client.stub.ReadReplica(request, timeout=timeout):
            data = chunk.data  # each access copies the bytes
            if chunk.file != 0 or chunk.offset != got or got + len(data) > r.manifest_bytes \
                    or crc32c(data) != chunk.crc32c:
                raise CorruptCheckpointError(f"{where}: its manifest came out of order or "
                                             f"with a wrong CRC32C (at {chunk.offset})")
            parts.append(data)
            got += len(data)
    except grpc.RpcError as exc:
        raise client.error(exc, f"cannot read the manifest of {where}") from None
    data = b"".join(parts)
    if hashlib.sha256(data).digest() != r.manifest_sha256:
        raise CorruptCheckpointError(f"{where}: its manifest ({got} of {r.manifest_bytes} "
                                     "bytes) does not match the SHA-256 the peer listed")
    return data
