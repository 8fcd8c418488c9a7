"""Every fastpersist internal that the DCP integration uses, in one place.

Kept together so that the integration's dependence on fastpersist's
internals (beyond the public API) is visible at a glance.
"""

from __future__ import annotations

from ... import knobs
from ..._version import __version__
from ...checksum import combine, crc32c
from ...distributed.storage import ThroughDaemon
from ...engine import Engine, Segment, get_engine
from ...errors import (
    CheckpointError,
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DaemonError,
    ManifestError,
    PickleNotAllowedError,
    TruncatedFileError,
    UnsupportedValueError,
)
from ...format import dtypes
from ...format.manifest import (
    DISTRIBUTED_SCHEMA_VERSION,
    Chunk,
    FileRecord,
    GlobalTensor,
    Manifest,
    TensorRecord,
    parse_json,
)
from ...format.names import part_file_name
from ...format.tree import check_tree
from ...saving.files import StagedFiles
from ...saving.snapshot import StagedFile, stage_file
from ...saving.staging import StagingPool
from ...storage.commit import Staging, os_error, through_link
from ...storage.leftovers import leftover_name
from ...storage.leftovers import process_token as new_token
from ...tensors.datafile import write_in_blocks
from ...tensors.plan import StoredTensor
from ...tensors.source import LocalSource

__all__ = [
    "DISTRIBUTED_SCHEMA_VERSION", "CheckpointError", "CheckpointExistsError",
    "ChecksumMismatchError", "Chunk", "CorruptCheckpointError", "DaemonError", "Engine",
    "FileRecord", "GlobalTensor", "LocalSource", "Manifest", "ManifestError",
    "PickleNotAllowedError",
    "Segment",
    "StagedFile", "StagedFiles", "Staging", "StagingPool", "StoredTensor", "TensorRecord",
    "ThroughDaemon",
    "TruncatedFileError", "UnsupportedValueError", "__version__", "check_tree", "combine",
    "crc32c", "dtypes", "get_engine", "knobs", "leftover_name", "new_token", "os_error",
    "parse_json", "part_file_name",
    "stage_file",
    "through_link", "write_in_blocks",
]
