"""The fastpersist names the DCP reader (reader.py) uses, kept here until the
reader moves to the read path's reader interface (issue 34, item 2).

The rest of the DCP integration takes what it needs from fastpersist.adapters
(the adapters' contract) and fastpersist.errors. The internal imports below are
the reader's alone; tests/test_architecture.py lists them (READER_INTERNALS)
so that no new one comes in unnoticed, and they leave with the port.
"""

from __future__ import annotations

from ... import knobs
from ...adapters import Manifest
from ...engine import Engine, Segment, get_engine
from ...errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    ManifestError,
    PickleNotAllowedError,
    TruncatedFileError,
)
from ...format import dtypes
from ...format.manifest import FileRecord, TensorRecord
from ...storage.commit import os_error
from ...tensors.committed import read_manifest

__all__ = [
    "ChecksumMismatchError", "CorruptCheckpointError", "Engine",
    "FileRecord", "Manifest", "ManifestError", "PickleNotAllowedError", "Segment",
    "TensorRecord", "TruncatedFileError", "dtypes", "get_engine", "knobs", "os_error",
    "read_manifest",
]
