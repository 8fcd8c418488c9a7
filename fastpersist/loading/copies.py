"""Where the copies of a checkpoint are, fastest first: the one place that
orders them (chain.py reads them in this order).

1. fastpersistd's memory, if a daemon is configured and holds a valid copy
   (memory_read.find: a daemon that is down or slow costs LOOKUP_TIMEOUT),
   or, where no checkpoint is on disk at the path, a memory-only one
   (memory_only.find: Checkpointer(memory_every=));
2. the local disk, the checkpoint of record when it is there;
3. the replicas the daemon's peers hold (peers_copy below: fastpersistd
   --replicas, tensors/peer_read.py), a node's lost files from other nodes;
4. the object store: the checkpoint's URL given (tier=: Checkpointer(tier=)
   maps ROOT/step-N to TIER/step-N), or else the daemon's tier
   (fastpersistd --tier, InfoResponse.tier_url), where ROOT/REL is
   PREFIX/REL (daemon/tiering.py). The daemon is asked for its tier only
   when the copies before it failed; the store's client is configured the
   standard AWS way (endpoint_url overrides the endpoint).

A node whose directory is gone (lost, replaced) reads the store: the disk
fails as not found, with a warning, and the store's copy is read.
"""

from __future__ import annotations

import functools
from collections.abc import Container
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.retention import step_of
from ..tensors.committed import read_manifest_bytes
from ..tensors.source import LocalSource, Source
from ..tier.url import TierURL
from .chain import Copy, NoCopy, Opened, identity_of

if TYPE_CHECKING:  # the daemon's client (grpc) is imported only when one is asked
    from .._proto import fastpersist_pb2 as pb

DISK = "disk"


def ask_daemon(daemon: str, path: Path, what: str, timeout: float) -> tuple[pb.InfoResponse, str]:
    """The daemon's Info and `path` relative to its root; NoCopy (naming
    `what` was wanted) where it cannot be asked."""
    from ..protocol.client import DaemonClient

    try:
        client = DaemonClient(daemon)
        try:
            return client.info(cached=True, timeout=timeout), client.relative(path)
        finally:
            client.close()
    except CheckpointError as exc:
        raise NoCopy(f"cannot ask fastpersistd for its {what}: {exc}") from None


def _peers_of(daemon: str, path: Path) -> tuple[list[str], str]:
    """The addresses of the peers of the daemon at `daemon` (its --peer
    list, as its Info reports it), and `path` relative to its root, as each
    peer keeps it; NoCopy where there are none or it cannot be asked."""
    from ..tensors import peer_read

    info, relative = ask_daemon(daemon, path, "peers", peer_read.LOOKUP_TIMEOUT)
    if not info.peers:
        raise NoCopy(f"fastpersistd at {daemon} has no peers")
    return [p if "://" in p else f"https://{p}" for p in info.peers], relative


def peers_copy(daemon: str, path: Path) -> Opened:
    """The checkpoint at `path` from the replicas that the daemon's peers
    hold: a node whose disk is gone, or its replacement, restores from them.
    NoCopy where the daemon has no peers or none holds a complete copy."""
    from ..tensors import peer_read

    addresses, relative = _peers_of(daemon, path)
    source, why = peer_read.find_job(addresses, relative)
    if source is None:
        raise NoCopy(f"no peer holds a complete copy: {why}")
    return _opened(source)


def newest_on_peers(daemon: str, root: Path, exclude: Container[Path | str]) -> Path | None:
    """The newest step-N checkpoint under `root` (a Checkpointer's) that the
    daemon's peers hold whole (complete replicas of every data file): what
    latest() finds on a node whose disk is gone. None where there is none."""
    from ..tensors import peer_read

    try:
        addresses, base = _peers_of(daemon, root)
    except NoCopy:
        return None
    found, _ = peer_read.held(addresses)
    prefix = "" if base in ("", ".") else base.rstrip("/") + "/"
    names = {r.path[len(prefix):] for r in found if r.path.startswith(prefix)}
    steps = sorted((s, n) for n in names if "/" not in n and (s := step_of(n)) is not None)
    for _, name in reversed(steps):
        if root / name not in exclude and peer_read.choose(found, prefix + name)[0]:
            return root / name
    return None


def copies_for(path: Path, *, daemon: str, tier: str | None = None,
               endpoint_url: str | None = None) -> list[Copy]:
    """The copies of the checkpoint at `path` (absolute), fastest first;
    daemon: its address ("" for none); tier: the checkpoint's URL in a
    store, if known."""
    copies = []
    if daemon:
        from ..tensors import memory_read

        memory, _ = memory_read.find(daemon, path)
        if memory is None:  # a memory-only checkpoint (Checkpointer(memory_every=))?
            from ..tensors import memory_only

            memory, _ = memory_only.find(daemon, path)
        if memory is not None:
            copies.append(Copy("fastpersistd's copy in memory", "memory",
                               functools.partial(_opened, memory)))
    copies.append(Copy(DISK, DISK, functools.partial(_disk, path)))
    if daemon:  # asked only once the copies before them failed
        copies.append(Copy("the peers' replicas", "peer",
                           functools.partial(peers_copy, daemon, path)))
    if tier is not None:
        copies.append(Copy(f"the object store's copy {tier}", "s3",
                           functools.partial(_store, TierURL.parse(tier), endpoint_url)))
    elif daemon:
        copies.append(Copy("the object store's copy (fastpersistd's tier)", "s3",
                           functools.partial(_daemon_store, daemon, path, endpoint_url)))
    return copies


def _opened(source: Source) -> Opened:
    data = getattr(source, "manifest_bytes", b"")
    return Opened(source, identity_of(data) if data else frozenset())


def _disk(path: Path) -> Opened:
    manifest, data = read_manifest_bytes(path)
    return Opened(LocalSource(path, manifest=manifest), identity_of(data))


def daemon_tier(daemon: str, path: Path) -> TierURL:
    """The URL under which fastpersistd's tier keeps the checkpoint at
    `path` (ROOT/REL: PREFIX/REL); NoCopy if the daemon has no tier or
    cannot be asked."""
    from ..tensors.memory_read import LOOKUP_TIMEOUT

    info, relative = ask_daemon(daemon, path, "tier", LOOKUP_TIMEOUT)
    if not info.tier_url:
        raise NoCopy(f"fastpersistd at {daemon} has no --tier")
    try:
        return TierURL.parse(info.tier_url).child(relative)
    except ValueError as exc:
        raise NoCopy(f"fastpersistd's tier cannot name {relative}: {exc}") from None


def _daemon_store(daemon: str, path: Path, endpoint_url: str | None) -> Opened:
    return _store(daemon_tier(daemon, path), endpoint_url)


def _store(url: TierURL, endpoint_url: str | None) -> Opened:
    from ..tensors.tier_read import TierSource
    from ..tier.client import client_for
    from ..tier.upload import SOURCE_KEY

    s3 = client_for(endpoint_url)
    got = s3.get_with_metadata(url, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if got is None:  # not there: the error of the copies before it stands
        raise NoCopy(f"no checkpoint at {url}: it has no {MANIFEST_NAME} (not uploaded, or "
                     "its upload has not finished)")
    data, metadata = got
    made_from = metadata.get(SOURCE_KEY)
    manifest = Manifest.from_json(data, str(url))
    return Opened(TierSource(s3, url, manifest),
                  identity_of(data, *([made_from] if made_from else [])))


__all__ = ["DISK", "ask_daemon", "copies_for", "daemon_tier", "newest_on_peers", "peers_copy"]
