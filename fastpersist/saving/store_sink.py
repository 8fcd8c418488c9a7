"""The object-store sink: a checkpoint saved straight to s3://BUCKET/PREFIX,
with no local file on the way. See sink.py for the call sequence.

The objects are those the tier uploads (tier/upload.py) and
`load("s3://...")` reads: PREFIX/data-NNNNN.safetensors, each the data file
a local save writes (safetensors, the data section 4 KiB-aligned), and
PREFIX/manifest.json, the same manifest.

    caller  begin    the URL (StoreURLError), the client (credentials), a read
                     of the manifest there: a missing bucket or no credentials
                     fail here, in the caller, before anything is copied. A
                     checkpoint already there is deleted, manifest first: it
                     is invisible from this moment (replacing one in a store
                     is not atomic, as a local replace is).
    writer  write    each data file: its header, then its tensors' bytes, from
                     the staging buffer (save(): the live tensors, nothing
                     staged), appended to a multipart upload (tier/parts.py:
                     parts of FASTPERSIST_TIER_PART_BYTES, every request
                     retried, then a TierError). The files overlap: the next
                     one's parts go while the last parts and the completion
                     of the one before are in flight (a completion is long:
                     the store assembles the object). One bound for the whole
                     save: FASTPERSIST_TIER_CONCURRENCY parts in flight and
                     one being filled, i.e. at most (concurrency + 1) x part
                     bytes held (9 x 16 MiB by default). The CRC32C of
                     the header and of each tensor is computed from the very
                     bytes sent. Then manifest.json, with a conditional put
                     (If-None-Match: *): the checkpoint appears, whole, in one
                     step. **Durable when that put returns**: save() returns,
                     the future resolves. Then the policy (store_retention.py).

A failure before the manifest leaves nothing visible, and the multipart
uploads are aborted. A process killed mid-save leaves no manifest either; its
open uploads are taken up by the next save to the same URL (parts.py keeps
each part whose size and MD5 match the part about to be sent: a save of the
same bytes resumes), aborted by a Checkpointer's next commit in the store
(older steps), and swept by `fpctl gc --older-than`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from .. import gcpause
from .._version import __version__
from ..checksum import crc32c
from ..errors import (
    BucketNotFoundError,
    CheckpointAbortedError,
    TierError,
    UnsupportedPathError,
)
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ..format.names import data_file_name
from ..knobs import current as current_knobs
from ..tensors import datafile
from ..tensors.plan import StoredTensor, memory_of
from ..tier.client import S3, client_for
from ..tier.parts import PartStream
from ..tier.retention import delete_checkpoint
from ..tier.upload import CODEC_KEY
from ..tier.url import TierURL
from .files import StagedFiles
from .local import Planned, cut, plan_state
from .sink import SaveRequest
from .snapshot import FilePlan
from .staging import StagingPool
from .store_retention import after_commit_in_store


def _url(request: SaveRequest) -> TierURL:
    if not isinstance(request.target, TierURL):
        raise UnsupportedPathError(f"{request.target} is not an s3:// URL: the object-store "
                                   "sink saves only to a store")
    return request.target


class StoreJob:
    def __init__(self, s3: S3, url: TierURL, planned: Planned, files: list[FilePlan],
                 budget: int, request: SaveRequest) -> None:
        self.s3, self.url = s3, url
        self.tree, self.stored = planned
        self.files = files
        self.budget = budget
        self.request = request

    def owned(self) -> None:
        """Nobody else takes it over: it is this process's until the manifest is put."""

    def write(self, files: StagedFiles, pool: StagingPool) -> None:
        file_records: list[FileRecord] = []
        records: dict[str, TensorRecord] = {}
        # The data files overlap: while one file's last parts are in flight and
        # its upload is completed (a long request: the store assembles the
        # object), the next file's parts are already produced and sent. All
        # files share one bound of parts in flight, so at most (concurrency
        # + 1) parts of bytes are held, whatever the number of files.
        slots = threading.BoundedSemaphore(self.s3.concurrency)
        streams: list[PartStream] = []
        completed: list[Future[None]] = []
        with ThreadPoolExecutor(self.s3.concurrency, thread_name_prefix="fp-store-part"
                                ) as parts, \
                ThreadPoolExecutor(1, thread_name_prefix="fp-store-complete") as completer:
            try:
                for staged in files:
                    if self.request.aborted():
                        raise CheckpointAbortedError(f"save to {self.url} was aborted")
                    for done in completed:  # a file that failed stops the save now
                        if done.done():
                            done.result()
                    staged.wait_copied()
                    stream = PartStream(self.s3, self.url, data_file_name(len(file_records)),
                                        {CODEC_KEY: "raw"}, parts, late_header=False,
                                        slots=slots)
                    streams.append(stream)
                    file_records.append(self._send(staged.tensors, stream, records))
                    completed.append(completer.submit(stream.finish))
                    # Every byte of it is copied into a part by now: the buffer
                    # may take a later file of this save.
                    pool.give_back(staged)
                for done in completed:
                    done.result()
            except BaseException:
                for done in completed:
                    done.cancel()
                wait(completed)  # no upload is completed after this
                for i, stream in enumerate(streams):  # those not completed
                    if i >= len(completed) or completed[i].cancelled() or \
                            completed[i].exception() is not None:
                        stream.abort()
                raise
        with gcpause.paused():  # a record per tensor: many objects, no cycles
            manifest = Manifest(files=tuple(file_records),
                                tensors=tuple(records[t.name] for t in self.stored),
                                tree=self.tree, fastpersist_version=__version__,
                                created_unix=time.time()).to_json()
        if self.request.aborted():
            raise CheckpointAbortedError(f"save to {self.url} was aborted")
        if not self.s3.put_new(self.url, MANIFEST_NAME, manifest):
            raise TierError(f"another writer saved a checkpoint at {self.url} while this save "
                            "was writing it (one writer per prefix); this save is not committed")
        if self.request.after_commit is not None:
            after_commit_in_store(self.s3, self.url, self.request.after_commit)

    def _send(self, tensors: list[StoredTensor], stream: PartStream,
              records: dict[str, TensorRecord]) -> FileRecord:
        """One data file, as datafile.write lays it out, written to `stream`
        and sealed; its FileRecord, and each tensor's record into `records`."""
        name = stream.name
        plan = datafile.plan_file(tensors)
        lay = plan.layout
        stream.write(lay.header)
        for t, offset in zip(plan.order, lay.offsets, strict=True):
            # Staged: a view of the buffer; save(): the live tensor (a device
            # one copied to the host here, one tensor at a time).
            source = t.source if t.source.device.type == "cpu" else t.source.cpu()
            memory = memory_of(source)
            records[t.name] = TensorRecord(t.name, name, offset, t.nbytes, t.dtype, t.shape,
                                           crc32c(memory))
            stream.write(memory)
        stream.seal()
        return FileRecord(name=name, size=lay.size, data_start=lay.data_start,
                          header_crc32c=crc32c(lay.header))


class StoreSink:
    """Saves to s3:// URLs (each save names its own), through the client of
    `endpoint_url` (None: the standard AWS configuration, AWS_ENDPOINT_URL)."""

    collective = False
    leader = True  # this process commits
    writes_in_process = True  # save() streams from the live tensors, nothing staged
    takes_urls = True

    def __init__(self, pool: StagingPool | None = None, endpoint_url: str | None = None
                 ) -> None:
        self.pool = pool or StagingPool()
        self.endpoint_url = endpoint_url

    def plan(self, obj: Any, request: SaveRequest) -> Planned:
        return plan_state(obj, request)

    def cut(self, planned: Planned, request: SaveRequest) -> list[FilePlan]:
        return cut(planned[1], request)[0]

    def staging_budget(self) -> int:
        return current_knobs().staging_budget

    def begin(self, planned: Planned, request: SaveRequest) -> StoreJob:
        url = _url(request)
        if request.durability != "disk":
            raise ValueError("a memory-only save is kept by fastpersistd: save through it")
        if request.compression is not None:
            raise UnsupportedPathError(
                f"compression={request.compression!r} to {url} is not supported: save it raw "
                "there, or save locally with Checkpointer(root, tier=..., "
                "tier_compression='zstd'), which compresses on the way to the store")
        if not url.prefix:
            raise UnsupportedPathError(f"{url} is a bucket: save to a prefix in it "
                                       "(s3://BUCKET/PREFIX)")
        s3 = client_for(self.endpoint_url)
        # Raises here, in the caller: no bucket, no credentials, a store that fails.
        try:
            existing = s3.get(url, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        except BucketNotFoundError:
            raise BucketNotFoundError(f"cannot save to {url}: bucket {url.bucket!r} does not "
                                      "exist in the store (create it first)") from None
        if existing is not None:
            delete_checkpoint(s3, url)  # manifest first: invisible, never mixed
        files, budget = cut(planned[1], request)
        return StoreJob(s3, url, planned, files, budget, request)

    def close(self) -> None:
        """Nothing beyond the pool, which the pipeline clears."""


__all__ = ["StoreJob", "StoreSink"]
