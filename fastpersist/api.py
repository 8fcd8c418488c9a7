"""fastpersist.save, async_save and load: drop-ins for torch.save/torch.load on state dicts.

The one place that chooses where a save goes (sink_for): this process's
local files (saving/local.py), fastpersistd (saving/remote.py), or a
distributed job (distributed/sink.py); every save runs through the one save
pipeline (saving/pipeline.py) to it. checkpointer.py and the integrations
take their pipelines from here. The layers below never choose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .errors import CheckpointNotFoundError, UnsupportedPathError
from .files.dispatch import (
    is_file_source,
    is_file_target,
    load_file,
    save_file,
    store_file_hint,
)
from .knobs import current as current_knobs
from .loading.handle import open as open  # fastpersist.open: partial and lazy reads
from .loading.load import load_from, source_for
from .saving import registry as pipelines
from .saving.futures import SaveFuture
from .saving.local import LocalSink
from .saving.pipeline import SavePipeline
from .saving.sink import Sink
from .tensors import packed
from .tensors.factory import MapLocation
from .tier.url import TierURL, is_tier_url


def save(obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
         daemon: str | None = None, process_group: Any = None,
         node_local: bool = False, compression: str | None = None, union: bool = False
         ) -> None:
    """Save `obj` as a checkpoint directory at `path`.

    `obj` is what torch.save takes for checkpoints: nested dicts, OrderedDicts,
    lists and tuples of tensors, numbers, strings, None, bytes, torch dtypes,
    devices and sizes (`model.state_dict()`, `optimizer.state_dict()`), and
    numpy arrays and scalars (stored as tensors, loaded as numpy: an RNG
    state from np.random.get_state() needs no pickle). Anything else needs
    pickle and raises UnsupportedValueError unless allow_pickle=True.

    When save returns, the checkpoint is durable: data and manifest fsynced,
    the directory renamed into place and its parent fsynced. An existing
    checkpoint at `path` is replaced atomically; until then it stays intact,
    and a crash at any moment leaves either the old or the new one. Missing
    parent directories are created. Errors are CheckpointError subclasses
    (DiskFullError, CheckpointPermissionError, ...) and leave nothing behind.

    With a daemon (`daemon="unix:///PATH"` or FASTPERSIST_DAEMON; "" forces
    in-process) fastpersistd writes it from shared memory, with the same
    result on disk; `path` must lie under the daemon's --root.

    In a torch.distributed job, pass process_group (e.g. torch.distributed.group.WORLD)
    and call save on every rank of it: each unique byte of the job is written by
    exactly one rank, balanced over nodes and ranks, and rank 0 commits the
    job manifest last (fastpersist/distributed/coordinator.py). DTensors are
    saved as their global tensors. The tree's non-tensor values are taken from
    rank 0. node_local=True: each rank passes its node's local path and each
    node keeps the files its ranks wrote. With a daemon, each rank hands its
    part to its own node's daemon and the job is committed there. Every rank
    must hold the same tensors unless union=True: then ranks may hold
    different parts of the state (pipeline stages, experts) and the
    checkpoint is their union; a key names one tensor wherever it appears,
    and a non-tensor value that ranks of different stages hold must be the
    same on each (docs/guides/distributed.md, "Pipeline stages").

    compression="zstd" (default None: raw) stores each tensor of 4 KiB or more
    byte-grouped and zstd-compressed, in frames of FASTPERSIST_FRAME_BYTES
    encoded on FASTPERSIST_CODEC_THREADS threads (by whoever writes the file:
    this process, each rank, or the daemon); the data files are then packed
    files (data-NNNNN.fpz), not safetensors. Loads decode them transparently,
    checking the same CRC32Cs (README "Compression").

    A single file instead (docs/guides/files.md): `path` named *.safetensors
    is written as one standard safetensors file (a flat dict of tensors; the
    engine's direct I/O, 4 KiB-aligned data, each tensor's CRC32C in its
    __metadata__), and *.pt, *.pth or *.bin as one torch.save file (loadable
    by torch.load(weights_only=True): a value that would need pickle raises
    UnsupportedValueError unless allow_pickle=True); either is replaced
    atomically and durable on return. A name that already is a directory
    stays a checkpoint directory. An open binary file or io.BytesIO gets
    torch.save's format, written buffered and not fsynced. Single files are
    written by this process (not a daemon) and take none of daemon,
    process_group, node_local or compression (TypeError if given).

    `path` may be "s3://BUCKET/PREFIX": the checkpoint is written straight to
    the object store by this process (the standard AWS configuration), no
    local file; durable when save returns means its manifest's conditional
    put succeeded (docs/guides/tier.md, "Saving straight to the object store").
    Unlike on disk, replacing a checkpoint there is not atomic: the old one is
    deleted (its manifest first) before the new one is written, so a save
    that fails leaves none at that URL; save each step under a URL of its own.
    """
    if is_file_target(path):
        save_file(obj, path, allow_pickle=allow_pickle, options={
            "daemon": daemon, "process_group": process_group, "node_local": node_local,
            "compression": compression, "union": union})
        return
    packed.check_compression(compression)
    pipeline_for(daemon, process_group, node_local, store=is_tier_url(path),
                 union=union).save_blocking(
        obj, path, allow_pickle=allow_pickle, compression=compression)


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    allow_pickle: bool = False,
    verify: bool | None = None,
    progress: Callable[[int], None] | None = None,
    like: Any = None,
    into: Any = None,
    daemon: str | None = None,
    tier: str | None = None,
) -> Any:
    """Load the checkpoint at `path` and return an object equal to what was saved.

    Tensors go back to the device they were saved from unless `map_location`
    (a device, or a dict from saved device to device, as in torch.load) says
    otherwise. Every tensor's CRC32C is checked unless verify=False (default:
    FASTPERSIST_VERIFY_LOAD, on); a mismatch raises ChecksumMismatchError naming
    the file and tensor. Nothing from the checkpoint is unpickled unless
    allow_pickle=True. progress(n), if given, is called as each n bytes of
    tensors have been read (for progress bars).

    `path` may be a checkpoint in an object store, "s3://BUCKET/PREFIX/step-N"
    (the tier: Checkpointer(tier=...), fastpersistd --tier): the tensors are
    read by parallel ranged GETs straight into their memory, with the same
    checks (see load_from_tier).

    `into`, a state the caller already has (model.state_dict(), or a dict of
    several): each of its tensors receives the checkpoint's tensor at the same
    place, in its own memory (shapes must match; dtypes and devices are
    converted), and the returned object holds those tensor objects there:
    no second copy of the state in memory. A contiguous CPU tensor is read
    straight into, as is a GPU tensor on the device a load streams to
    (into.py); StateMismatchError, before anything is read, if a shape
    differs or `into` has a tensor the checkpoint does not. If the load
    raises, those tensors may hold part of the checkpoint's values. Only the
    part of the checkpoint that `into` (or `like`) names is read and
    returned: into={"model": ...} leaves the optimizer's tensors unread
    and out of the result (plain values stay; tensors/into.py says exactly).

    With a daemon (`daemon="unix:///PATH"` or FASTPERSIST_DAEMON; "": none),
    a checkpoint that the daemon on this node committed and still holds in
    memory (fastpersistd --memory-tier-count) is read from there, with the
    same checks, and from disk if the daemon is down, slow (2 s), holds no
    valid copy, or its copy fails a check (a RuntimeWarning says which).

    Where the local copy is corrupt or gone (a node lost), the checkpoint is
    read from the object store, with a RuntimeWarning, if the store holds
    the same checkpoint: at `tier` ("s3://BUCKET/PREFIX/NAME", its URL
    there), or else under the daemon's --tier (ROOT/REL at PREFIX/REL).
    Copies are tried fastest first (memory, disk, peers, the store), each
    verified; if all fail, the error lists each copy and why.

    Where no checkpoint is on disk at `path`, a memory-only one the daemon
    holds there (Checkpointer(memory_every=...)) is loaded, with the same
    checks and no disk behind it.

    A file rather than a directory (docs/guides/files.md), told by its first
    bytes: a torch.save file (.pt, .bin; zip or legacy format) is read by
    torch.load with weights_only=True unless allow_pickle=True (a file that
    holds other objects raises PickleNotAllowedError naming them); a
    safetensors file gives the dict of its tensors, each CRC32C checked
    where fastpersist wrote it. A file object (open binary file, io.BytesIO)
    may hold either. map_location also takes torch's callable,
    (storage, location) -> storage, for every kind of source.
    """
    if is_file_source(path):
        return load_file(path, map_location, allow_pickle=allow_pickle, verify=verify, options={
            "progress": progress, "like": like, "into": into, "daemon": daemon, "tier": tier})
    try:
        return load_from(source_for(path, daemon=daemon, tier=tier), map_location,
                         allow_pickle=allow_pickle, verify=verify, progress=progress, like=like,
                         into=into)
    except CheckpointNotFoundError as exc:
        hint = store_file_hint(path)
        if not hint:
            raise
        raise CheckpointNotFoundError(f"{exc}{hint}") from None


def load_from_tier(url: str, map_location: MapLocation = None, *, allow_pickle: bool = False,
                   verify: bool | None = None, progress: Callable[[int], None] | None = None,
                   endpoint_url: str | None = None, like: Any = None, into: Any = None) -> Any:
    """load() of the checkpoint at `url` (s3://BUCKET/PREFIX/NAME) in an object
    store; endpoint_url overrides the standard AWS configuration's endpoint.
    Every tensor's CRC32C is checked as for a local load (ChecksumMismatchError
    names the file and tensor); compressed tensors are fetched as their stored
    frames (each frame's CRC32C checked) and decoded in parallel; a checkpoint
    whose manifest is not in the store (an upload not finished) is
    CheckpointNotFoundError. A distributed checkpoint is loaded as locally
    (like= included): only the chunks, or the frames of them, each rank
    needs are fetched. into= as for load: a raw tensor is fetched straight
    into the caller's contiguous CPU tensor."""
    TierURL.parse(url)  # ValueError for anything but an s3:// URL
    return load_from(source_for(url, endpoint_url), map_location, allow_pickle=allow_pickle,
                     verify=verify, progress=progress, like=like, into=into)


# -- the one place that chooses where a save goes ----------------------------------


def sink_for(daemon: str | None = None, process_group: Any = None,
             node_local: bool = False, *, store: bool = False, union: bool = False) -> Sink:
    """The destination of a save: an object store (store=True: the target is
    an s3:// URL; this process writes it, whatever FASTPERSIST_DAEMON says), a
    torch.distributed job's (process_group; "world" or
    torch.distributed.group.WORLD for the default group), through
    fastpersistd at `daemon` (None: FASTPERSIST_DAEMON, if set; "": in-process),
    or this process's local files. union: save's."""
    if union and process_group is None:
        raise ValueError("union=True needs process_group (a distributed save)")
    if store:
        if process_group is not None or node_local or daemon:
            raise UnsupportedPathError(
                "a save to s3:// is written by this process; a distributed job or fastpersistd "
                "saves to a shared filesystem and uploads it: Checkpointer(root, tier='s3://..."
                "'), fastpersistd --tier")
        from .saving.store_sink import StoreSink

        return StoreSink()
    address = current_knobs().daemon if daemon is None else daemon
    if process_group is not None:
        from .distributed.sink import DistributedSink

        group = None if process_group == "world" else process_group
        return DistributedSink(group, node_local=node_local, daemon=address, union=union)
    if node_local:
        raise ValueError("node_local=True needs process_group (a distributed save)")
    if address:
        from .saving.remote import DaemonSink

        return DaemonSink(address)
    return LocalSink()


def pipeline_for(daemon: str | None = None, process_group: Any = None,
                 node_local: bool = False, *, max_in_flight: int | None = None,
                 shared: bool = True, store: bool = False, union: bool = False
                 ) -> SavePipeline:
    """The save pipeline to sink_for's destination: the process-wide one for
    it (save, async_save, prepare_staging), or with shared=False a new one
    (a Checkpointer's, an integration's), holding staging of its own."""
    if store:  # one store sink serves every URL
        def make() -> SavePipeline:
            return SavePipeline(sink_for(daemon, process_group, node_local, store=True,
                                         union=union), max_in_flight)
        return pipelines.shared(("store",), make) if shared else make()
    if not shared:
        return SavePipeline(sink_for(daemon, process_group, node_local, union=union),
                            max_in_flight)
    address = current_knobs().daemon if daemon is None else daemon
    if process_group is None and (node_local or union):
        raise ValueError(f"{'node_local' if node_local else 'union'}=True needs process_group "
                         "(a distributed save)")
    key = ("distributed", "world" if process_group is None or process_group == "world"
           else process_group, node_local, address, union) if process_group is not None else (
        "daemon", address) if address else ("local",)
    return pipelines.shared(key, lambda: SavePipeline(
        sink_for(address, process_group, node_local, union=union), max_in_flight))


def prepare_staging(obj: Any, *, allow_pickle: bool = False, daemon: str | None = None) -> int:
    """Allocate and fault in the staging memory that async_save(obj, ...)
    takes (with `daemon` as async_save reads it), so that the first
    async_save of a process stalls no longer than the later ones. Only the
    shapes, dtypes and devices of obj's tensors matter. Returns the bytes of
    staging ready. Distributed saves (process_group) have staging of their own,
    which this does not prepare: do not call it for them."""
    return pipeline_for(daemon).prepare_staging(obj, allow_pickle=allow_pickle)


def async_save(obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
               wait_for_snapshot: bool = True, daemon: str | None = None,
               process_group: Any = None, node_local: bool = False,
               compression: str | None = None, union: bool = False) -> SaveFuture:
    """Save `obj` to `path` in the background; returns once the snapshot is taken.

    On return every tensor has been copied into staging memory and the caller
    may change the state freely (with wait_for_snapshot=False it returns as
    soon as the device-to-host copies are queued: call future.wait_snapshot()
    before changing CUDA tensors). `future.result()` returns when the
    checkpoint is durable, with the same guarantees as save(), and raises the
    background error if there was one. At most FASTPERSIST_MAX_IN_FLIGHT saves
    (default 1) persist at once: the next call waits for the previous one.

    With a daemon (`daemon="unix:///PATH"` or FASTPERSIST_DAEMON), the staging
    memory is shared with fastpersistd, which writes the checkpoint; once this
    returns (or wait_snapshot() does), the daemon commits it even if this
    process dies. `path` must lie under the daemon's --root.

    With process_group (call it on every rank), a distributed save as in
    fastpersist.save: each rank snapshots only the pieces it was assigned, and
    the writes and the global commit run in the background (the next call
    waits for them); with a daemon, each rank's node's daemon writes its part.
    union=True: as in fastpersist.save, ranks may hold different tensors.

    compression="zstd": as in fastpersist.save; the background thread (or
    the daemon) compresses, the caller's stall is the snapshot's copy as
    without it. "s3://BUCKET/PREFIX": as in fastpersist.save; the background
    thread streams the staged files up.
    """
    if is_file_target(path):
        raise UnsupportedPathError(
            f"async_save writes checkpoint directories; {path!r} names a single file "
            "(a file object or a .pt/.pth/.bin/.safetensors name): use save() for it, or "
            "a directory name")
    packed.check_compression(compression)
    return pipeline_for(daemon, process_group, node_local, store=is_tier_url(path),
                        union=union).save(
        obj, path, allow_pickle=allow_pickle, wait_for_snapshot=wait_for_snapshot,
        compression=compression)
