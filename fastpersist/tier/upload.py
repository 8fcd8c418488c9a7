"""Uploading one committed checkpoint directory, the manifest last.

    1. Read the local manifest (validated) and open every data file it lists,
       by name in the directory held open, without following links; each
       must have the size the manifest says.
    2. If the store already holds a manifest there: the same bytes mean the
       checkpoint is uploaded (a retry, or a restart) and nothing is sent;
       other bytes mean an older checkpoint of that name (the local one was
       saved again): its manifest is deleted first, so it is invisible, never
       a mix, while this one replaces it.
    3. Upload the data files: s3transfer, parallel multipart uploads of
       FASTPERSIST_TIER_PART_BYTES, read from the files in place (bounded
       memory), each request retried with backoff (client.py). A failed
       multipart upload is aborted; one that cannot be (the store went away)
       is swept later (retention.sweep_uploads).
    4. Write manifest.json with a conditional put (If-None-Match: *): the
       remote checkpoint becomes visible, complete, in one step, and never
       replaces one that appeared meanwhile.

A failure at any step leaves no manifest: nothing partial is visible, and the
next attempt sends the data files again (they are overwritten in place).

Compression hook: every data file is sent as the object body `Codec.body`
returns, and the object carries its codec's name in its metadata
(`fastpersist-codec`). Only RAW exists today (the bytes of the file); a
codec that compresses must also be able to serve ranged reads of the
tensors (remote.py reads each tensor's bytes at its manifest offset).

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointError, TierError
from ..format.bounds import MAX_MANIFEST_BYTES
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage import dirs
from .client import S3, tier_error
from .url import TierURL


class Codec(Protocol):
    name: str

    def body(self, fd: int, size: int) -> tuple[str, int]:
        """What to upload for the data file open as `fd`: a file name that
        s3transfer reads in parts, and its size."""
        ...


class RawCodec:
    name = "raw"

    def body(self, fd: int, size: int) -> tuple[str, int]:
        # The open file itself, reopened by s3transfer per part through
        # /proc: the bytes of this file, whatever its name points at now.
        return f"/proc/self/fd/{fd}", size


RAW = RawCodec()
CODEC_KEY = "fastpersist-codec"


class NotUploadable(TierError):
    """The local checkpoint cannot be uploaded as it is (not committed,
    changed, a node-local part of a distributed one): retrying will not help."""


@dataclass(frozen=True)
class Uploaded:
    url: TierURL
    files: int
    bytes: int  # sent (0 when the store held it already)
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
                raise NotUploadable(f"{where}: cannot open {f.name}: {exc.strerror}") from None
            opened.append((f.name, fd, f.size))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                raise NotUploadable(f"{where}: {f.name} is {st.st_size} bytes, its manifest "
                                    f"says {f.size}")
    except BaseException:
        for _, fd, _ in opened:
            os.close(fd)
        raise
    return opened


def upload_checkpoint(s3: S3, dir_fd: int, where: str, url: TierURL,
                      codec: Codec = RAW) -> Uploaded:
    """Upload the committed checkpoint open as `dir_fd` (named `where` in
    messages) to `url`, manifest last. See the module docstring."""
    try:
        data = dirs.read_regular(MANIFEST_NAME, dir_fd, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise NotUploadable(f"{where} is not a committed checkpoint: cannot read its "
                            f"{MANIFEST_NAME} ({exc.strerror or exc})") from None
    try:
        manifest = Manifest.from_json(data, where)
    except CheckpointError as exc:
        raise NotUploadable(f"{where}: {exc}") from None
    remote = s3.get(url, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if remote == data:
        return Uploaded(url, len(manifest.files), 0, already=True, replaced=False)
    if remote is not None:
        # Another checkpoint of this name (the local one was saved again, say
        # after a rollback): it goes invisible first, then is replaced.
        s3.delete(url.bucket, [url.key(MANIFEST_NAME)])
    files = _open_files(dir_fd, manifest, where)
    sent = 0
    try:
        with s3.transfer_manager() as tm:
            futures = []
            for name, fd, size in files:
                source, length = codec.body(fd, size)
                futures.append(tm.upload(source, url.bucket, url.key(name),
                                         extra_args={"Metadata": {CODEC_KEY: codec.name}}))
                sent += length
            for fut in futures:
                fut.result()
    except CheckpointError:
        raise
    except Exception as exc:
        raise tier_error(exc, f"uploading {where} to {url}") from exc
    finally:
        for _, fd, _ in files:
            with contextlib.suppress(OSError):
                os.close(fd)
    if not s3.put_new(url, MANIFEST_NAME, data) and \
            s3.get(url, MANIFEST_NAME, MAX_MANIFEST_BYTES) != data:
        raise TierError(f"another uploader wrote {url} while {where} was uploaded there "
                        "(one writer per prefix)")
    return Uploaded(url, len(files), sent, already=False, replaced=remote is not None)
