"""Uploading one committed checkpoint directory, the manifest last.

    1. Read the local manifest (validated) and open every data file it lists,
       by name in the directory held open, without following links; each
       must have the size the manifest says.
    2. If the store already holds a manifest there: the same bytes, or one
       made from the same local manifest (its `fastpersist-source`), mean
       the checkpoint is uploaded (a retry, a restart) and nothing is sent;
       other bytes mean an older checkpoint of that name (the local one was
       saved again): its manifest is deleted first, so it is invisible, never
       a mix, while this one replaces it.
    3. Upload the data files (compressed: see below), each in multipart
       parts of FASTPERSIST_TIER_PART_BYTES, FASTPERSIST_TIER_CONCURRENCY in
       flight (parts.py; bounded memory), every byte read checked against
       the manifest's CRC32Cs on the way (checked.py: a file corrupted on
       the local disk never goes up), each request retried with backoff
       (client.py). A failed multipart upload is aborted; one that cannot be
       (the store went away) is swept later (retention.sweep_uploads); one a
       killed uploader left open is taken up by the next attempt (parts.py).
    4. Write manifest.json with a conditional put (If-None-Match: *): the
       remote checkpoint becomes visible, complete, in one step, and never
       replaces one that appeared meanwhile. Then list the objects: one
       that is missing or of the wrong size (deleted meanwhile) takes the
       manifest down again, and the upload fails (to be retried).

A failure at any step leaves no manifest: nothing partial is visible, and the
next attempt sends the data files again (they are overwritten in place),
except the parts a killed uploader had sent (parts.py).

Compression (compression="zstd", the uploader's default): the data files
of a raw checkpoint are compressed on the way (compress.py) into packed
objects NAME.fpz, and the manifest written is the local one with their
records; a checkpoint already compressed locally (packed files) is sent as
it is. Every data object carries its codec in its metadata
(`fastpersist-codec`: raw, or zstd-bytegroup-v1), and the remote manifest
the SHA-256 of the local manifest it was made from (`fastpersist-source`),
which is how step 2 recognises a checkpoint uploaded compressed.

What goes wrong is one of three kinds, and the uploader acts on the kind:
NotUploadable (not a committed checkpoint, a node-local part: dropped),
checked.LocalCorruption (a CRC32C, a size or a file that does not match the
manifest: never uploaded, reported as corrupt, naming the file and tensor),
or anything else (the store, a passing local error: EMFILE, ENOMEM, EIO):
tried again later.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CheckpointError, CheckpointIOError, TierError
from ..format import packed_file
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.frames import ZSTD_BYTEGROUP
from ..format.manifest import MANIFEST_NAME, Manifest, TensorRecord
from ..storage import dirs
from .checked import CheckedFile, LocalCorruption
from .client import S3, tier_error
from .parts import PartStream
from .remote import object_sizes
from .url import TierURL

CODEC_KEY = "fastpersist-codec"
SOURCE_KEY = "fastpersist-source"
COMPRESSIONS = ("zstd", "none")


def check_compression(value: str | None) -> str | None:
    """A tier_compression setting: "zstd" or None ("none" is None)."""
    if value not in (None, *COMPRESSIONS):
        raise ValueError(f"tier_compression must be 'zstd' or 'none', not {value!r}")
    return None if value in (None, "none") else value


class NotUploadable(TierError):
    """The local directory is not a checkpoint that can be uploaded (not
    committed, or a node-local part of a distributed one): retrying will not
    help. A checkpoint that does not match its manifest raises
    checked.LocalCorruption instead; any other failure (the store, a passing
    local error such as EMFILE or EIO) is worth another attempt."""


@dataclass(frozen=True)
class Uploaded:
    url: TierURL
    files: int
    bytes: int  # sent (0 when the store held it already)
    source_bytes: int  # of the local data files (bytes / source_bytes: the ratio)
    already: bool  # the store held this checkpoint already
    replaced: bool  # the store held another checkpoint of this name, now replaced


def _open_files(dir_fd: int, manifest: Manifest, where: str) -> list[tuple[str, int, int]]:
    opened: list[tuple[str, int, int]] = []
    try:
        for f in manifest.files:
            if f.node is not None:
                raise NotUploadable(f"{where} is a node-local distributed checkpoint; "
                                    "`fpctl gather` it into one directory to upload it")
            try:
                fd = os.open(f.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP):  # missing, or a link put there
                    raise LocalCorruption(f"{where}: cannot open {f.name}: {exc.strerror}; "
                                          "not uploaded", file=f.name) from None
                # EMFILE, ENOMEM, EIO...: this attempt fails, a later one may not.
                raise CheckpointIOError(f"{where}: cannot open {f.name} to upload it: "
                                        f"{exc.strerror}") from None
            opened.append((f.name, fd, f.size))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                raise LocalCorruption(f"{where}: {f.name} is {st.st_size} bytes, its manifest "
                                      f"says {f.size}; not uploaded", file=f.name)
    except BaseException:
        for _, fd, _ in opened:
            os.close(fd)
        raise
    return opened


def upload_checkpoint(s3: S3, dir_fd: int, where: str, url: TierURL,
                      compression: str | None = None) -> Uploaded:
    """Upload the committed checkpoint open as `dir_fd` (named `where` in
    messages) to `url`, manifest last; compression="zstd" compresses a raw
    one on the way. See the module docstring."""
    compression = check_compression(compression)
    try:
        data = dirs.read_regular(MANIFEST_NAME, dir_fd, MAX_MANIFEST_BYTES)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EINVAL, errno.EFBIG):
            raise NotUploadable(f"{where} is not a committed checkpoint: cannot read its "
                                f"{MANIFEST_NAME} ({exc.strerror or exc})") from None
        raise CheckpointIOError(f"{where}: cannot read its {MANIFEST_NAME} to upload it: "
                                f"{exc.strerror or exc}") from None
    try:
        manifest = Manifest.from_json(data, where)
    except CheckpointError as exc:
        raise LocalCorruption(f"{where}: {exc}; not uploaded", file=MANIFEST_NAME) from None
    source = hashlib.sha256(data).hexdigest()
    local_bytes = sum(f.size for f in manifest.files)
    got = s3.get_with_metadata(url, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if got is not None and (got[0] == data or got[1].get(SOURCE_KEY) == source):
        return Uploaded(url, len(manifest.files), 0, local_bytes, already=True, replaced=False)
    if got is not None:
        # Another checkpoint of this name (the local one was saved again, say
        # after a rollback): it goes invisible first, then is replaced.
        s3.delete(url.bucket, [url.key(MANIFEST_NAME)])
    files = _open_files(dir_fd, manifest, where)
    compress = compression is not None and not any(
        f.name.endswith(packed_file.SUFFIX) for f in manifest.files)
    try:
        if compress:
            from .compress import upload_compressed  # numpy, zstandard

            remote, sent = upload_compressed(s3, url, manifest, files,
                                             {CODEC_KEY: ZSTD_BYTEGROUP}, where)
        else:
            remote, sent = data, _upload_raw(s3, url, manifest, files, where)
    except CheckpointError:
        raise
    except Exception as exc:
        raise tier_error(exc, f"uploading {where} to {url}") from exc
    finally:
        for _, fd, _ in files:
            with contextlib.suppress(OSError):
                os.close(fd)
    if not s3.put_new(url, MANIFEST_NAME, remote, {SOURCE_KEY: source}) and \
            s3.get(url, MANIFEST_NAME, MAX_MANIFEST_BYTES) != remote:
        raise TierError(f"another uploader wrote {url} while {where} was uploaded there "
                        "(one writer per prefix)")
    _check_objects(s3, url, remote, where)
    return Uploaded(url, len(files), sent, local_bytes, already=False,
                    replaced=got is not None)


def _check_objects(s3: S3, url: TierURL, remote: bytes, where: str) -> None:
    """Every data object the manifest just written names is there, with its
    size; else (deleted meanwhile: `fpctl gc --older-than` shorter than the
    upload) the manifest is deleted again, and the upload fails, to be retried:
    a checkpoint is never reported uploaded with objects missing."""
    sizes = object_sizes(s3, url)
    wrong = [f.name for f in Manifest.from_json(remote, str(url)).files
             if sizes.get(f.name) != f.size]
    if wrong:
        s3.delete(url.bucket, [url.key(MANIFEST_NAME)])
        raise TierError(f"{', '.join(wrong)} of {url} vanished or changed while {where} was "
                        "uploaded there (a gc, another writer?); its manifest is deleted again")


def _upload_raw(s3: S3, url: TierURL, manifest: Manifest, files: list[tuple[str, int, int]],
                where: str) -> int:
    """The data files as they are, read from their descriptors (the bytes of the
    open file, whatever its name points at now) through checked.CheckedFile:
    every byte sent is checked against the manifest's CRC32Cs as it is read
    (padding goes as zeros). Each file is one object, in parts as PartStream
    cuts them, FASTPERSIST_TIER_CONCURRENCY in flight; an upload a killed
    uploader left open is taken up, keeping the parts the store has. A file
    that does not match its manifest raises LocalCorruption and its upload is
    aborted. The bytes sent."""
    records: dict[str, list[TensorRecord]] = {f.name: [] for f in manifest.files}
    for t in manifest.tensors:
        records[t.file].append(t)
    by_name = {f.name: f for f in manifest.files}
    sent = 0
    with ThreadPoolExecutor(s3.concurrency, thread_name_prefix="fp-tier-part") as pool:
        for name, fd, size in files:
            checked = CheckedFile(fd, by_name[name], records[name], where)
            stream = PartStream(s3, url, name, {CODEC_KEY: "raw"}, pool, late_header=False)
            try:
                for off in range(0, size, s3.part_bytes):
                    stream.write(checked.read(off, min(s3.part_bytes, size - off)))
                stream.finish()
            except BaseException:
                stream.abort()
                raise
            sent += size - stream.kept
    return sent
