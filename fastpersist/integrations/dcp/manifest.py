"""The fastpersist manifest of a DCP checkpoint, so that fastpersist.load and
fpctl read it like any distributed fastpersist checkpoint.

Schema 2: each DCP tensor is a global tensor whose chunks are DCP's chunks
(one tensor record each); a bytes value (WriteItemType.BYTE_IO: DCP's
torch.save of a non-tensor value) is a one-chunk global of dtype U8. The
tree is a flat dict from DCP's fully qualified names to those globals, so
fastpersist.load returns {fqn: full tensor}.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from . import _fp
from .metadata_json import ItemInfo


@dataclass(frozen=True)
class Written:
    """WriteResult.storage_data of one item, as a rank reports it."""

    info: ItemInfo
    record: _fp.TensorRecord
    file: _fp.FileRecord


def build(metadata: Metadata, written: dict[MetadataIndex, Written], where: str) -> bytes:
    """The manifest's bytes, validated as any load would validate them."""
    files = {w.file.name: w.file for w in written.values()}
    records = [w.record for w in written.values()]
    index_of = {r.name: i for i, r in enumerate(records)}
    globals_: list[_fp.GlobalTensor] = []
    keys: list[str] = []
    values: list[dict[str, object]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            rec = written[MetadataIndex(fqn)].record
            g = _fp.GlobalTensor(fqn, "U8", rec.shape,
                                 (_fp.Chunk(index_of[rec.name], (0,)),))
        else:
            dtype = _fp.dtypes.to_name(md.properties.dtype)
            if dtype is None:
                raise _fp.UnsupportedValueError(f"{fqn}: dtype {md.properties.dtype} cannot be "
                                                "stored (not a safetensors dtype)")
            chunks = tuple(
                _fp.Chunk(index_of[written[MetadataIndex(fqn, c.offsets)].record.name],
                          tuple(c.offsets))
                for c in md.chunks)
            g = _fp.GlobalTensor(fqn, dtype, tuple(md.size), chunks)
        keys.append(fqn)
        values.append({"t": "tensor", "e": len(globals_)})
        globals_.append(g)
    manifest = _fp.Manifest(
        files=tuple(files[n] for n in sorted(files)), tensors=tuple(records),
        tree={"t": "dict", "k": keys, "v": values}, fastpersist_version=_fp.__version__,
        created_unix=time.time(), schema_version=_fp.DISTRIBUTED_SCHEMA_VERSION,
        globals=tuple(globals_))
    data = manifest.to_json()
    # What every reader will check, checked before anything is committed (a
    # state whose chunks do not tile its tensors fails here, not at load).
    _fp.Manifest.from_json(data, where)
    return data
