"""`fpctl ls`'s COPIES column: where each checkpoint's copies are, fastest
first, in the order a load tries them (loading/copies.py): "memory"
(fastpersistd on this node holds a valid copy: MemoryCopy, which checks
the manifest at the path), "disk" (the manifest is here), "peer" (a peer
of the daemon holds a complete replica: peer_copies below) and "s3" (the
object store holds a committed checkpoint of that name: fastpersistd's
--tier, where ROOT/REL is PREFIX/REL, or the URL given with --tier for the
ROOT listed).

The daemon and the store are asked once each (a MemoryCopy per
checkpoint, all within LOOKUP_TIMEOUT; one listing of the store); one that
does not answer is warned about and its copies left out, never guessed.
Torch-free.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import CheckpointError, DaemonUnavailableError
from ..knobs import current as current_knobs
from ._output import warn

# A daemon that does not answer within this costs `fpctl ls` no more.
LOOKUP_TIMEOUT = 2.0


def peer_copies(peers: list[str], relpaths: list[str], deadline: float) -> dict[str, int]:
    """How many of `peers` (a daemon's --peer list, as its Info says) hold a
    complete replica of each checkpoint (ROOT-relative path): of this node's
    files, or of any node's part of a job. A peer that does not answer by
    the deadline is warned about and not counted."""
    import grpc

    from .._proto import fastpersist_pb2 as pb
    from ..protocol.client import DaemonClient

    holders: dict[str, set[str]] = {}
    wanted = set(relpaths)
    for peer in peers:
        address = peer if "://" in peer else f"https://{peer}"
        try:
            client = DaemonClient(address)
            try:
                left = max(0.05, deadline - time.monotonic())
                reply = client.stub.Replicas(pb.ReplicasRequest(), timeout=left)
            except grpc.RpcError as exc:
                raise client.error(exc, "cannot list the peer's replicas") from None
            finally:
                client.close()
        except CheckpointError as exc:
            warn(f"warning: copies on peer {peer} not shown: {exc}")
            continue
        for r in reply.replicas:
            if r.complete and r.path in wanted:
                holders.setdefault(r.path, set()).add(peer)
    return {path: len(held) for path, held in holders.items()}


def copies(root: Path, names: list[str], *, daemon: str | None, tier: str | None,
           endpoint_url: str | None) -> dict[str, list[str]]:
    """For each committed checkpoint's `name` (relative to `root`), where
    its copies are."""
    address = current_knobs().daemon if daemon is None else daemon
    memory: set[str] = set()
    peers: dict[str, int] = {}
    if address and names:
        memory, peers, daemon_tier = _ask_daemon(address, root, names)
        tier = tier or daemon_tier
    stored = _stored(tier, endpoint_url) if tier and names else set()
    return {name: [kind for kind, held in (("memory", name in memory), ("disk", True),
                                           ("peer", peers.get(name, 0) > 0),
                                           ("s3", name in stored)) if held]
            for name in names}


def _ask_daemon(address: str, root: Path, names: list[str]
                ) -> tuple[set[str], dict[str, int], str | None]:
    """(the names the daemon holds in memory, peers' copies, its tier URL
    for `root`)."""
    from ..protocol.client import DaemonClient
    from ..tier.url import TierURL

    held: set[str] = set()
    try:
        client = DaemonClient(address)
        try:
            info = client.info(cached=True, timeout=LOOKUP_TIMEOUT)
            base = os.path.relpath(os.path.realpath(root), os.path.realpath(info.root))
            if base.startswith(".."):
                return held, {}, None  # not the daemon's: none of its copies
            rel = {n: n if base == "." else f"{base}/{n}" for n in names}
            deadline = time.monotonic() + LOOKUP_TIMEOUT  # for all of them together
            for name, relpath in rel.items():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonUnavailableError(f"fastpersistd at {address} did not answer "
                                                 f"for {len(rel)} checkpoints within "
                                                 f"{LOOKUP_TIMEOUT} s", "DEADLINE_EXCEEDED")
                if client.memory_copy(relpath, left).directory:
                    held.add(name)
            counts = peer_copies(list(info.peers), list(rel.values()),
                                 time.monotonic() + LOOKUP_TIMEOUT)
            peers = {n: counts.get(relpath, 0) for n, relpath in rel.items()}
        finally:
            client.close()
    except CheckpointError as exc:
        warn(f"warning: copies in fastpersistd's memory not shown: {exc}")
        return set(), {}, None
    if not info.tier_url:
        return held, peers, None
    url = TierURL.parse(info.tier_url)
    return held, peers, str(url if base == "." else url.child(base))


def _stored(tier: str, endpoint_url: str | None) -> set[str]:
    from ..tier.client import client_for
    from ..tier.listing import CHECKPOINT, listing
    from ..tier.url import TierURL

    try:
        found = listing(client_for(endpoint_url), TierURL.parse(tier))
    except (CheckpointError, ValueError) as exc:
        warn(f"warning: copies in the object store {tier} not shown: {exc}")
        return set()
    return {e.name for e in found.entries if e.kind == CHECKPOINT}


__all__ = ["copies", "peer_copies"]
