"""The fastpersist manifest of a DCP checkpoint, so that fastpersist.load and
fpctl read it like any distributed fastpersist checkpoint.

Schema 2: each DCP tensor is a global tensor whose chunks are DCP's chunks
(one tensor record each); a bytes value (WriteItemType.BYTE_IO: DCP's
torch.save of a non-tensor value) is a one-chunk global of dtype U8. The
tree is a flat dict from DCP's fully qualified names to those globals, so
fastpersist.load returns {fqn: full tensor}.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from ...adapters import ItemWritten, dtype_name, global_manifest
from ...errors import UnsupportedValueError


def build(metadata: Metadata, written: dict[MetadataIndex, ItemWritten], where: str) -> bytes:
    """The manifest's bytes, validated as any load would validate them (a
    state whose chunks do not tile its tensors fails here, not at load).
    `written`: WriteResult.storage_data of each item, as the ranks report it."""
    files = {w.file.name: w.file for w in written.values()}
    # (fqn, dtype, global shape, its chunks as (record name, offsets))
    globals_: list[tuple[str, str, tuple[int, ...], list[tuple[str, tuple[int, ...]]]]] = []
    keys: list[str] = []
    values: list[dict[str, object]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            rec = written[MetadataIndex(fqn)].record
            globals_.append((fqn, "U8", rec.shape, [(rec.name, (0,))]))
        else:
            dtype = dtype_name(md.properties.dtype)
            if dtype is None:
                raise UnsupportedValueError(f"{fqn}: dtype {md.properties.dtype} cannot be "
                                            "stored (not a safetensors dtype)")
            chunks = [(written[MetadataIndex(fqn, c.offsets)].record.name, tuple(c.offsets))
                      for c in md.chunks]
            globals_.append((fqn, dtype, tuple(md.size), chunks))
        keys.append(fqn)
        values.append({"t": "tensor", "e": len(values)})
    return global_manifest([files[n] for n in sorted(files)],
                           [w.record for w in written.values()], globals_,
                           {"t": "dict", "k": keys, "v": values}, check=where)
