"""A Replicate whose manifest comes in parts holds room for it (within the
daemon's budget for manifests being received) only until the manifest is
checked and in the replica's file, not for its whole data transfer: the
daemon's own Replicate path (replica_manifest.room, ReplicaStore.receive),
in-process, on a real checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peer_support import header_of

import fastpersist
from fastpersist.checksum import crc32c
from fastpersist.daemon import replica_manifest
from fastpersist.daemon.metrics import Metrics
from fastpersist.daemon.replica_wire import Data
from fastpersist.daemon.replicas import ReplicaStore
from fastpersist.daemon.requests import RequestError
from fastpersist.format.manifest import MANIFEST_NAME


class Call:
    """What the Replicate handler uses of its gRPC context."""

    def is_active(self) -> bool:
        return True

    def cancel(self) -> None:
        raise AssertionError("the call was cancelled")


def replicate(store: ReplicaStore, ckpt: Path, seen: list[int], corrupt: bool = False
              ) -> None:
    """One Replicate of `ckpt`, its manifest in parts, as the server runs it;
    `seen` gets the room held as each data chunk is read."""
    header, blobs = header_of(ckpt)
    manifest = header.manifest
    header.manifest = b""
    first, *parts = replica_manifest.header_and_parts(header, manifest, inline_max=0)
    assert parts and first.header.manifest_bytes == len(manifest)

    def messages() -> Iterator[object]:
        yield from parts
        for i, blob in enumerate(blobs):
            seen.append(replica_manifest._room.held)
            yield Data(i, 0, memoryview(blob), crc32c(blob) ^ int(corrupt))

    with replica_manifest.room(first.header, messages(), Call()) as (chunks, kept):  # type: ignore[arg-type]
        store.receive(first.header, replica_manifest.receive(first.header, chunks),
                      chunks, kept)  # type: ignore[arg-type]


def test_the_room_for_a_manifest_is_given_back_before_its_data(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-1"
    fastpersist.save({"a": torch.arange(1000.0), "b": torch.ones(3, 7)}, ckpt)
    shm = tmp_path / "shm"
    shm.mkdir()
    store = ReplicaStore(shm, 64 << 20, "job-1", Metrics())
    seen: list[int] = []
    replicate(store, ckpt, seen)
    assert seen and seen == [0] * len(seen)  # no room held while the data came
    assert replica_manifest._room.held == 0
    (held,) = store.listing()
    assert held.complete and held.manifest_len == (ckpt / MANIFEST_NAME).stat().st_size
    assert held.footprint == held.size + held.manifest_len
    # A replica whose data is refused leaves nothing, and its room is free too.
    seen.clear()
    with pytest.raises(RequestError, match="CRC32C"):
        replicate(store, ckpt, seen, corrupt=True)
    assert seen == [0] and replica_manifest._room.held == 0
    assert [r.complete for r in store.listing()] == [True]  # the first one stays
    store.close()
