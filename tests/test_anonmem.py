"""Loaded tensors and staging buffers live in private memory, not shmem (anonmem.py).

Python's mmap.mmap(-1, n) is MAP_SHARED anonymous memory, which the kernel
lists as "/dev/zero (deleted)" with an "s" in its permissions: faulting it in
cost half of a cold load's CPU, and a forked child (a DataLoader worker)
would share its writes with the parent.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

import fastpersist
from fastpersist import anonmem
from fastpersist.anonmem import HUGE_PAGE, anonymous
from fastpersist.saving import staging


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def assert_private_anonymous(t: torch.Tensor) -> None:
    perms, path = mapping_of(t.data_ptr())
    assert perms.endswith("p"), (perms, path)  # private, not shared
    assert "/dev/zero" not in path and "shmem" not in path, path


def test_large_loaded_tensors_are_private_anonymous_memory(tmp_path: Path) -> None:
    state = {"big": torch.randn(3 << 20), "odd": torch.randn(1 << 18).to(torch.bfloat16)}
    fastpersist.save(state, tmp_path / "c")
    loaded = fastpersist.load(tmp_path / "c")
    for name in state:
        assert torch.equal(loaded[name], state[name])
        assert_private_anonymous(loaded[name])


def test_staging_buffers_are_private_anonymous_memory() -> None:
    buffer = staging._allocate(HUGE_PAGE * 2, pinned=False)
    assert buffer.data_ptr() % 4096 == 0
    assert_private_anonymous(buffer)


def test_a_forked_child_does_not_write_into_the_parent() -> None:
    m = anonymous(HUGE_PAGE)
    m[:4] = b"same"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        m[:4] = b"diff"
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert m[:4] == b"same"


def vm_flags_of(address: int) -> list[str]:
    """The VmFlags (/proc/self/smaps) of the mapping that holds `address`."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


needs_thp = pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                               reason="this kernel has no transparent huge pages")


@needs_thp
@pytest.mark.parametrize("choice", ["on", "off"])
def test_huge_pages_for_loaded_tensors_follow_the_knob(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    state = {"big": torch.randn(3 << 20)}  # 12 MiB: a region of several huge pages
    fastpersist.save(state, tmp_path / "c")
    monkeypatch.setenv("FASTPERSIST_HUGE_PAGES", choice)
    loaded = fastpersist.load(tmp_path / "c")
    assert torch.equal(loaded["big"], state["big"])
    # "hg": the mapping was given MADV_HUGEPAGE.
    assert ("hg" in vm_flags_of(loaded["big"].data_ptr())) == (choice == "on")


@needs_thp
def test_auto_asks_for_huge_pages_unless_the_host_takes_free_pages_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_HUGE_PAGES", "auto")
    for reporting in (True, False):
        monkeypatch.setattr(anonmem, "_reports_free_pages_here", lambda r=reporting: r)
        assert anonmem.huge_pages_help() is not reporting
        m = anonymous(HUGE_PAGE * 2, huge=True)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert ("hg" in vm_flags_of(address)) is not reporting
    monkeypatch.setenv("FASTPERSIST_HUGE_PAGES", "sometimes")
    with pytest.raises(ValueError, match="FASTPERSIST_HUGE_PAGES"):
        anonmem.huge_pages_help()


def fake_virtio(root: Path, devices: dict[str, tuple[str, str]]) -> str:
    """A /sys/bus/virtio/devices look-alike: name -> (device id file, features file)."""
    for name, (device, features) in devices.items():
        (root / name).mkdir(parents=True)
        (root / name / "device").write_text(device + "\n")
        (root / name / "features").write_text(features + "\n")
    return str(root)


# Negotiated feature bits, bit 0 first, as the kernel prints them (64 of them
# shown here; the kernel prints more).
REPORTING = "0110010" + "0" * 57  # STATS_VQ, DEFLATE_ON_OOM, REPORTING (bit 5)
NO_REPORTING = "0110000" + "0" * 57


@pytest.mark.parametrize(("devices", "expected"), [
    ({"virtio0": ("0x0005", REPORTING), "virtio1": ("0x0002", "1" * 64)}, True),
    ({"virtio0": ("0x0005", NO_REPORTING)}, False),
    # Bit 5 of another kind of device (a block device's) means something else.
    ({"virtio0": ("0x0002", REPORTING)}, False),
    ({"virtio0": ("not hex", REPORTING), "virtio1": ("0x0005", "01")}, False),
    ({}, False),
])
def test_free_page_reporting_is_read_from_the_balloon_s_features(
        tmp_path: Path, devices: dict[str, tuple[str, str]], expected: bool) -> None:
    assert anonmem.reports_free_pages(fake_virtio(tmp_path / "devices", devices)) is expected


def test_no_virtio_bus_reports_nothing(tmp_path: Path) -> None:
    assert anonmem.reports_free_pages(str(tmp_path / "absent")) is False
