"""The daemon's stream writer (fastpersist/daemon/stream_file.py) against the engines.

A data file fed to a StreamFile in pieces of any size must be the file that
the engine's write_file makes of the same header and tensors, byte for byte,
with the same CRC32C for the header and each tensor (the manifest's).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastpersist.daemon import stream_file
from fastpersist.daemon.stream_file import Slot, Slots, StreamFile
from fastpersist.engine import get_engine
from fastpersist.format.safetensors_file import HeaderEntry, layout

BLOCK = 3 * 4096  # small, so that files span many blocks and end in partial ones


def data_file(lengths: list[int], seed: int) -> tuple[bytes, bytes]:
    """A valid header for U8 tensors of these lengths, and random data for them."""
    lay = layout([HeaderEntry(f"t{i}", "U8", (n,), n) for i, n in enumerate(lengths)],
                 {"format": "pt"})
    return lay.header, random.Random(seed).randbytes(sum(lengths))


def engine_file(path: Path, header: bytes, lengths: list[int], data: bytes,
                engine: str) -> list[int]:
    segments = [(header, 0)]
    offset = 0
    for n in lengths:
        segments.append((data[offset:offset + n], len(header) + offset))
        offset += n
    result = get_engine(engine).write_file(str(path), segments, len(header) + len(data))
    assert result.crcs is not None
    return result.crcs


def streamed_file(directory: Path, name: str, header: bytes, lengths: list[int], data: bytes,
                  cuts: list[int], slot: Slot, direct: str = "auto") -> list[int]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        f = StreamFile(slot, fd, name, header, lengths, direct)
        f.open()
        view = memoryview(data)
        start = 0
        for cut in [*sorted(cuts), len(data)]:
            f.feed(view[start:cut])
            start = cut
        return f.finish()
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def slot() -> Slot:
    return Slot(BLOCK)


@pytest.mark.parametrize("engine", ["native", "python"])
@given(lengths=st.lists(st.integers(0, 5 * BLOCK), min_size=1, max_size=6),
       seed=st.integers(0, 2**32), cuts=st.lists(st.floats(0, 1), max_size=12),
       direct=st.sampled_from(["auto", "off"]))
def test_streamed_file_is_the_engines_file(tmp_path_factory: pytest.TempPathFactory,
                                           slot: Slot, engine: str, lengths: list[int],
                                           seed: int, cuts: list[float], direct: str) -> None:
    tmp = tmp_path_factory.mktemp("s")
    header, data = data_file(lengths, seed)
    want = engine_file(tmp / "engine", header, lengths, data, engine)
    got = streamed_file(tmp, "stream", header, lengths, data,
                        [int(c * len(data)) for c in cuts], slot, direct)
    assert got == want
    assert (tmp / "stream").read_bytes() == (tmp / "engine").read_bytes()


def test_buffered_writes_are_flushed_as_they_go(tmp_path: Path, slot: Slot,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without O_DIRECT, the page cache a stream dirties is written back and
    dropped every SYNC_BYTES, not left to grow with the file."""
    monkeypatch.setattr(stream_file, "SYNC_BYTES", 2 * BLOCK)
    lengths = [20 * BLOCK + 5]
    header, data = data_file(lengths, 1)
    want = engine_file(tmp_path / "engine", header, lengths, data, "native")
    assert streamed_file(tmp_path, "stream", header, lengths, data, [7, 9000], slot,
                         "off") == want
    assert (tmp_path / "stream").read_bytes() == (tmp_path / "engine").read_bytes()


def test_a_discarded_file_is_removed(tmp_path: Path, slot: Slot) -> None:
    lengths = [4 * BLOCK]
    header, data = data_file(lengths, 2)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        f = StreamFile(slot, fd, "part", header, lengths)
        f.open()
        f.feed(memoryview(data)[:3 * BLOCK])  # some blocks written, some in flight
        assert (tmp_path / "part").exists()
        f.discard()
        assert not (tmp_path / "part").exists()
        f.discard()  # twice is harmless
    finally:
        os.close(fd)


def test_more_data_than_the_header_holds_is_refused(tmp_path: Path, slot: Slot) -> None:
    header, data = data_file([100], 3)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        f = StreamFile(slot, fd, "f", header, [100])
        f.open()
        with pytest.raises(ValueError, match="more data"):
            f.feed(memoryview(data + b"x"))
        f.discard()
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_never_writes_through_an_existing_name(tmp_path: Path, slot: Slot, planted: str) -> None:
    """The file is created new (O_EXCL | O_NOFOLLOW): neither a file nor a
    link planted under its name is written through, nor removed."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    if planted == "file":
        os.link(victim, tmp_path / "f")
    else:
        (tmp_path / "f").symlink_to(victim)
    header, _ = data_file([10], 4)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        f = StreamFile(slot, fd, "f", header, [10])
        with pytest.raises(FileExistsError):
            f.open()
        f.discard()
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"keep" and os.path.lexists(tmp_path / "f")


def test_slots_are_bounded_and_reused() -> None:
    slots = Slots(2, BLOCK)
    a = slots.acquire(lambda: True)
    b = slots.acquire(lambda: True)
    assert a is not None and b is not None and a is not b
    assert slots.acquire(lambda: False) is None  # all in use: a third waits (here: gives up)
    slots.release(a)
    assert slots.acquire(lambda: False) is a
    assert slots.nbytes == 2 * 2 * BLOCK
