"""Retention in the store, and cleaning up after abandoned uploads.

    keep_last     among the remote step-N checkpoints of one directory up to
                  the step just uploaded, keep the newest N; delete the rest.
                  A higher step is never deleted nor counted (the local rule,
                  storage/retention.py). A checkpoint is deleted manifest
                  first: from then on it is invisible, and a crash midway
                  leaves only objects without a manifest, which gc removes.
    sweep_uploads abort multipart uploads begun more than `older_than`
                  seconds ago (ones whose uploader died or lost the store
                  before it could abort them; the store keeps their parts
                  and bills them until then).
    incomplete    directories of objects without a manifest and without a
                  checkpoint below them (listing.py: at any depth, so a run
                  directory of checkpoints is never one), whose newest object
                  is older than `older_than` (an upload abandoned for good);
                  gc deletes their objects, the keys listed, and nothing else.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import TierError
from ..format.manifest import MANIFEST_NAME
from .client import S3
from .listing import INCOMPLETE, RemoteEntry, entries, listing
from .url import TierURL


@dataclass(frozen=True)
class Kept:
    kept: tuple[int, ...]  # steps kept, newest first (up to the one just uploaded)
    deleted: tuple[str, ...]  # names deleted


def delete_checkpoint(s3: S3, url: TierURL) -> None:
    """Delete the checkpoint at `url`: its manifest first, then its objects."""
    s3.delete(url.bucket, [url.key(MANIFEST_NAME)])
    keys = [key for key, _, _ in s3.objects(url)]
    s3.delete(url.bucket, keys)


def keep_last(s3: S3, group: TierURL, newest_step: int, keep: int | None) -> Kept:
    """Apply keep_last=`keep` to the step-N checkpoints in `group` once
    `newest_step` is uploaded there."""
    found = [e for e in entries(s3, group) if e.committed and e.step is not None]
    older = sorted((e for e in found if e.step is not None and e.step <= newest_step),
                   key=lambda e: e.step or 0, reverse=True)
    if keep is None:
        return Kept(tuple(e.step for e in older if e.step is not None), ())
    deleted = []
    for e in older[keep:]:
        delete_checkpoint(s3, group.child(e.name))
        deleted.append(e.name)
    return Kept(tuple(e.step for e in older[:keep] if e.step is not None), tuple(deleted))


def sweep_uploads(s3: S3, url: TierURL, older_than: float) -> list[str]:
    """Abort the multipart uploads below `url` begun over `older_than` s ago;
    returns their keys."""
    cutoff = time.time() - older_than
    aborted = []
    for key, upload_id, initiated in list(s3.multipart_uploads(url)):
        if initiated and initiated <= cutoff:
            s3.abort_upload(url.bucket, key, upload_id)
            aborted.append(key)
    return aborted


def incomplete(s3: S3, url: TierURL, older_than: float) -> list[RemoteEntry]:
    """The incomplete uploads below `url` (any depth, listing.py) untouched for
    over `older_than` seconds."""
    cutoff = time.time() - older_than
    return [e for e in listing(s3, url).entries
            if e.kind == INCOMPLETE and e.modified <= cutoff]


def delete_incomplete(s3: S3, url: TierURL, entry: RemoteEntry) -> None:
    """Delete the objects of `entry`, an incomplete upload below `url`: the keys
    it was listed with, never any other (not one uploaded since, not an odd
    key). CheckpointError if its upload finished meanwhile: a manifest there
    now means the listing is stale, and nothing is deleted."""
    target = url.child(entry.name)
    if s3.exists(target, MANIFEST_NAME):
        raise TierError(f"{target} holds a checkpoint now (its upload finished since it "
                        "was listed); not removed")
    s3.delete(url.bucket, list(entry.keys))
