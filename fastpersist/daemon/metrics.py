"""Prometheus metrics of one daemon (served on --metrics-listen)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_written = Counter(
            "fastpersist_bytes_written", "Bytes of data files written (headers included)",
            registry=r)
        self.checkpoints = Counter(
            "fastpersist_checkpoints", "Checkpoints finished, by result", ["result"], registry=r)
        self.in_flight = Gauge(
            "fastpersist_checkpoints_in_flight", "Checkpoints begun and not finished", registry=r)
        self.staging_reserved = Gauge(
            "fastpersist_staging_reserved_bytes",
            "Client shared memory reserved by checkpoints in flight", registry=r)
        self.staging_budget = Gauge(
            "fastpersist_staging_budget_bytes", "The --staging-budget (0: unlimited)", registry=r)
        self.throughput = Gauge(
            "fastpersist_last_checkpoint_throughput_bytes_per_second",
            "Bytes per second of the last committed checkpoint, first submit to commit",
            registry=r)
        self.write_seconds = Histogram(
            "fastpersist_file_write_seconds", "Time to write and fsync one data file",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300), registry=r)
        self.rejected = Counter(
            "fastpersist_requests_rejected", "Requests refused, by gRPC status code", ["code"],
            registry=r)
        self.housekeeping_failures = Counter(
            "fastpersist_housekeeping_failures",
            "Clean-ups and housekeeping passes that failed (logged; the daemon goes on)",
            registry=r)
        self.after_commit_failures = Counter(
            "fastpersist_after_commit_failures",
            "Checkpoints committed whose Checkpointer policy (moving `latest`, retention) "
            "failed", registry=r)
        self.tier_uploads = Counter(
            "fastpersist_tier_uploads",
            "Uploads to the object-store tier, by result (uploaded, already: the store held it; "
            "failed: an attempt, retried; dropped: cannot be uploaded; skipped: superseded)",
            ["result"], registry=r)
        self.tier_bytes_uploaded = Counter(
            "fastpersist_tier_bytes_uploaded", "Bytes of data files uploaded to the tier",
            registry=r)
        self.tier_pending = Gauge(
            "fastpersist_tier_pending",
            "Committed checkpoints not in the object store yet (kept locally until they are)",
            registry=r)
        self.tier_failing = Gauge(
            "fastpersist_tier_failing",
            "Pending checkpoints whose last upload attempt failed", registry=r)
        self.memory_tier_bytes = Gauge(
            "fastpersist_memory_tier_bytes",
            "Bytes of checkpoints the memory tier holds or is copying", registry=r)
        self.memory_tier_copies = Gauge(
            "fastpersist_memory_tier_copies", "Checkpoints the memory tier holds", registry=r)
        self.replication_bytes = Counter(
            "fastpersist_replication_bytes",
            "Bytes of data files replicated to peers (sent) or from them (received)",
            ["direction"], registry=r)
        self.replication_lag = Histogram(
            "fastpersist_replication_lag_seconds",
            "Seconds from a checkpoint's commit to the last peer's acknowledgement of it",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800), registry=r)
        self.replication_copies = Histogram(
            "fastpersist_replication_copies",
            "Peers holding each committed checkpoint when its replication ended",
            buckets=(0, 1, 2, 3, 4, 6, 8), registry=r)
        self.replication_failures = Counter(
            "fastpersist_replication_failures",
            "Replication failures by reason (a send attempt to a peer, a checkpoint given "
            "up, a chunk received with a wrong CRC32C)", ["reason"], registry=r)
        self.replication_same_domain = Counter(
            "fastpersist_replication_same_domain",
            "Replicas placed in the sender's own failure domain (too few peers outside it)",
            registry=r)
        self.replication_pending = Gauge(
            "fastpersist_replication_pending",
            "Committed checkpoints not yet replicated to --replicas peers", registry=r)
        self.replica_bytes = Gauge(
            "fastpersist_replica_bytes",
            "Bytes of replicas held for other nodes, complete and arriving", registry=r)
        self.replicas_held = Gauge(
            "fastpersist_replicas_held", "Complete replicas held for other nodes", registry=r)
        self.reclaimed_segments = Counter(
            "fastpersist_reclaimed_segments", "Shared-memory segments of dead clients unlinked",
            registry=r)

    def serve(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
