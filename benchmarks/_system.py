"""Machine facts, durability and page-cache helpers shared by the benchmark processes."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


def mount_of(path: Path) -> tuple[str, str, str]:
    """Return (mount point, fs type, device) of the mount holding `path`."""
    real = str(path.resolve())
    best = ("/", "unknown", "unknown")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, point, fstype = line.split()[:3]
            point = point.replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fstype, device)
    return best


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * KIB
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts(target: Path) -> dict[str, object]:
    """Facts printed at the top of a run, so results from different machines are not confused."""
    point, fstype, device = mount_of(target)
    usage = shutil.disk_usage(target)
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "mem_total_gib": round(mem_total_bytes() / GIB, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "target_dir": str(target),
        "target_fs": fstype,
        "target_mount": point,
        "target_device": device,
        "target_free_gib": round(usage.free / GIB, 1),
    }


def fsync_path(path: Path) -> None:
    """fsync one file or directory; O_RDONLY suffices on Linux because fsync works per inode."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Make `path` (file or directory tree) and its entry in the parent directory durable.

    Peers that do not promise durability get exactly this after their save returns, so every
    method in the table pays for the same guarantee fastpersist gives.
    """
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for name in files:
                fsync_path(Path(root) / name)
            fsync_path(Path(root))
    else:
        fsync_path(path)
    fsync_path(path.parent)


def _files_under(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(Path(root) / name for root, _d, names in os.walk(path) for name in names)
        elif path.exists():
            files.append(path)
    return files


def drop_page_cache(paths: list[Path]) -> str:
    """Evict `paths` from the page cache so the next read comes from the disk.

    The global drop is the honest one (it also drops metadata); it needs root. Without it,
    POSIX_FADV_DONTNEED on each file drops its clean pages, which is what a cold load needs.
    Returns the mechanism used, for the report.
    """
    os.sync()  # drop_caches and DONTNEED only drop clean pages
    try:
        with open("/proc/sys/vm/drop_caches", "w") as knob:
            knob.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    evict(paths)
    return "fadvise"


def evict(paths: list[Path]) -> None:
    """Drop the clean pages of the files at or under `paths` from the page cache
    (POSIX_FADV_DONTNEED after an fsync), leaving every other file's cached."""
    for file in _files_under(paths):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * KIB


def peak_rss_bytes() -> int:
    return _proc_status_kib("VmHWM") * KIB


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so building the state is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5\n")
        return True
    except OSError:
        return False


def tool_version(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None
