"""`fpctl daemon status`: is fastpersistd serving, and what is it doing. Torch-free."""

from __future__ import annotations

import argparse
from typing import Any

from .._proto import fastpersist_pb2 as pb
from ..errors import CheckpointError
from ..knobs import daemon_address
from ..protocol.client import DaemonClient
from ._output import EXIT_ERROR, EXIT_OK, human_size, print_json, warn

DEFAULT_ADDRESS = "unix:///run/fastpersist/fastpersistd.sock"


def cmd_daemon(args: argparse.Namespace) -> int:
    address = args.daemon or daemon_address() or DEFAULT_ADDRESS
    client = DaemonClient(address)
    try:
        health = client.health(timeout=args.timeout)
        info = client.info() if health == "SERVING" else None
        in_flight = client.list("").in_flight if info is not None else []
    except CheckpointError as exc:
        if args.json:
            print_json({"address": address, "health": "UNREACHABLE", "error": str(exc)})
        else:
            warn(f"fastpersistd at {address}: not reachable ({exc})")
        return EXIT_ERROR
    finally:
        client.close()
    doc = {"address": address, "health": health}
    if info is not None:
        doc.update(version=info.version, root=info.root, direct_io=info.direct_io,
                   io_backend=info.io_backend, staging_budget=info.staging_budget,
                   staging_in_use=info.staging_in_use,
                   checkpoints_in_flight=info.checkpoints_in_flight,
                   in_flight=[as_dict(s) for s in in_flight])
        if info.memory_tier_count:
            doc["memory_tier"] = {"count": info.memory_tier_count,
                                  "budget": info.memory_tier_budget,
                                  "bytes": info.memory_tier_bytes,
                                  "copies": info.memory_tier_copies}
        if info.replicas or info.replica_budget:
            doc["replication"] = {"node": info.node_name,
                                  "failure_domain": info.failure_domain, "job": info.job,
                                  "replicas": info.replicas, "peers": list(info.peers),
                                  "pending": info.replication_pending,
                                  "held": info.replicas_held, "held_bytes": info.replica_bytes,
                                  "budget": info.replica_budget}
        if info.tier_url:
            doc["tier"] = {"url": info.tier_url, "pending": info.tier_pending,
                           "failing": info.tier_failing, "uploaded": info.tier_uploaded,
                           "failures": info.tier_failures,
                           "last_error": info.tier_last_error}
    if args.json:
        print_json(doc)
    else:
        print(f"fastpersistd at {address}: {health}")
        if info is not None:
            budget = human_size(info.staging_budget) if info.staging_budget else "unlimited"
            print(f"  version {info.version}, root {info.root} "
                  f"({'O_DIRECT' if info.direct_io else 'buffered'}, {info.io_backend})")
            print(f"  staging {human_size(info.staging_in_use)} in use of {budget}; "
                  f"{info.checkpoints_in_flight} checkpoint(s) in flight")
            if info.memory_tier_count:
                print(f"  memory tier: {info.memory_tier_copies} of {info.memory_tier_count} "
                      f"checkpoint(s), {human_size(info.memory_tier_bytes)} of "
                      f"{human_size(info.memory_tier_budget)}")
            if info.replicas or info.replica_budget:
                print(f"  node {info.node_name} (failure domain {info.failure_domain or '-'}, "
                      f"job {info.job or '-'}): {info.replicas} replica(s) of each checkpoint "
                      f"to {len(info.peers)} peer(s), {info.replication_pending} pending; "
                      f"holds {info.replicas_held} replica(s) for others, "
                      f"{human_size(info.replica_bytes)} of {human_size(info.replica_budget)}")
            if info.tier_url:
                print(f"  tier {info.tier_url}: {info.tier_pending} checkpoint(s) to upload"
                      f" ({info.tier_failing} failing), {info.tier_uploaded} uploaded, "
                      f"{info.tier_failures} failed attempt(s)"
                      + (f"; last error: {info.tier_last_error}" if info.tier_last_error
                         else ""))
    return EXIT_OK if health == "SERVING" else EXIT_ERROR


def state_name(state: int) -> str:
    return str(pb.CheckpointStatus.State.Name(state)).lower()


def as_dict(status: pb.CheckpointStatus) -> dict[str, Any]:
    return {
        "checkpoint_id": status.checkpoint_id, "path": status.path,
        "state": state_name(status.state), "bytes_written": status.bytes_written,
        "bytes_total": status.bytes_total, "files_written": status.files_written,
        "files_total": status.files_total, "error": status.error,
    }
