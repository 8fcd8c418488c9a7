"""The engine's region reads: a buffer laid out as the file, whose member
segments are read with block-sized I/Os straight into it (what a load of a
whole data file uses), next to segments that are not members."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastpersist
from fastpersist import _engine
from fastpersist.engine.reference import ReferenceEngine

KIB = 1024
PAGE = 4096
needs_uring = pytest.mark.skipif(not _engine.uring_available(), reason="io_uring refused here")
BACKENDS = [
    pytest.param(_engine.BACKEND_POOL, id="pool"),
    pytest.param(_engine.BACKEND_URING, id="uring", marks=needs_uring),
]
DIRECT = [pytest.param(_engine.DIRECT_AUTO, id="direct"),
          pytest.param(_engine.DIRECT_OFF, id="buffered")]
# bounce=True: nothing read in place, a region's blocks through bounce buffers too.
BOUNCE = [pytest.param(False, id="in-place"), pytest.param(True, id="bounce")]


def read(path: Path, segments, region, *, block_size=64 * KIB, threads=3,
         direct=_engine.DIRECT_AUTO, **io):
    return _engine.read_file(str(path), segments, block_size, threads, direct, True,
                             region=region, **io)


def write_random(path: Path, size: int) -> bytes:
    content = os.urandom(size)
    ReferenceEngine().write_file(str(path), [(content, 0)], size)
    return content


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("bounce", BOUNCE)
@given(data=st.data(), block_size=st.sampled_from([4 * KIB, 12 * KIB, 64 * KIB, 1 << 20]),
       threads=st.integers(1, 5))
def test_members_and_other_segments_read_the_file(tmp_path_factory, backend, direct, bounce,
                                                 data, block_size, threads) -> None:
    size = data.draw(st.integers(1, 300_000))
    path = tmp_path_factory.mktemp("region") / "f"
    content = write_random(path, size)
    # A page-aligned region for file bytes [lo, hi), as start_read makes it.
    lo = data.draw(st.integers(0, size - 1)) // PAGE * PAGE
    hi = -(-data.draw(st.integers(lo + 1, size)) // PAGE) * PAGE
    backing = mmap.mmap(-1, hi - lo)
    whole = memoryview(backing)
    segments = []
    for _ in range(data.draw(st.integers(0, 12))):
        start = data.draw(st.integers(lo, min(hi, size)))
        length = data.draw(st.integers(0, min(hi, size) - start))
        if data.draw(st.booleans()):  # a member: a view of the region at its own offset
            segments.append((whole[start - lo:start - lo + length], start))
        else:  # elsewhere, at any alignment
            pad = data.draw(st.sampled_from([0, 1, 4095]))
            segments.append((memoryview(bytearray(length + pad))[pad:], start))
    crcs, _ = read(path, segments, (backing, lo), block_size=block_size, threads=threads,
                   direct=direct, backend=backend, bounce=bounce)
    for (view, start), crc in zip(segments, crcs, strict=True):
        expected = content[start:start + len(view)]
        assert bytes(view) == expected
        assert crc == crc32c.crc32c(expected)


@pytest.mark.parametrize("direct", DIRECT)
def test_a_region_out_of_phase_or_too_short_is_not_used(tmp_path: Path, direct) -> None:
    """Memory whose phase differs from the file's cannot take O_DIRECT reads, and
    a region that does not reach the members' aligned end cannot take the last
    block: the members are then read one by one, the same bytes."""
    content = write_random(tmp_path / "f", 5 * PAGE + 100)
    backing = mmap.mmap(-1, 6 * PAGE)
    shifted = memoryview(backing)[1:]  # the region's phase is 1, the file's 0
    members = [(shifted[0:3000], 0), (shifted[3000:5 * PAGE + 100], 3000)]
    crcs, _ = read(tmp_path / "f", members, (shifted, 0), direct=direct)
    assert bytes(shifted[:5 * PAGE + 100]) == content
    assert crcs == [crc32c.crc32c(content[:3000]), crc32c.crc32c(content[3000:])]
    short = memoryview(backing)[:5 * PAGE + 100]  # not up to the next page boundary
    members = [(short[0:3000], 0), (short[3000:], 3000)]
    read(tmp_path / "f", members, (short, 0), direct=direct)
    assert bytes(short) == content


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("bounce", BOUNCE)
def test_a_truncated_file_fails_a_region_read(tmp_path: Path, backend, direct, bounce) -> None:
    write_random(tmp_path / "f", 3 * (1 << 20))
    backing = mmap.mmap(-1, 3 * (1 << 20))
    whole = memoryview(backing)
    members = [(whole[:1 << 20], 0), (whole[1 << 20:], 1 << 20)]
    os.truncate(tmp_path / "f", 2 * (1 << 20) + 5)
    with pytest.raises(EOFError, match="truncated"):
        read(tmp_path / "f", members, (backing, 0), block_size=1 << 20, direct=direct,
             backend=backend, bounce=bounce)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounce_reads_go_through_the_bounce_buffers(tmp_path: Path, backend) -> None:
    """Observed through the engine's buffer cache (buffers are taken only when
    an I/O needs one): a direct region read of whole pages takes none; the
    same read with bounce=True takes them, and fills the region all the same."""
    content = write_random(tmp_path / "f", 64 * PAGE)
    for bounce, takes_buffers in ((False, False), (True, True)):
        backing = mmap.mmap(-1, 64 * PAGE)
        whole = memoryview(backing)
        members = [(whole[:10 * PAGE], 0), (whole[10 * PAGE:], 10 * PAGE)]
        _engine.release_buffers()
        _, direct = read(tmp_path / "f", members, (backing, 0), block_size=16 * PAGE,
                         backend=backend, bounce=bounce)
        if not direct:
            pytest.skip("O_DIRECT refused here: nothing is read in place either way")
        assert (_engine.cached_buffer_bytes() > 0) is takes_buffers
        assert bytes(whole) == content
    _engine.release_buffers()


def test_a_malformed_region_is_a_type_error(tmp_path: Path) -> None:
    write_random(tmp_path / "f", 100)
    for bad in [b"read-only bytes", (bytearray(10),), (b"read-only", 0)]:
        with pytest.raises((TypeError, BufferError)):
            read(tmp_path / "f", [(bytearray(10), 0)], bad)


def test_a_load_reads_each_file_into_one_mapping_laid_out_as_the_file(tmp_path: Path) -> None:
    """Loaded tensors sit at their file offsets' distances from one another
    (read in place), each with a storage of its own, and stay correct when
    the others are dropped."""
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(1 + 997 * i, generator=g) for i in range(40)}
    state["half"] = torch.randn(333, generator=g).to(torch.bfloat16)
    fastpersist.save(state, tmp_path / "c")
    records = json.loads((tmp_path / "c" / "manifest.json").read_bytes())["tensors"]
    assert len({r["file"] for r in records}) == 1
    loaded = fastpersist.load(tmp_path / "c")
    offsets = {r["name"]: r["offset"] for r in records}
    base = loaded["t0"].data_ptr() - offsets["t0"]
    for name, t in loaded.items():
        assert t.data_ptr() - base == offsets[name]
        assert t.untyped_storage().nbytes() == t.nbytes
        assert torch.equal(t, state[name])
    keep = loaded.pop("t39")
    loaded.clear()
    assert torch.equal(keep, state["t39"])
    keep.mul_(2)
    assert torch.equal(keep, state["t39"] * 2)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def test_a_freed_large_tensor_gives_its_pages_back(tmp_path: Path) -> None:
    """Keeping one tensor of a loaded file does not keep the file's memory:
    each large tensor's own pages go back to the OS when it is freed."""
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 16 x 4 MiB
    fastpersist.save(state, tmp_path / "c")
    assert len(json.loads((tmp_path / "c" / "manifest.json").read_bytes())["files"]) == 1
    loaded = fastpersist.load(tmp_path / "c")
    held = _rss()
    keep = loaded.pop("t7")
    view = keep[1:]  # a view keeps the storage, and so the pages, alive
    loaded.clear()
    given_back = held - _rss()
    assert given_back > 15 * 4 * (1 << 20) * 0.9, given_back
    assert torch.equal(view, torch.full((1 << 20,), 7.0)[1:])
    del keep, view
    assert held - _rss() > 16 * 4 * (1 << 20) * 0.9
