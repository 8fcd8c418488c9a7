"""FastPersistWriter's writes in this process: each rank's items into its
data files with the O_DIRECT engine, a CRC32C per item and per 4 MiB block
(blocks.py), fsynced (the coordinator then commits: writer.py)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from . import _fp
from .blocks import CRC_BLOCK
from .items import stored_item
from .manifest import Written
from .metadata_json import ItemInfo


def write_file(engine: _fp.Engine, directory: Path, name: str, items: list[WriteItem],
               planner: SavePlanner) -> list[WriteResult]:
    """One data file of `items` in the staging directory, durable, through
    fastpersist's data-file writer; DCP's WriteResults of them."""
    stored, by_name = [], {}
    for item in items:
        s = stored_item(item, planner.resolve_data(item), host=True)
        stored.append(s)
        by_name[s.name] = item
    try:
        file, records, blocks = _fp.write_in_blocks(engine, str(directory), name, stored,
                                                    CRC_BLOCK)
    except OSError as exc:
        raise _fp.os_error(exc, f"cannot write {name} of checkpoint {directory}") from exc
    out = []
    for record, block_crcs in zip(records, blocks, strict=True):
        info = ItemInfo(record.name, tuple(block_crcs) if len(block_crcs) > 1 else ())
        out.append(WriteResult(index=by_name[record.name].index, size_in_bytes=record.length,
                               storage_data=Written(info, record, file)))
    return out
