"""Writing one checkpoint: staging directory, data files, manifest, commit.

Both `save` (all at once, in the caller's thread) and `async_save` (file by
file, in the background) go through CheckpointWriter:

    1. begin:  make the staging directory (fails fast if the target may not
               be replaced or the directory is not writable)
    2. write_file, once per data file: the engine writes and fsyncs it (with
               compression="zstd", a packed file: the codec encodes the
               file's tensors first, on the codec threads, see tensors/packed.py)
    3. commit: manifest last, fsync, atomic rename (see commit.py)
    abort at any point removes everything the writer made.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import gcpause
from .._version import __version__
from ..engine import Engine, get_engine
from ..format.manifest import FileRecord, Manifest, TensorRecord
from ..format.names import data_file_name
from ..knobs import current as current_knobs
from ..storage.commit import Staging, os_error
from ..tensors import datafile, packed
from ..tensors.plan import StoredTensor


class CheckpointWriter:
    def __init__(self, staging: Staging, tree: Any, stored: list[StoredTensor],
                 engine: Engine, frame_bytes: int | None = None) -> None:
        self.staging = staging
        self.tree = tree
        self.stored = stored
        self.engine = engine
        self.frame_bytes = frame_bytes  # None: raw (safetensors) data files
        self.files: list[FileRecord] = []
        self.records: dict[str, TensorRecord] = {}

    @classmethod
    def begin(cls, target: Path, tree: Any, stored: list[StoredTensor],
              compression: str | None = None) -> CheckpointWriter:
        """Step 1. `stored` is every tensor of the checkpoint, in the order the
        tree's entry indices refer to. compression: None or "zstd"."""
        # Knobs are read now, not halfway through a save.
        engine = get_engine()
        frame_bytes = current_knobs().frame_bytes if packed.check_compression(
            compression) else None
        return cls(Staging.create(target), tree, stored, engine, frame_bytes)

    @property
    def target(self) -> Path:
        return self.staging.target

    def write_file(self, tensors: list[StoredTensor]) -> None:
        """Step 2: write the next data file; durable on return."""
        name = data_file_name(len(self.files), packed=self.frame_bytes is not None)
        try:
            if self.frame_bytes is None:
                file_record, records = datafile.write(self.engine, str(self.staging.path),
                                                      name, tensors)
            else:
                file_record, records = packed.write(self.engine, str(self.staging.path),
                                                    name, tensors, self.frame_bytes)
        except OSError as exc:
            raise os_error(exc, f"cannot save checkpoint {self.target}") from exc
        self.files.append(file_record)
        self.records.update((r.name, r) for r in records)

    def commit(self) -> None:
        """Step 3: on return the checkpoint is durable under its name."""
        with gcpause.paused():  # a record per tensor: many objects, no cycles
            manifest = Manifest(
                files=tuple(self.files),
                tensors=tuple(self.records[t.name] for t in self.stored),
                tree=self.tree,
                fastpersist_version=__version__,
                created_unix=time.time(),
            )
            data = manifest.to_json()
        self.staging.commit(data)

    def abort(self) -> None:
        self.staging.abort()
