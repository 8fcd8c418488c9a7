"""The C engine against the reference engine and the crc32c package.

Differential tests: the same segment lists written by both engines give
byte-identical files and identical checksums, over random layouts, block
sizes and thread counts (including blocks smaller than a segment, gaps,
empty segments and unaligned tails).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastpersist import _engine
from fastpersist.engine.reference import ReferenceEngine

KIB = 1024


def native_write(path: Path, segments, size, block_size=64 * KIB, threads=3,
                 direct=_engine.DIRECT_AUTO):
    return _engine.write_file(str(path), segments, size, block_size, threads, direct)


def native_read(path: Path, segments, block_size=64 * KIB, threads=3,
                direct=_engine.DIRECT_AUTO, checksum=True):
    return _engine.read_file(str(path), segments, block_size, threads, direct, checksum)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4095, 4096, 12287, 12288, 12289, 36865, 1 << 20])
def test_crc32c_matches_reference_library(size: int) -> None:
    data = os.urandom(size + 3)
    for start in range(4):  # every alignment of the start pointer
        chunk = data[start:start + size]
        assert _engine.crc32c(chunk) == crc32c.crc32c(chunk)


def test_crc32c_known_answer() -> None:
    # RFC 3720 (iSCSI) test vectors.
    assert _engine.crc32c(b"123456789") == 0xE3069283
    assert _engine.crc32c(bytes(32)) == 0x8A9136AA
    assert _engine.crc32c(b"\xff" * 32) == 0x62A8AB43


@given(st.binary(max_size=50_000), st.integers(0, 50_000))
def test_crc32c_combine(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    a, b = data[:cut], data[cut:]
    assert _engine.crc32c_combine(_engine.crc32c(a), _engine.crc32c(b), len(b)) == crc32c.crc32c(
        data
    )
    assert _engine.crc32c(b, _engine.crc32c(a)) == crc32c.crc32c(data)


@st.composite
def layouts(draw):
    """Random sorted, non-overlapping segments with gaps, and a file size."""
    segments = []
    offset = draw(st.integers(0, 5000))
    for _ in range(draw(st.integers(0, 12))):
        length = draw(st.one_of(st.integers(0, 300), st.integers(0, 100_000)))
        segments.append((os.urandom(length), offset))
        offset += length + draw(st.one_of(st.just(0), st.integers(0, 9000)))
    size = offset + draw(st.integers(0, 5000))
    block_size = draw(st.sampled_from([4 * KIB, 8 * KIB, 12 * KIB, 64 * KIB, 1 << 20]))
    threads = draw(st.integers(1, 6))
    return segments, size, block_size, threads


@given(layouts())
def test_native_writes_the_same_bytes_as_the_reference(tmp_path_factory, layout) -> None:
    segments, size, block_size, threads = layout
    d = tmp_path_factory.mktemp("diff")
    crcs, _ = native_write(d / "native", segments, size, block_size, threads)
    ref = ReferenceEngine().write_file(str(d / "ref"), segments, size)
    native_bytes = (d / "native").read_bytes()
    assert native_bytes == (d / "ref").read_bytes()
    assert len(native_bytes) == size
    assert crcs == ref.crcs == [crc32c.crc32c(b) for b, _ in segments]


@given(layouts(), st.data())
def test_native_reads_any_segment_list(tmp_path_factory, layout, data) -> None:
    segments, size, block_size, threads = layout
    path = tmp_path_factory.mktemp("read") / "f"
    ReferenceEngine().write_file(str(path), segments, size)
    content = path.read_bytes()
    # Random ranges, overlapping and unordered, into buffers at random
    # alignments (an offset into a larger bytearray), so both the in-place
    # O_DIRECT path and the bounce path run.
    reads = []
    for _ in range(data.draw(st.integers(0, 10))):
        start = data.draw(st.integers(0, size))
        length = data.draw(st.integers(0, size - start))
        pad = data.draw(st.sampled_from([0, 1, 64, 4095]))
        backing = bytearray(length + pad)
        reads.append((memoryview(backing)[pad:], start))
    crcs, _ = native_read(path, reads, block_size, threads)
    for (view, start), crc in zip(reads, crcs, strict=True):
        expected = content[start:start + len(view)]
        assert bytes(view) == expected
        assert crc == crc32c.crc32c(expected)


def test_large_aligned_read_goes_in_place_and_round_trips(tmp_path: Path) -> None:
    # Big enough for the in-place path (>= 256 KiB, same alignment phase).
    payload = os.urandom(3 * (1 << 20) + 123)
    path = tmp_path / "f"
    native_write(path, [(b"h" * 4096, 0), (payload, 4096)], 4096 + len(payload))
    import mmap

    dest = mmap.mmap(-1, len(payload) + 4096)  # page-aligned
    view = memoryview(dest)[: len(payload)]
    crcs, _ = native_read(path, [(view, 4096)], block_size=1 << 20)
    assert bytes(view) == payload and crcs == [crc32c.crc32c(payload)]
    view.release()
    dest.close()


def test_read_past_end_raises_eof(tmp_path: Path) -> None:
    path = tmp_path / "f"
    native_write(path, [(b"x" * 5000, 0)], 5000)
    with pytest.raises(EOFError, match="truncated"):
        native_read(path, [(bytearray(10), 4995)])


def test_malformed_segments_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlaps"):
        native_write(tmp_path / "f", [(b"ab", 0), (b"c", 1)], 10)
    with pytest.raises(ValueError, match="past the file size"):
        native_write(tmp_path / "f", [(b"abc", 8)], 10)
    with pytest.raises(ValueError, match="block_size"):
        native_write(tmp_path / "f", [], 0, block_size=1000)
    with pytest.raises(TypeError):
        native_write(tmp_path / "f", [(b"ab",)], 10)


def test_os_errors_carry_errno_and_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        native_write(tmp_path / "missing" / "f", [], 0)
    assert "missing" in str(info.value)
    with pytest.raises(FileNotFoundError):
        native_read(tmp_path / "nope", [(bytearray(1), 0)])


def test_bounce_buffers_are_reused_across_calls(tmp_path: Path) -> None:
    payload = os.urandom(1 << 20)
    native_write(tmp_path / "a", [(payload, 0)], len(payload))
    cached = _engine.cached_buffer_bytes()
    assert cached > 0
    for name in "bcd":
        native_write(tmp_path / name, [(payload, 0)], len(payload))
    assert _engine.cached_buffer_bytes() == cached
    _engine.release_buffers()
    assert _engine.cached_buffer_bytes() == 0


def test_gil_is_released_during_io(tmp_path: Path) -> None:
    payload = bytes(256 << 20)
    ticks = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    worker = threading.Thread(target=spin)
    before = 0
    worker.start()
    try:
        before = ticks
        native_write(tmp_path / "big", [(payload, 0)], len(payload), block_size=1 << 20)
        during = ticks - before
    finally:
        done.set()
        worker.join()
    # Python code ran in the other thread while the engine wrote 256 MiB.
    assert during > 1000


@pytest.fixture
def ramfs(tmp_path: Path):
    """A filesystem that refuses O_DIRECT (ramfs answers open with EINVAL)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_falls_back_to_buffered_io_where_o_direct_is_refused(ramfs: Path) -> None:
    payload = os.urandom(100_000)
    crcs, direct = native_write(ramfs / "f", [(payload, 4096)], 4096 + len(payload) + 5)
    assert direct is False
    assert (ramfs / "f").read_bytes() == bytes(4096) + payload + bytes(5)
    buf = bytearray(len(payload))
    rcrcs, rdirect = native_read(ramfs / "f", [(buf, 4096)])
    assert rdirect is False and bytes(buf) == payload and rcrcs == crcs
    with pytest.raises(OSError) as info:
        native_write(ramfs / "g", [(payload, 0)], len(payload), direct=_engine.DIRECT_ON)
    assert info.value.errno == 22


def test_direct_io_used_on_the_test_disk(tmp_path: Path) -> None:
    # The suite's tmp dir is on ext4 here; if this fails the in-place paths
    # above were not exercised.
    _, direct = native_write(tmp_path / "f", [(b"x" * 10000, 0)], 10000)
    if not direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT on this machine")
    assert direct is True
