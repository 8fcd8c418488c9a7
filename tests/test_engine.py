"""The C engine against the reference engine and the crc32c package.

Differential tests: the same segment lists written by both engines give
byte-identical files and identical checksums, over random layouts, block
sizes, thread counts and queue depths (including blocks smaller than a
segment, gaps, empty segments and unaligned tails), with both of the C
engine's I/O backends: the thread pool and io_uring.
"""

from __future__ import annotations

import errno
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastpersist import _engine
from fastpersist.engine.reference import ReferenceEngine

KIB = 1024

needs_uring = pytest.mark.skipif(not _engine.uring_available(), reason="io_uring refused here")
# Every engine test that takes `backend` runs once per I/O backend.
BACKENDS = [
    pytest.param(_engine.BACKEND_POOL, id="pool"),
    pytest.param(_engine.BACKEND_URING, id="uring", marks=needs_uring),
]


def native_write(path: Path, segments, size, block_size=64 * KIB, threads=3,
                 direct=_engine.DIRECT_AUTO, **io):
    return _engine.write_file(str(path), segments, size, block_size, threads, direct, **io)


def native_read(path: Path, segments, block_size=64 * KIB, threads=3,
                direct=_engine.DIRECT_AUTO, checksum=True, **io):
    return _engine.read_file(str(path), segments, block_size, threads, direct, checksum, **io)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4095, 4096, 12287, 12288, 12289, 36865, 1 << 20])
def test_crc32c_matches_reference_library(size: int) -> None:
    data = os.urandom(size + 3)
    for start in range(4):  # every alignment of the start pointer
        chunk = data[start:start + size]
        assert _engine.crc32c(chunk) == crc32c.crc32c(chunk)


def test_crc32c_at_every_length_alignment_and_start_value() -> None:
    """Every length across the AVX-512 path's threshold (1 KiB) and a few folds
    of 256 bytes past it, from every 64-byte alignment, continuing a random
    register: the same value as the crc32c package's."""
    rng = random.Random(5)
    data = memoryview(os.urandom(8192))
    for n in range(0, 3000):
        start, value = rng.randrange(64), rng.getrandbits(32)
        chunk = data[start:start + n]
        assert _engine.crc32c(chunk, value) == crc32c.crc32c(bytes(chunk), value), (n, start)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.split(":", 1)[1].split()}


def test_crc32c_folds_with_vpclmulqdq_where_the_cpu_has_it() -> None:
    """Where the CPU has it, the AVX-512 path is the one used (so the test
    above exercises it), and with FASTPERSIST_CRC32C_NO_VPCLMUL the crc32
    instruction alone gives the same values."""
    if not {"avx512f", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= _cpu_flags():
        pytest.skip("no AVX-512 VPCLMULQDQ on this CPU")
    assert _engine.CRC32C_IMPL == "avx512-vpclmulqdq"
    code = ("import sys; from fastpersist import _engine\n"
            "data = bytes(range(256)) * 40 + b'tail'\n"
            "print(_engine.CRC32C_IMPL, _engine.crc32c(data, 12345))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, FASTPERSIST_CRC32C_NO_VPCLMUL="1"))
    impl, value = out.stdout.split()
    assert impl == "sse4.2"
    assert int(value) == _engine.crc32c(bytes(range(256)) * 40 + b"tail", 12345)


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


queue_depths = st.sampled_from([1, 2, 3, 8])


@pytest.mark.parametrize("backend", BACKENDS)
@given(layout=layouts(), queue_depth=queue_depths)
def test_native_writes_the_same_bytes_as_the_reference(
    tmp_path_factory, backend, layout, queue_depth
) -> None:
    segments, size, block_size, threads = layout
    d = tmp_path_factory.mktemp("diff")
    crcs, _ = native_write(d / "native", segments, size, block_size, threads,
                           backend=backend, queue_depth=queue_depth)
    ref = ReferenceEngine().write_file(str(d / "ref"), segments, size)
    native_bytes = (d / "native").read_bytes()
    assert native_bytes == (d / "ref").read_bytes()
    assert len(native_bytes) == size
    assert crcs == ref.crcs == [crc32c.crc32c(b) for b, _ in segments]


@pytest.mark.parametrize("backend", BACKENDS)
# DIRECT_OFF: buffered reads run as one sequential stream per thread instead.
@pytest.mark.parametrize("direct", [_engine.DIRECT_AUTO, _engine.DIRECT_OFF],
                         ids=["direct", "buffered"])
@given(layout=layouts(), queue_depth=queue_depths, data=st.data())
def test_native_reads_any_segment_list(tmp_path_factory, backend, direct, layout, queue_depth,
                                       data) -> None:
    segments, size, block_size, threads = layout
    path = tmp_path_factory.mktemp("read") / "f"
    ReferenceEngine().write_file(str(path), segments, size)
    content = path.read_bytes()
    # Random ranges, overlapping and unordered, into buffers at random
    # alignments (an offset into a larger bytearray), so both the in-place
    # O_DIRECT path and the bounce path run; some only checksummed (unkept).
    reads: list = []
    for _ in range(data.draw(st.integers(0, 10))):
        start = data.draw(st.integers(0, size))
        length = data.draw(st.integers(0, size - start))
        if data.draw(st.booleans()):
            reads.append((None, start, length))
            continue
        pad = data.draw(st.sampled_from([0, 1, 64, 4095]))
        backing = bytearray(length + pad)
        reads.append((memoryview(backing)[pad:], start))
    crcs, _ = native_read(path, reads, block_size, threads, direct=direct, backend=backend,
                          queue_depth=queue_depth)
    for (view, start, *unkept), crc in zip(reads, crcs, strict=True):
        expected = content[start:start + (unkept[0] if view is None else len(view))]
        assert view is None or bytes(view) == expected
        assert crc == crc32c.crc32c(expected)
    assert ReferenceEngine().read_file(str(path), reads).crcs == crcs


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_aligned_read_goes_in_place_and_round_trips(tmp_path: Path, backend) -> None:
    # Big enough for the in-place path (>= 256 KiB, same alignment phase).
    payload = os.urandom(3 * (1 << 20) + 123)
    path = tmp_path / "f"
    native_write(path, [(b"h" * 4096, 0), (payload, 4096)], 4096 + len(payload), backend=backend)
    import mmap

    dest = mmap.mmap(-1, len(payload) + 4096)  # page-aligned
    view = memoryview(dest)[: len(payload)]
    crcs, _ = native_read(path, [(view, 4096)], block_size=1 << 20, backend=backend)
    assert bytes(view) == payload and crcs == [crc32c.crc32c(payload)]
    # A file cut short inside the in-place part: the read comes back short.
    os.truncate(path, 4096 + (1 << 20) + 5)
    with pytest.raises(EOFError, match="truncated"):
        native_read(path, [(view, 4096)], block_size=1 << 20, backend=backend)
    view.release()
    dest.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [64 * KIB, 1 << 20])
def test_staged_layout_is_written_in_place_identically(tmp_path: Path, backend, block_size
                                                       ) -> None:
    """Segments that lie back to back in one page-aligned buffer, as an async
    save's staging does, are written from that memory without the bounce copy;
    the bytes and checksums must not change."""
    import mmap

    sizes = [1000, 3 * block_size + 17, 4, block_size, 12345, 0, 2 * block_size + 4096]
    staging = mmap.mmap(-1, sum(sizes))
    staging[:] = os.urandom(len(staging))
    view = memoryview(staging)
    header = os.urandom(4096)
    segments = [(header, 0)]
    pos = 0
    for n in sizes:
        segments.append((view[pos : pos + n], 4096 + pos))
        pos += n
    size = 4096 + pos
    crcs, _ = native_write(tmp_path / "native", segments, size, block_size, threads=3,
                           backend=backend)
    ref = ReferenceEngine().write_file(str(tmp_path / "ref"), segments, size)
    assert (tmp_path / "native").read_bytes() == (tmp_path / "ref").read_bytes()
    assert crcs == ref.crcs
    del segments
    view.release()
    staging.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_raises_eof(tmp_path: Path, backend) -> None:
    path = tmp_path / "f"
    native_write(path, [(b"x" * 5000, 0)], 5000, backend=backend)
    with pytest.raises(EOFError, match="truncated"):
        native_read(path, [(bytearray(10), 4995)], backend=backend)
    with pytest.raises(EOFError, match="truncated"):
        native_read(path, [(None, 4995, 10)], backend=backend)


def test_unkept_segments_are_for_reads_only(tmp_path: Path) -> None:
    path = tmp_path / "f"
    native_write(path, [(b"x" * 5000, 0)], 5000)
    with pytest.raises(TypeError, match=r"must be a \(buffer, offset\) tuple$"):
        native_write(tmp_path / "g", [(None, 0, 10)], 10)
    with pytest.raises(TypeError, match="region must be"):
        native_read(path, [(None, 0, 10)], region=(None, 0, 10))
    with pytest.raises(TypeError, match=r"or \(None, offset, length\)"):
        native_read(path, [(bytearray(4), 0, 4)])


@needs_uring
@pytest.mark.parametrize("threads,queue_depth", [(1, 1), (1, 2), (1, 7), (2, 3), (4, 32)])
def test_uring_output_is_byte_identical_to_the_pool(tmp_path: Path, threads, queue_depth) -> None:
    # Many blocks per call, so slots are reused and several writes are in flight.
    segments, offset = [], 100
    for length in (5, 70_000, 1 << 20, 3, 2_500_000, 0, 123_457):
        segments.append((os.urandom(length), offset))
        offset += length + 777
    size = offset + 1000
    pool_crcs, _ = native_write(tmp_path / "pool", segments, size, 16 * KIB, threads,
                                backend=_engine.BACKEND_POOL)
    uring_crcs, _ = native_write(tmp_path / "uring", segments, size, 16 * KIB, threads,
                                 backend=_engine.BACKEND_URING, queue_depth=queue_depth)
    content = (tmp_path / "pool").read_bytes()
    assert (tmp_path / "uring").read_bytes() == content
    assert uring_crcs == pool_crcs
    views = [(bytearray(len(b)), off) for b, off in segments]
    read_crcs, _ = native_read(tmp_path / "uring", views, 16 * KIB, threads,
                               backend=_engine.BACKEND_URING, queue_depth=queue_depth)
    assert read_crcs == pool_crcs
    assert all(bytes(v) == b for (v, _), (b, _) in zip(views, segments, strict=True))


def test_bad_backend_or_queue_depth_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backend"):
        native_write(tmp_path / "f", [], 0, backend=7)
    with pytest.raises(ValueError, match="queue_depth"):
        native_read(tmp_path / "f", [], queue_depth=0)
    with pytest.raises(ValueError, match="queue_depth"):
        native_write(tmp_path / "f", [], 0, queue_depth=_engine.MAX_QUEUE_DEPTH + 1)
    with pytest.raises(TypeError):  # keyword-only, after the existing positional ones
        _engine.write_file(str(tmp_path / "f"), [], 0, 4096, 1, 0, True, _engine.BACKEND_POOL)


@pytest.mark.parametrize(("option", "message"), [
    ({"block_size": -4096}, "block_size must be a positive multiple of 4096"),
    ({"threads": 0}, "threads must be between 1 and 64"),
    ({"threads": 65}, "threads must be between 1 and 64"),
    ({"threads": -1}, "threads must be between 1 and 64"),
    ({"direct": -1}, "direct must be DIRECT_OFF, DIRECT_ON or DIRECT_AUTO"),
    ({"direct": 3}, "direct must be DIRECT_OFF, DIRECT_ON or DIRECT_AUTO"),
    ({"backend": -1}, "backend must be BACKEND_POOL, BACKEND_URING or BACKEND_AUTO"),
    ({"queue_depth": -5}, "queue_depth must be between 1 and 1024"),
])
def test_each_bad_option_is_named_before_any_segment_is_read(tmp_path: Path, option,
                                                               message) -> None:
    # The engine's fp_check_opts words the message; the binding calls it before it
    # touches the segments, so a malformed list does not hide the bad option.
    for call in (native_write, native_read):
        segments = 5 if call is native_write else [(b"read-only", 0)]
        with pytest.raises(ValueError) as info:
            call(tmp_path / "f", segments, *(() if call is native_read else (10,)), **option)
        assert str(info.value) == message
    assert not (tmp_path / "f").exists()


_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Runs in a child: a seccomp filter makes io_uring_setup fail with EPERM, as
# Docker's default profile does, then the engine is used with each backend.
_SECCOMP_CHILD = """
import ctypes, os, sys

class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

LD_ABS_W, JEQ_K, RET_K = 0x20, 0x15, 0x06
EPERM_RET, ALLOW = 0x00050000 | 1, 0x7FFF0000
program = (Filter * 6)(
    Filter(LD_ABS_W, 0, 0, 4),            # seccomp_data.arch
    Filter(JEQ_K, 0, 3, ARCH),            # another ABI: allow
    Filter(LD_ABS_W, 0, 0, 0),            # seccomp_data.nr
    Filter(JEQ_K, 0, 1, 425),             # io_uring_setup
    Filter(RET_K, 0, 0, EPERM_RET),
    Filter(RET_K, 0, 0, ALLOW),
)
libc = ctypes.CDLL(None, use_errno=True)
prog = Prog(len(program), program)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(
        PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0):
    sys.exit("seccomp: " + os.strerror(ctypes.get_errno()))

from fastpersist import _engine
path, payload = sys.argv[1], os.urandom(300_000)
assert not _engine.uring_available()
crcs, _ = _engine.write_file(path, [(payload, 10)], 400_000, 65536, 2, _engine.DIRECT_AUTO,
                             backend=_engine.BACKEND_AUTO)
with open(path, "rb") as f:
    assert f.read() == bytes(10) + payload + bytes(400_000 - 300_010)
buf = bytearray(len(payload))
assert _engine.read_file(path, [(buf, 10)], 65536, 2, _engine.DIRECT_AUTO,
                         backend=_engine.BACKEND_AUTO)[0] == crcs and buf == payload
try:
    _engine.write_file(path, [], 0, 65536, 2, _engine.DIRECT_AUTO,
                       backend=_engine.BACKEND_URING)
except PermissionError as e:
    assert "io_uring" in str(e), e
else:
    sys.exit("BACKEND_URING did not fail where io_uring_setup is refused")
print("fell back")
"""


def test_auto_falls_back_to_the_pool_where_io_uring_is_refused(tmp_path: Path) -> None:
    arch = _AUDIT_ARCH.get(platform.machine())
    if arch is None:
        pytest.skip(f"no seccomp filter written for {platform.machine()}")
    script = _SECCOMP_CHILD.replace("ARCH)", f"{arch})")
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "f")],
                           capture_output=True, text=True, timeout=120)
    if child.returncode and "seccomp:" in child.stderr:
        pytest.skip(child.stderr.strip())
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "fell back"


def test_malformed_segments_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlaps"):
        native_write(tmp_path / "f", [(b"ab", 0), (b"c", 1)], 10)
    with pytest.raises(ValueError, match="past the file size"):
        native_write(tmp_path / "f", [(b"abc", 8)], 10)
    with pytest.raises(ValueError, match="block_size"):
        native_write(tmp_path / "f", [], 0, block_size=1000)
    with pytest.raises(TypeError):
        native_write(tmp_path / "f", [(b"ab",)], 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_os_errors_carry_errno_and_path(tmp_path: Path, backend) -> None:
    with pytest.raises(FileNotFoundError) as info:
        native_write(tmp_path / "missing" / "f", [], 0, backend=backend)
    assert "missing" in str(info.value)
    with pytest.raises(FileNotFoundError):
        native_read(tmp_path / "nope", [(bytearray(1), 0)], backend=backend)
    # A directory opens for reading; the read itself fails (in a CQE under io_uring).
    with pytest.raises(IsADirectoryError, match="read of 65536 bytes at offset 0"):
        native_read(tmp_path, [(bytearray(100_000), 0)], backend=backend)


def test_bounce_buffers_are_reused_across_calls(tmp_path: Path) -> None:
    # An empty cache and one thread: the cache holds at most 32 buffers and
    # evicts the oldest (of another test's size) when full, and the buffers a
    # call with several threads allocates depend on how its threads overlap.
    _engine.release_buffers()
    payload = os.urandom(1 << 20)
    native_write(tmp_path / "a", [(payload, 0)], len(payload), threads=1)
    cached = _engine.cached_buffer_bytes()
    assert cached > 0
    for name in "bcd":
        native_write(tmp_path / name, [(payload, 0)], len(payload), threads=1)
    assert _engine.cached_buffer_bytes() == cached
    _engine.release_buffers()
    assert _engine.cached_buffer_bytes() == 0


def _huge_page_mappings() -> set[tuple[int, int]]:
    """(start, end) of this process's mappings that asked for huge pages
    (MADV_HUGEPAGE: "hg" among their VmFlags)."""
    found, current = set(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                current = (lo, hi)
            elif first == "VmFlags:" and " hg" in line:
                found.add(current)
    return found


@pytest.mark.parametrize("huge", [True, False])
def test_bounce_buffers_ask_for_huge_pages_unless_told_not_to(tmp_path: Path, huge: bool) -> None:
    # A bounce buffer's pages are the runs of physical memory an O_DIRECT
    # request is cut at; huge pages keep requests large (csrc/fp_util.c).
    block = 2 << 20
    payload = os.urandom(3 * block + 123)  # the unaligned tail goes through a bounce buffer
    _engine.release_buffers()
    before = _huge_page_mappings()
    _engine.set_huge_buffers(huge)
    try:
        native_write(tmp_path / "f", [(payload, 0)], len(payload), block_size=block, threads=1)
        out = bytearray(len(payload) - 5)
        native_read(tmp_path / "f", [(memoryview(out), 5)], block_size=block, threads=1)
        new = _huge_page_mappings() - before
    finally:
        _engine.set_huge_buffers(True)
        _engine.release_buffers()
    assert out == payload[5:]
    if huge:
        # The write's buffer (one block) and the read's (a block and two pages),
        # each at a 2 MiB boundary, unless the kernel merged them with a neighbour.
        assert new, "no bounce buffer asked for huge pages"
        assert all(lo % block == 0 or hi % block == 0 for lo, hi in new)
        assert sum(hi - lo for lo, hi in new) >= block
    else:
        assert not new


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_writes_are_resumed_and_errors_name_the_offset(ramfs: Path, backend) -> None:
    # ramfs has no fallocate, so the size limit is met by the writes: the one
    # that crosses it comes back short, the rest of it fails with EFBIG. One
    # write in flight, so the first failure is that one.
    limit = 5 * 4096 + 100
    payload = os.urandom(8 * 4096)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(OSError) as info:
            native_write(ramfs / "f", [(payload, 0)], len(payload), block_size=8 * KIB,
                         threads=1, backend=backend, queue_depth=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.errno == errno.EFBIG
    # The pool names the block it was writing; io_uring the remainder it resubmitted.
    where = {_engine.BACKEND_POOL: "8192 bytes at offset 16384",
             _engine.BACKEND_URING: f"{16384 + 8192 - limit} bytes at offset {limit}"}
    assert where[backend] in str(info.value)
    assert (ramfs / "f").read_bytes() == payload[:limit]


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


_TRUNCATED_SOURCE = textwrap.dedent("""
    import errno, mmap, os, sys
    from fastpersist import _engine
    src, dst, backend, offset = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    size = 4 << 20
    with open(src, "wb") as f:
        f.write(os.urandom(size))
    fd = os.open(src, os.O_RDWR)
    mm = mmap.mmap(fd, size)
    os.ftruncate(fd, 0)  # the pages behind the mapping are gone: reads fault
    try:
        _engine.write_file(dst, [(memoryview(mm), offset)], offset + size, 1 << 20, 2,
                           _engine.DIRECT_AUTO, backend=backend)
    except OSError as exc:
        print("errno", exc.errno, exc)
    else:
        print("no error")
    print("alive")
""")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0, 512], ids=["in-place", "copied"])
def test_source_memory_that_faults_fails_the_write_not_the_process(
        tmp_path: Path, backend: int, offset: int) -> None:
    """fastpersistd writes from clients' shared memory; a client that truncates
    its segment makes those reads SIGBUS. The engine must turn that into
    EFAULT for this write (the daemon fails one checkpoint) and live on. Runs
    in a child so that a regression kills the child, not the test run."""
    out = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_SOURCE, str(tmp_path / "src"), str(tmp_path / "dst"),
         str(backend), str(offset)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert f"errno {errno.EFAULT}" in out.stdout and "SIGBUS" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("alive")


def test_guarded_copy_of_memory_that_faults_raises(tmp_path: Path) -> None:
    """_engine.copy is how fastpersistd's codec reads a client's shared memory
    (a compressed checkpoint): a truncated segment is an OSError(EFAULT) for
    that copy, and the process lives. In a child, as above."""
    script = textwrap.dedent("""
        import mmap, os, sys
        from fastpersist import _engine
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 3 << 20)
        mm = mmap.mmap(fd, 3 << 20)
        mm[:] = b"\\x5a" * (3 << 20)
        dst = bytearray(1 << 20)
        crc = _engine.copy(dst, memoryview(mm)[1 << 20:2 << 20])
        print("copied", dst == b"\\x5a" * (1 << 20), crc == _engine.crc32c(dst))
        os.ftruncate(fd, 4096)
        try:
            _engine.copy(dst, memoryview(mm)[1 << 20:2 << 20])
        except OSError as exc:
            print("errno", exc.errno, exc)
        else:
            print("no error")
        print("alive")
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert "copied True True" in out.stdout, out.stdout
    assert f"errno {errno.EFAULT}" in out.stdout and "SIGBUS" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("alive")


def test_guarded_copy_checks_its_buffers() -> None:
    src = bytes(range(256)) * 1000  # several of its 64 KiB runs, the last one short
    dst = bytearray(len(src))
    assert _engine.copy(dst, src) == crc32c.crc32c(src)  # checksummed as it copies
    assert dst == src
    assert _engine.copy(bytearray(), b"") == 0
    with pytest.raises(ValueError, match="destination holds 4095 bytes"):
        _engine.copy(bytearray(4095), src)
    with pytest.raises(TypeError):
        _engine.copy(b"read-only", b"x" * 9)


def test_sigbus_outside_the_engine_still_kills(tmp_path: Path) -> None:
    """The guard must not swallow faults it does not own: a SIGBUS in Python
    code after the engine installed its handler still terminates the process."""
    script = textwrap.dedent("""
        import mmap, os, sys
        from fastpersist import _engine
        _engine.write_file(sys.argv[2], [(b"x" * 4096, 0)], 4096, 4096, 1, _engine.DIRECT_AUTO)
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        os.ftruncate(fd, 0)
        print(mm[0])
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m"), str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stdout, out.stderr)


def test_write_relative_to_a_directory_creates_a_new_file_only(tmp_path: Path,
                                                               engine_name: str) -> None:
    """The daemon writes data files relative to its staging directory's fd: a
    new file there, never through a symlink or over a file someone planted."""
    from fastpersist.engine import get_engine

    engine = get_engine(engine_name)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    d = tmp_path / "d"
    d.mkdir()
    (d / "link").symlink_to(outside)
    (d / "planted").write_bytes(b"planted")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        data = os.urandom(5000)
        result = engine.write_file("new", [(data, 100)], 8192, dir_fd=fd)
        assert (d / "new").read_bytes() == bytes(100) + data + bytes(8192 - 5100)
        assert result.crcs == [crc32c.crc32c(data)]
        for name in ("link", "planted", "new"):
            with pytest.raises(FileExistsError):
                engine.write_file(name, [(b"x", 0)], 1, dir_fd=fd)
        with pytest.raises(ValueError):
            engine.write_file("sub/new", [(b"x", 0)], 1, dir_fd=fd)
    finally:
        os.close(fd)
    assert outside.read_bytes() == b"keep" and (d / "planted").read_bytes() == b"planted"


def test_openat2_resolves_beneath_without_symlinks(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "b")
    how = _engine.RESOLVE_BENEATH | _engine.RESOLVE_NO_SYMLINKS
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    root = os.open(tmp_path / "a", flags)
    try:
        try:
            fd = _engine.openat2(root, "b", flags, 0, how)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM):
                pytest.skip(f"openat2 is refused here ({exc})")
            raise
        os.close(fd)
        for path, err in (("link", errno.ELOOP), ("../a", errno.EXDEV),
                          (str(tmp_path / "a" / "b"), errno.EXDEV), ("nothing", errno.ENOENT)):
            with pytest.raises(OSError) as info:
                _engine.openat2(root, path, flags, 0, how)
            assert info.value.errno == err, path
    finally:
        os.close(root)
