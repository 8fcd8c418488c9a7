"""New process memory for tensors: private, page-aligned, in huge pages where they help.

Python's `mmap.mmap(-1, n)` maps MAP_SHARED anonymous memory, i.e. shmem,
whose page faults cost more than a private page's (a cold 1 GiB load spent
0.79 s of CPU with it here, 0.54 s with private memory), and whose writes a
forked child (a DataLoader worker) would share with its parent. Loaded
tensors and staging buffers are private memory, as torch's own allocator's
are. Their pages come in on first touch, on whichever threads touch them
(the engine's readers, the snapshot's copy).

Huge pages, and the VMs where they hurt. A load asks for transparent huge
pages (a 512th of the page faults), except on a virtual machine whose
balloon device reports free memory to its host (virtio-balloon
VIRTIO_BALLOON_F_REPORTING: Firecracker, QEMU with free-page-reporting=on).
Such a guest hands every free 2 MiB block back to the host, and a huge page
is exactly such a block: its first touch faults in the host page by page.
Measured on this project's machine, which is one (`benchmarks/first_touch.py`):
first touch of 1 GiB at 0.4-0.65 GB/s with huge pages (13 GB/s when the
kernel happened to reuse recently freed blocks) against 1.8-2.2 GB/s with
4 KiB pages, and a cold 1 GiB load of 1.65 s against 0.72 s (medians of 7
interleaved fresh processes).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os

from . import knobs

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

VIRTIO_DEVICES = "/sys/bus/virtio/devices"
_VIRTIO_ID_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5  # feature bit: free page reporting


def reports_free_pages(devices: str = VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon here negotiated free page reporting with its
    host (each device's `features` file is its negotiated bits, bit 0 first)."""
    try:
        names = os.listdir(devices)
    except OSError:
        return False  # not a virtio guest
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                device = int(f.read().strip(), 16)
            if device != _VIRTIO_ID_BALLOON:
                continue
            with open(os.path.join(devices, name, "features")) as f:
                features = f.read().strip()
        except (OSError, ValueError):
            continue
        if features[_VIRTIO_BALLOON_F_REPORTING:_VIRTIO_BALLOON_F_REPORTING + 1] == "1":
            return True
    return False


@functools.cache
def _reports_free_pages_here() -> bool:
    return reports_free_pages()  # a device's features do not change while it runs


def huge_pages_help() -> bool:
    """Whether memory that asks for huge pages gets them (FASTPERSIST_HUGE_PAGES)."""
    choice = knobs.huge_pages()
    if choice == "auto":
        return not _reports_free_pages_here()
    return choice == "on"


def loads_bounce() -> bool:
    """Whether a load reads into the new memory of its tensors through the
    engine's bounce buffers instead of straight into it with O_DIRECT
    (FASTPERSIST_LOAD_BOUNCE).

    auto: bounce where that memory comes in 4 KiB pages (huge_pages_help() is
    false) and the engine's backend is the thread pool (the default). Measured
    here (a Firecracker VM, 4 KiB pages; 1 GiB, fresh processes, page cache
    dropped, 9 interleaved rounds): 0.50 s through the bounce buffers against
    0.69 s straight in, though the bounce path copies every byte once more.
    Probably why: the bounce buffers are huge pages reused from read to read,
    so each request the disk sees is one large contiguous run (an O_DIRECT
    request into 4 KiB pages is cut at 254 runs of contiguous memory), and the
    new pages are faulted in by the copy after each read lands (CRC32C in the
    same pass), not while the read is issued.
    Faulting them in ahead of in-place reads on another thread did not help
    (0.694 vs 0.702 s), so the requests' size is likely most of it. Huge pages
    have neither problem and O_DIRECT in place saves the copy, so auto keeps
    that where they are on (not measured here: this VM turns them off). With
    io_uring (FASTPERSIST_IO_BACKEND=uring or auto) bouncing was slower here
    (0.968 vs 0.685 s, 5 rounds): its threads, one per CPU, do every copy and
    fault themselves, where the pool spreads them over 8 threads a file whose
    reads overlap them; auto reads in place there.
    """
    choice = knobs.load_bounce()
    if choice == "auto":
        return not huge_pages_help() and knobs.io_backend() == "pool"
    return choice == "on"


def anonymous(nbytes: int, *, huge: bool = False) -> mmap.mmap:
    """`nbytes` (> 0) of new zeroed private memory, page-aligned; freed when the
    last reference to the mapping goes.

    huge: ask for transparent huge pages (the kernel's default policy is
    "madvise") where huge_pages_help(). Loads ask: their memory is faulted
    in by the engine's readers as the reads land, and a fresh process restoring
    a checkpoint has memory to spare. Staging does not: where memory is
    fragmented the kernel compacts it on the faulting thread, and a first
    async_save of 1.08 GB here stalled 592 ms with huge pages, 276 ms without.
    """
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and nbytes >= HUGE_PAGE and _MADV_HUGEPAGE is not None and huge_pages_help():
        with contextlib.suppress(OSError):  # huge pages off here: 4 KiB pages
            m.madvise(_MADV_HUGEPAGE)
    return m
