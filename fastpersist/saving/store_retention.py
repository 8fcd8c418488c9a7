"""A Checkpointer's policy in the store, after each commit there (store_sink.py).

The rules are the local ones (storage/retention.to_delete: keep_last, keep_every,
a step higher than the one just committed never deleted nor counted), applied
to the step-N checkpoints beside the one just committed, PREFIX/step-N:

    retention   each checkpoint retention deletes goes manifest first
                (tier/retention.delete_checkpoint): invisible from then on, so
                no reader ever sees a half-deleted step; a crash midway leaves
                objects without a manifest, removed as below.
    leftovers   a save killed midway left objects without a manifest, and open
                multipart uploads. Those of steps older than the one just
                committed are removed now (a resumed run saves its newer steps
                again, and those uploads are taken up instead: parts.py). One
                writer per prefix: another process's save in progress there
                would be broken by this.

There is no `latest` object: latest() lists the store.
"""

from __future__ import annotations

from ..errors import CheckpointError, PostCommitError
from ..storage.retention import AfterCommit, step_of, to_delete
from ..tier.client import S3
from ..tier.listing import INCOMPLETE, entries
from ..tier.retention import delete_checkpoint, delete_incomplete
from ..tier.url import TierURL


def after_commit_in_store(s3: S3, url: TierURL, policy: AfterCommit) -> None:
    """Apply `policy` beside `url`, a checkpoint just committed in the store.
    PostCommitError if that fails: the checkpoint itself is committed."""
    newest = step_of(url.name)
    if newest is None:
        return  # not a Checkpointer's step-N: nothing to keep or delete beside it
    group = url.parent
    try:
        found = entries(s3, group)
        steps = [(e.step, e.name) for e in found if e.committed and e.step is not None]
        for name in to_delete(steps, url.name, policy, lambda _: True):
            delete_checkpoint(s3, group.child(name))
        for e in found:
            if e.kind == INCOMPLETE and e.step is not None and e.step < newest:
                delete_incomplete(s3, group, e)
        for key, upload_id, _ in list(s3.multipart_uploads(group)):
            parts = group.split_key(key)
            step = step_of(parts[0]) if parts and len(parts) > 1 else None
            if step is not None and step < newest:
                s3.abort_upload(group.bucket, key, upload_id)
    except CheckpointError as exc:
        raise PostCommitError(f"{url} is committed, but retention beside it failed: "
                              f"{exc}") from exc


__all__ = ["after_commit_in_store"]
