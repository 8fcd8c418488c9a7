"""The exceptions fastpersist raises. Every failure is a CheckpointError subclass
that names the checkpoint, and where it applies the file and tensor."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error fastpersist raises."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint."""


class UnknownFileFormatError(CheckpointNotFoundError):
    """load() was given a file that is neither a torch.save file, a safetensors
    file nor a checkpoint directory; the message names it and its first bytes."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target path exists and is not a checkpoint, so it will not be replaced."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """The directory cannot be written (permissions or a read-only filesystem)."""


class DiskFullError(CheckpointError, OSError):
    """The filesystem ran out of space (ENOSPC or EDQUOT). Nothing was committed."""


class CheckpointIOError(CheckpointError, OSError):
    """Any other operating-system error during a save or a load."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint on disk does not match its manifest."""


class ManifestError(CorruptCheckpointError):
    """The manifest is missing, unreadable, or does not follow the schema."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A tensor's bytes do not match the checksum recorded when it was saved."""

    def __init__(self, message: str, *, file: str, tensor: str) -> None:
        super().__init__(message)
        self.file = file
        self.tensor = tensor

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled between processes (torch.distributed.checkpoint sends a rank's
        # failure to the others): rebuild with the keyword arguments too.
        return _rebuild_checksum_mismatch, (str(self), self.file, self.tensor)


def _rebuild_checksum_mismatch(message: str, file: str, tensor: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(message, file=file, tensor=tensor)


class TruncatedFileError(CorruptCheckpointError):
    """A data file is shorter than the manifest says."""


class UnsupportedPathError(CheckpointError, ValueError):
    """A save was given a path it cannot write: a URL (s3://, gs://, file://, ...)
    where a local or shared-filesystem directory is expected, a single file's
    name in an object store, or a file object open in text mode (load too).
    Raised before anything is written; the message says what would work."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value cannot be stored without pickle and pickle was not allowed."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to load(into=...) does not fit the checkpoint: a tensor
    of another shape, or a tensor the checkpoint does not have. Raised before
    anything is read or written."""


class TensorNotFoundError(CheckpointError, KeyError):
    """fastpersist.open(...).get_tensor(name) (or get_slice) of a name the
    checkpoint does not have; the message lists the nearest names it has."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument: keep the message readable.
        return str(self.args[0]) if self.args else ""


class TensorIndexError(CheckpointError, IndexError):
    """get_slice(name)[index] with an index outside the tensor's shape (or
    one a partial read does not support); names the tensor and its shape.
    Raised before anything is read."""


class CheckpointAbortedError(CheckpointError):
    """An asynchronous save was aborted (close(abort=True)) before it committed."""


class PostCommitError(CheckpointError):
    """The checkpoint was committed (it is durable and loads), but what a
    Checkpointer does after a commit failed: moving `latest`, or retention."""


class PickleNotAllowedError(CheckpointError):
    """The checkpoint holds pickled values and the caller did not opt in to unpickling."""


class TierError(CheckpointError):
    """The object-store tier (s3://) failed: the store could not be reached,
    refused a request, or holds something else under the checkpoint's name.
    A local checkpoint is never deleted because of it: it stays until its
    upload succeeds."""


class StoreURLError(TierError, ValueError):
    """An s3:// URL that names no checkpoint in a store: no bucket, or a key
    component that is empty, `.`, `..` or holds a backslash or control character."""


class StoreCredentialsError(TierError, PermissionError):
    """No credentials for the object store were found (boto3 looked in
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, roles)."""


class BucketNotFoundError(TierError, CheckpointNotFoundError):
    """The bucket an s3:// URL names does not exist in the store."""


class MemoryTierError(CheckpointError):
    """A memory-only save (kept in fastpersistd's memory tier, not written to
    disk) that the tier cannot hold: the tier is off, or the checkpoint does
    not fit in its budget (--memory-tier-bytes)."""


class DaemonError(CheckpointError):
    """fastpersistd refused a request; `code` is the gRPC status code's name
    (INVALID_ARGUMENT, RESOURCE_EXHAUSTED for a staging budget, ...)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class DaemonUnavailableError(DaemonError):
    """fastpersistd cannot be reached, or went away in the middle of a checkpoint
    before it was handed over (Commit), which then was not committed; the daemon
    removes it when it restarts."""


class DaemonMayStillCommitError(DaemonUnavailableError):
    """fastpersistd was handed the checkpoint (or may have been: Commit's reply was
    lost), and the client could not learn how it ended: the daemon may have
    committed it, or may still commit it, or not. Look before relying on it
    (`fpctl ls`, `load`). Its shared-memory segments were quarantined (never
    reused), so if the checkpoint appears it holds exactly what was saved."""


class DistributedCheckpointError(CheckpointError):
    """A distributed save or load failed on one or more ranks. Raised on every
    rank with the same message, which names each failed (or lost) rank and
    phase. `committed`: whether the job committed anyway (a node could not
    publish its part after the commit); None when that is in doubt."""

    def __init__(self, message: str, failures: dict[int, str] | None = None, *,
                 committed: bool | None = False) -> None:
        super().__init__(message)
        self.failures = failures or {}
        self.committed = committed
