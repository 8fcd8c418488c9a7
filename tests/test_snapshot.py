"""stage_file: a snapshot's copy into a staging buffer laid out as the data file.

Contiguous CPU tensors are copied by one C call for the whole file
(_engine.gather), others by torch (and every one by torch without the C
extension); the writer later reads views of the buffer, made lazily.
"""

from __future__ import annotations

import pytest
import torch

from fastpersist import _engine
from fastpersist.format import dtypes
from fastpersist.saving import snapshot
from fastpersist.saving.snapshot import stage_file
from fastpersist.tensors.datafile import plan_file
from fastpersist.tensors.plan import StoredTensor, memory_of

BIG = 64 << 10  # bytes: more than a few pages


def _mixed() -> list[StoredTensor]:
    """Every element size in an order that file order rearranges, 0-d and empty
    tensors, multi-dimensional ones, and some of several pages."""
    gen = torch.Generator().manual_seed(0)
    values = {
        "i8": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=gen),
        "f64": torch.randn(3, 5, dtype=torch.float64, generator=gen),
        "bf16": torch.randn(11, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "big": torch.randn(BIG // 4 + 3, generator=gen),
        "bool": torch.rand(9, generator=gen) > 0.5,
        "i64": torch.arange(6, dtype=torch.int64).view(2, 3),
        "big16": torch.randn(2, BIG // 4 + 1, generator=gen).to(torch.float16),
        "u8": torch.arange(13, dtype=torch.uint8),
    }
    out = []
    for name, t in values.items():
        dtype = dtypes.to_name(t.dtype)
        assert dtype is not None
        out.append(StoredTensor(name, dtype, tuple(t.shape), t, t.nbytes))
    return out


def _staged_bytes(stored: list[StoredTensor], buffer: torch.Tensor) -> dict[str, bytes]:
    staged = stage_file(stored, buffer, False)
    lay = plan_file(stored).layout  # what the writer lays out for these tensors
    data = bytes(memory_of(buffer))
    order = plan_file(stored).order
    return {t.name: data[off - lay.data_start : off - lay.data_start + t.nbytes]
            for t, off in zip(order, lay.offsets, strict=True)} | {
        "<views>": b"".join(bytes(memory_of(v.source.contiguous())) for v in staged.tensors)}


@pytest.mark.parametrize("with_gather", [True, False], ids=["gather", "torch-only"])
def test_the_buffer_holds_each_tensor_where_the_file_puts_it(
        with_gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not with_gather:
        monkeypatch.setattr(snapshot, "gather", None)
    stored = _mixed()
    size = sum(t.nbytes for t in stored)
    buffer = torch.full((size + 100,), 0xEE, dtype=torch.uint8)
    placed = _staged_bytes(stored, buffer)
    for t in stored:
        assert placed[t.name] == bytes(memory_of(t.source)), t.name
    # The views the writer reads: in the caller's order, each its tensor's bytes.
    assert placed["<views>"] == b"".join(bytes(memory_of(t.source)) for t in stored)
    assert bytes(memory_of(buffer))[size:] == b"\xee" * 100  # nothing past the data


def test_the_writer_reads_the_snapshot_not_the_live_tensors() -> None:
    stored = _mixed()
    before = {t.name: t.source.clone() for t in stored}
    buffer = torch.empty(sum(t.nbytes for t in stored), dtype=torch.uint8)
    staged = stage_file(stored, buffer, False)
    for t in stored:  # training goes on after the snapshot
        if t.source.numel():
            t.source.reshape(-1).view(torch.uint8).bitwise_not_()
    assert [t.name for t in staged.tensors] == [t.name for t in stored]
    for view in staged.tensors:
        old = before[view.name]
        assert view.source.shape == old.shape and view.source.dtype == old.dtype
        assert torch.equal(view.source, old), view.name
        assert view.source.untyped_storage().data_ptr() == buffer.data_ptr()


def test_a_non_contiguous_source_is_copied_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    column = base[:, 1]  # stride 6: not one span of memory
    stored = [StoredTensor("col", "F32", (4,), column, 16)]
    buffer = torch.empty(16, dtype=torch.uint8)
    [view] = stage_file(stored, buffer, False).tensors
    assert view.source.tolist() == [1.0, 7.0, 13.0, 19.0]


def test_a_buffer_too_small_is_refused_before_anything_is_copied() -> None:
    stored = [StoredTensor("t", "F32", (8,), torch.ones(8), 32)]
    buffer = torch.zeros(31, dtype=torch.uint8)
    with pytest.raises(ValueError, match="32 bytes of tensors do not fit a 31-byte"):
        stage_file(stored, buffer, False)
    assert not buffer.any()


def test_gather_checks_every_destination_before_copying() -> None:
    src = torch.arange(4, dtype=torch.int32)
    dst = bytearray(16)
    with pytest.raises(ValueError, match=r"bytes \[8, \+12\) of item 1 lie outside"):
        _engine.gather(dst, [src.data_ptr(), src.data_ptr()], [0, 8], [4, 12])
    assert dst == bytearray(16)  # not even the first item was copied
    with pytest.raises(ValueError, match="differ in length"):
        _engine.gather(dst, [src.data_ptr()], [0, 4], [4])
    with pytest.raises(ValueError, match="null source address"):
        _engine.gather(dst, [0], [0], [4])
    with pytest.raises(OverflowError):
        _engine.gather(dst, [src.data_ptr()], [-1], [4])
    with pytest.raises(TypeError):
        _engine.gather(bytes(16), [], [], [])  # the destination must be writable
    _engine.gather(dst, [src.data_ptr(), 0], [4, 16], [8, 0])  # an empty item anywhere
    assert bytes(dst[4:12]) == bytes(memory_of(src))[:8]


@pytest.mark.parametrize("threads", [1, 2, 4, 64, 1000])
def test_gather_on_threads_copies_every_item_and_nothing_else(threads: int) -> None:
    # 20,000 items of 0-4,000 bytes and two of 9-13 MiB (~62 MiB: runs of 4 MiB for
    # several threads), laid out in the destination shuffled, with gaps between them.
    gen = torch.Generator().manual_seed(threads)
    lengths = torch.randint(0, 4000, (20_000,), generator=gen).tolist()
    lengths[7] = 0
    lengths[3] = 13 * (1 << 20) + 5  # items larger than a thread's run: cut into pieces
    lengths[19_999] = 9 * (1 << 20)
    source = torch.randint(0, 256, (sum(lengths),), dtype=torch.uint8, generator=gen)
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    offsets = [0] * len(lengths)
    cursor = 0
    for i in order:
        offsets[i] = cursor
        cursor += lengths[i] + 3  # a gap that must stay untouched
    dst = torch.full((cursor,), 0xEE, dtype=torch.uint8)
    expect = dst.clone()
    for i in range(len(lengths)):
        expect[offsets[i]:offsets[i] + lengths[i]] = source[starts[i]:starts[i] + lengths[i]]
    _engine.gather(memory_of(dst), [source.data_ptr() + s for s in starts], offsets, lengths,
                   threads)
    assert torch.equal(dst, expect)


def test_gather_refuses_fewer_than_one_thread() -> None:
    dst = bytearray(4)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        _engine.gather(dst, [], [], [], 0)
