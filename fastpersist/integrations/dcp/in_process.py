"""FastPersistWriter's writes in this process: each rank's items into its
data files with the O_DIRECT engine, a CRC32C per item and per 4 MiB block
(blocks.py), fsynced (the coordinator then commits: writer.py)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from . import _fp
from .blocks import block_spans
from .items import stored_item
from .manifest import Written
from .memory import bytes_of
from .metadata_json import ItemInfo


def write_file(engine: _fp.Engine, directory: Path, name: str, items: list[WriteItem],
               planner: SavePlanner) -> list[WriteResult]:
    """One data file of `items` in the staging directory, durable; DCP's
    WriteResults of them."""
    stored, by_name = [], {}
    for item in items:
        s = stored_item(item, planner.resolve_data(item), host=True)
        stored.append(s)
        by_name[s.name] = item
    plan = _fp.plan_file(stored)
    lay = plan.layout
    segments: list[_fp.Segment] = [(lay.header, 0)]
    spans: list[list[tuple[int, int]]] = []
    for s, offset in zip(plan.order, lay.offsets, strict=True):
        memory = bytes_of(s.source)
        item_spans = block_spans(s.nbytes)
        spans.append(item_spans)
        segments += [(memory[a:a + n], offset + a) for a, n in item_spans]
    try:
        result = engine.write_file(str(directory / name), segments, lay.size)
    except OSError as exc:
        raise _fp.os_error(exc, f"cannot write {name} of checkpoint {directory}") from exc
    assert result.crcs is not None
    file = _fp.FileRecord(name=name, size=lay.size, data_start=lay.data_start,
                          header_crc32c=result.crcs[0])
    crcs = iter(result.crcs[1:])
    out = []
    for s, offset, item_spans in zip(plan.order, lay.offsets, spans, strict=True):
        block_crcs = [next(crcs) for _ in item_spans]
        whole = _fp.combine([(c, n) for c, (_, n) in zip(block_crcs, item_spans, strict=True)])
        record = _fp.TensorRecord(name=s.name, file=name, offset=offset, length=s.nbytes,
                                  dtype=s.dtype, shape=s.shape, crc32c=whole)
        info = ItemInfo(s.name, tuple(block_crcs) if len(item_spans) > 1 else ())
        item = by_name[s.name]
        out.append(WriteResult(index=item.index, size_in_bytes=s.nbytes,
                               storage_data=Written(info, record, file)))
    return out

