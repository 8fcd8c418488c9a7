"""The gRPC face of the daemon: request checks and error codes.

Every handler turns a request into a call on service.Service. Whatever a
request holds, the daemon answers with a status code (INVALID_ARGUMENT for
malformed input) and never dies of it: unexpected exceptions become INTERNAL
and are logged. The servers that carry it, and who may call them with how
much, are transport.py's.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from .. import knobs
from .._proto import fastpersist_pb2 as pb
from .._proto import fastpersist_pb2_grpc as pb_grpc
from .._version import __version__
from ..errors import CheckpointError
from ..protocol import shm
from ..protocol.chunked import LARGE_HEADERS
from ..storage.commit import os_error
from ..storage.retention import AfterCommit
from . import large_requests, logs, replica_manifest, replicas, submitted
from .budgets import parsing
from .checkpoints import Checkpoint
from .paths import PathError, parse
from .peers import PeerSettings
from .replica_wire import Data
from .replication import Replicator
from .requests import (
    MAX_ID_BYTES,
    RequestError,
    check_extra_files,
    check_names,
    code_for,
    invalid,
)
from .service import Service

# InfoResponse.features: what clients may not assume of every daemon.
FEATURES = ["commit-files", "commit-stream", LARGE_HEADERS, "memory-copy", "memory-only",
            "replicas"]
MAX_ERROR_CHARS = 1000

T = TypeVar("T")


def _status(d: dict[str, Any]) -> pb.CheckpointStatus:
    return pb.CheckpointStatus(**d)


class Servicer(pb_grpc.FastPersistServicer):
    def __init__(self, service: Service, direct_io: bool,
                 peering: tuple[PeerSettings, replicas.ReplicaStore, Replicator | None]
                 | None = None) -> None:
        """peering: this daemon's settings, the replicas it holds for others,
        and its sender (None: --replicas 0); None: neither (a test's servicer)."""
        self.service = service
        self.direct_io = direct_io
        self.peering = peering

    # Each handler body runs through _guard: errors become status codes.
    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RequestError as exc:
            self._reject(context, exc.code, str(exc))
        except PathError as exc:
            self._reject(context, "INVALID_ARGUMENT", str(exc))
        except shm.SegmentError as exc:
            self._reject(context, exc.code, str(exc))
        except CheckpointError as exc:
            self._reject(context, code_for(exc), str(exc))
        except OSError as exc:
            # The file system refused (a directory vanished under the request...).
            error = os_error(exc, "fastpersistd could not serve this request")
            self._reject(context, code_for(error), str(error))
        except Exception as exc:
            if context.code() is not None:
                raise  # context.abort's own exception: the status is set already
            if isinstance(exc, grpc.RpcError) and not context.is_active():
                # The client went away mid-request (a broken stream): nobody to
                # answer. Its checkpoint is aborted when its lease (Open or
                # Watch stream) breaks.
                logs.info("request-cancelled", peer=context.peer())
                raise
            logs.event(logging.ERROR, "internal-error", error=repr(exc),
                       traceback=traceback.format_exc())
            self._reject(context, "INTERNAL", f"fastpersistd failed on this request: {exc!r}")
        raise AssertionError("unreachable")  # context.abort raises

    def _reject(self, context: grpc.ServicerContext, code: str, message: str) -> None:
        if len(message) > MAX_ERROR_CHARS:  # never echo a request back in full
            message = message[:MAX_ERROR_CHARS] + "..."
        self.service.metrics.rejected.labels(code=code).inc()
        logs.info("rejected", code=code, reason=message, peer=context.peer())
        context.abort(getattr(grpc.StatusCode, code), message)


    # -- RPCs ----------------------------------------------------------------

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        def run() -> pb.InfoResponse:
            s = self.service
            reserved, in_flight, peak, mapped_peak = s.snapshot()
            reply = pb.InfoResponse(
                version=__version__, root=str(s.root.path), staging_budget=s.budgets.staging,
                staging_in_use=reserved, checkpoints_in_flight=in_flight,
                staging_in_use_peak=peak, staging_mapped_peak=mapped_peak,
                direct_io=self.direct_io, io_backend=knobs.current().io_backend,
                features=FEATURES, client_budget=s.budgets.client,
            )
            if s.memory is not None:
                reply.memory_tier_count, reply.memory_tier_budget = s.memory.count, s.memory.budget
                reply.memory_tier_bytes, reply.memory_tier_copies = s.memory.usage()
            if self.peering is not None:
                settings, store, sender = self.peering
                reply.node_name, reply.failure_domain = settings.node, settings.domain
                reply.job, reply.replicas = settings.job, settings.replicas
                reply.replica_budget = store.budget
                reply.replica_bytes, reply.replicas_held = store.usage()
                if sender is not None:
                    peers, pending = sender.status()
                    reply.peers.extend(peers)
                    reply.replication_pending = pending
            if s.tier is not None:
                t = s.tier.status()
                reply.tier_url, reply.tier_pending = t.url, len(t.pending)
                reply.tier_failing, reply.tier_uploaded = len(t.failing), t.uploaded
                reply.tier_failures = t.failures
                reply.tier_last_error = (t.last_error or "")[:1000]
            return reply
        return self._guard(context, run)

    def Begin(self, request: pb.BeginRequest, context: grpc.ServicerContext
              ) -> pb.BeginResponse:
        def run() -> pb.BeginResponse:
            ck = self.service.begin(parse(request.path), request.client_id,
                                    request.staging_bytes, request.file_count,
                                    request.job_id, request.rank,
                                    compression=request.compression,
                                    frame_bytes=request.frame_bytes,
                                    durability=request.durability)
            return pb.BeginResponse(checkpoint_id=ck.id)
        return self._guard(context, run)

    def Open(self, request: pb.BeginRequest, context: grpc.ServicerContext
             ) -> Iterator[pb.CheckpointStatus]:
        def run() -> Checkpoint:
            return self.service.begin(parse(request.path), request.client_id,
                                      request.staging_bytes, request.file_count,
                                      request.job_id, request.rank, leased=True,
                                      compression=request.compression,
                                      frame_bytes=request.frame_bytes,
                                      durability=request.durability)
        ck = self._guard(context, run)
        # The lease ends with the call, however it ends (done, cancelled, the
        # client's connection gone): gRPC's termination callback, rather than
        # the generator's cleanup, which a call broken off may never run.
        if not context.add_callback(lambda: self.service.watch_ended(ck)):
            self.service.watch_ended(ck)  # over already
        for status in self.service.follow(ck, context.is_active):
            yield _status(status)

    def SubmitShm(self, request: pb.SubmitShmRequest, context: grpc.ServicerContext
                  ) -> pb.SubmitResponse:
        def run() -> pb.SubmitResponse:
            f, ref = request.file, request.data
            with parsing(submitted.header_size(f.header, request.header_ref.length)):
                header = submitted.shm_header(request, self.service.shm_fd)
                ck, entries = self.service.check_submit(request.checkpoint_id, f.index, header,
                                                        ref.length)
            mapping = shm.open_range(self.service.shm_fd, ref.segment, ref.offset, ref.length,
                                     shm.tag_for(ck.id))
            self.service.submit(ck, f.index, header, entries, mapping)
            return pb.SubmitResponse()
        return self._guard(context, run)

    def SubmitStream(self, request_iterator: Iterator[pb.StreamChunk],
                     context: grpc.ServicerContext) -> pb.SubmitResponse:
        def run() -> pb.SubmitResponse:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("part") != "header":
                raise invalid("a SubmitStream must start with a header chunk")
            head, chunks = first.header, submitted.data_chunks(request_iterator)
            with parsing(submitted.header_size(head.file.header, head.header_length)):
                header = submitted.stream_header(head, chunks, self.service.registry)
                ck, entries = self.service.check_submit(head.checkpoint_id, head.file.index,
                                                        header, head.data_length, streamed=True)
            # Written to disk as it arrives; the call returns when the file is durable.
            self.service.streams.receive(ck, head.file.index, header, entries,
                                         head.data_length, chunks,
                                         cancel=context.cancel, alive=context.is_active)
            return pb.SubmitResponse()
        return self._guard(context, run)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext
               ) -> pb.CommitResponse:
        return self._guard(context, lambda: self._commit(request))

    def CommitStream(self, request_iterator: Iterator[pb.CommitChunk],
                     context: grpc.ServicerContext) -> pb.CommitResponse:
        def run() -> pb.CommitResponse:
            with large_requests.commit_request(request_iterator, self.service.registry,
                                               context.is_active, context.cancel) as request:
                return self._commit(request)
        return self._guard(context, run)

    def _commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        check_names(request.tensor_order)
        self.service.commit(request.checkpoint_id, request.tree_json,
                            list(request.tensor_order), _after_commit(request))
        return pb.CommitResponse()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        def run() -> pb.AbortResponse:
            self.service.abort(request.checkpoint_id)
            return pb.AbortResponse()
        return self._guard(context, run)

    def Wait(self, request: pb.WaitRequest, context: grpc.ServicerContext
             ) -> pb.CheckpointStatus:
        return self._guard(context, lambda: _status(self.service.wait(
            request.checkpoint_id, request.min_files_written, alive=context.is_active)))

    def Watch(self, request: pb.WaitRequest, context: grpc.ServicerContext
              ) -> Iterator[pb.CheckpointStatus]:
        statuses = self.service.watch(request.checkpoint_id, alive=context.is_active)
        # The generator's first step raises NOT_FOUND; later ones only yield.
        try:
            first = next(statuses)
        except RequestError as exc:
            self._reject(context, exc.code, str(exc))
            return
        except StopIteration:
            return
        yield _status(first)
        for status in statuses:
            yield _status(status)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        def run() -> pb.ListResponse:
            path = parse(request.path, allow_root=True, checkpoint=False)
            memory = self.service.memory
            held = memory.memory_only_under(path.text) if memory is not None else []
            try:
                entries, in_flight = self.service.list(path)
            except RequestError as exc:  # a run saved to memory only has no directory yet
                if exc.code != "NOT_FOUND" or not held:
                    raise
                entries, in_flight = [], []
            return pb.ListResponse(
                memory_only=[pb.ListEntry(name=name, state="memory", bytes=nbytes,
                                          created_unix=created)
                             for name, nbytes, created in held],
                entries=[pb.ListEntry(name=name, state=state, bytes=nbytes, created_unix=created,
                                      note=note)
                         for name, state, nbytes, created, note in entries],
                # Without ids: an id is the capability to submit to, commit or abort a
                # checkpoint, and only the client that began it should hold it.
                in_flight=[_status({**c.status(), "checkpoint_id": ""}) for c in in_flight])
        return self._guard(context, run)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext
               ) -> pb.DeleteResponse:
        def run() -> pb.DeleteResponse:
            self.service.delete(parse(request.path))
            return pb.DeleteResponse()
        return self._guard(context, run)

    def BeginJob(self, request: pb.BeginJobRequest, context: grpc.ServicerContext
                 ) -> pb.BeginJobResponse:
        def run() -> pb.BeginJobResponse:
            job_id = self.service.jobs.begin_job(parse(request.path), request.client_id)
            return pb.BeginJobResponse(job_id=job_id)
        return self._guard(context, run)

    def CommitJob(self, request: pb.CommitJobRequest, context: grpc.ServicerContext
                  ) -> pb.CommitJobResponse:
        return self._guard(context, lambda: self._commit_job(request))

    def CommitJobStream(self, request_iterator: Iterator[pb.CommitJobChunk],
                        context: grpc.ServicerContext) -> pb.CommitJobResponse:
        def run() -> pb.CommitJobResponse:
            with large_requests.commit_job_request(request_iterator, self.service.registry,
                                                   context.is_active, context.cancel) as request:
                return self._commit_job(request)
        return self._guard(context, run)

    def _commit_job(self, request: pb.CommitJobRequest) -> pb.CommitJobResponse:
        if len(request.node) > MAX_ID_BYTES or len(request.prepare_for) > MAX_ID_BYTES:
            raise invalid(f"a node is at most {MAX_ID_BYTES} characters")
        files = dict(request.files)
        check_extra_files(files)
        if request.prepare_for:
            if request.HasField("after_commit"):
                raise invalid("a prepared part is not published: no after_commit with "
                              "prepare_for")
            prepared = self.service.jobs.prepare_job(
                request.job_id, request.manifest, request.node, request.prepare_for, files)
            return pb.CommitJobResponse(prepared=prepared)
        error = self.service.jobs.commit_job(request.job_id, request.manifest, request.node,
                                             _after_commit(request), files)
        return pb.CommitJobResponse(after_commit_error=error)

    def ResolvePrepared(self, request: pb.ResolvePreparedRequest,
                        context: grpc.ServicerContext) -> pb.ResolvePreparedResponse:
        def run() -> pb.ResolvePreparedResponse:
            if len(request.prepared) > MAX_ID_BYTES:
                raise invalid(f"a prepared part's name is at most {MAX_ID_BYTES} characters")
            self.service.jobs.resolve_prepared(parse(request.path), request.prepared,
                                               request.publish)
            return pb.ResolvePreparedResponse()
        return self._guard(context, run)

    def MemoryCopy(self, request: pb.MemoryCopyRequest, context: grpc.ServicerContext
                   ) -> pb.MemoryCopyResponse:
        def run() -> pb.MemoryCopyResponse:
            path, memory = parse(request.path), self.service.memory
            found = (memory.lookup(path, self.service.root) if memory is not None else
                     "this fastpersistd keeps no checkpoint in memory (--memory-tier-count 0)")
            if isinstance(found, str):
                return pb.MemoryCopyResponse(reason=found)
            return pb.MemoryCopyResponse(manifest=found[0], directory=found[1],
                                         memory_only=found[2])
        return self._guard(context, run)

    def Replicate(self, request_iterator: Iterator[pb.ReplicaChunk | Data],
                  context: grpc.ServicerContext) -> pb.ReplicateResponse:
        def run() -> pb.ReplicateResponse:
            first = next(request_iterator, None)
            if not isinstance(first, pb.ReplicaChunk) or first.WhichOneof("part") != "header":
                raise invalid("a Replicate stream must start with a header chunk")
            with replica_manifest.room(first.header, request_iterator, context) as (
                    chunks, kept):  # (the manifest unnamed: the store drops a large one)
                self._store().receive(first.header,
                                      replica_manifest.receive(first.header, chunks),
                                      replica_manifest.data_only(chunks), kept)
            return pb.ReplicateResponse()
        return self._guard(context, run)

    def Replicas(self, request: pb.ReplicasRequest, context: grpc.ServicerContext
                 ) -> pb.ReplicasResponse:
        def run() -> pb.ReplicasResponse:
            reply = pb.ReplicasResponse()
            if self.peering is not None:
                reply.node, reply.failure_domain = self.peering[0].node, self.peering[0].domain
            for r in self._store().listing():
                info = reply.replicas.add(node=r.node, path=r.path, bytes=r.size,
                                          complete=r.complete, failure_domain=r.domain,
                                          committed_unix=r.committed_unix,
                                          manifest_bytes=r.manifest_len)
                if r.complete:  # a large one is read with ReadReplica (peer_read.py)
                    info.manifest_sha256 = r.sha256
                    if r.inline:
                        info.manifest = r.manifest
                for name, size in r.files:
                    info.files.add(name=name, size=size)
            return reply
        return self._guard(context, run)

    def ReadReplica(self, request: pb.ReadReplicaRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.ReplicaData]:
        yield from self._guard(context, lambda: replicas.read(self._store(), request))

    def _store(self) -> replicas.ReplicaStore:
        if self.peering is None:
            raise RequestError("RESOURCE_EXHAUSTED", "this fastpersistd keeps no replicas")
        return self.peering[1]

    def AbortJob(self, request: pb.AbortJobRequest, context: grpc.ServicerContext
                 ) -> pb.AbortJobResponse:
        def run() -> pb.AbortJobResponse:
            self.service.jobs.abort_job(request.job_id)
            return pb.AbortJobResponse()
        return self._guard(context, run)


def _after_commit(request: pb.CommitRequest | pb.CommitJobRequest) -> AfterCommit | None:
    if not request.HasField("after_commit"):
        return None
    a = request.after_commit
    return AfterCommit(a.point_latest, a.keep_last or None, a.keep_every or None,
                       upload=not a.skip_tier)
