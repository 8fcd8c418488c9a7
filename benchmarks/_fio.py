"""The disk's ceiling, measured with fio in the same directory and the same run as the methods."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# One file per shape; with numjobs > 1 each job takes its own contiguous slice of it.
ALIGN = 16 * 2**20  # keeps every job's slice a whole number of the largest block


@dataclass(frozen=True)
class FioShape:
    rw: str  # write | read
    bs: str
    iodepth: int
    numjobs: int
    direct: bool

    @property
    def label(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return f"fio {self.rw} {mode} bs={self.bs} qd={self.iodepth} jobs={self.numjobs}"

    @property
    def engine(self) -> str:
        # libaio is only asynchronous with O_DIRECT; buffered I/O goes through psync.
        return "libaio" if self.direct else "psync"


# The write ceiling is the best of these, as the design asks: sequential O_DIRECT.
WRITE_SHAPES = (
    FioShape("write", "1M", 8, 1, True),
    FioShape("write", "8M", 8, 1, True),
    FioShape("write", "8M", 8, 2, True),
    FioShape("write", "1M", 32, 2, True),
)

# Reads on virtual disks do not follow O_DIRECT intuition (a cold buffered read with the
# kernel's readahead can beat it), so the read ceiling also tries buffered shapes.
READ_SHAPES = (
    FioShape("read", "1M", 16, 1, True),
    FioShape("read", "8M", 8, 1, True),
    FioShape("read", "8M", 8, 2, True),
    FioShape("read", "1M", 32, 2, True),
    FioShape("read", "1M", 1, 1, False),
    FioShape("read", "1M", 1, 2, False),
)


@dataclass(frozen=True)
class FioResult:
    nbytes: int
    seconds: float


def available() -> str | None:
    """None if fio can run, else why not."""
    if shutil.which("fio") is None:
        return "fio not found (apt-get install -y fio libaio-dev)"
    return None


def fio_size(state_bytes: int) -> int:
    return max(ALIGN, state_bytes // ALIGN * ALIGN)


def run(shape: FioShape, filename: Path, size: int) -> FioResult:
    """Run one fio job group and return bytes moved and fio's own run time.

    fio's runtime covers the I/O and, for writes, the end_fsync, but not fio's ~0.3 s of
    process start-up, which the Python methods do not pay inside their timed region either.
    """
    per_job = size // shape.numjobs
    cmd = [
        "fio",
        "--name=fastpersist-bench",
        f"--filename={filename}",
        f"--rw={shape.rw}",
        f"--bs={shape.bs}",
        f"--direct={int(shape.direct)}",
        f"--ioengine={shape.engine}",
        f"--iodepth={shape.iodepth}",
        f"--numjobs={shape.numjobs}",
        f"--size={per_job}",
        f"--offset_increment={per_job}",
        "--group_reporting",
        "--output-format=json",
    ]
    if shape.rw == "write":
        cmd.append("--end_fsync=1")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    # fio may print warnings before the JSON document.
    report = json.loads(done.stdout[done.stdout.index("{") :])
    job = report["jobs"][0][shape.rw]
    if job["runtime"] <= 0:
        raise RuntimeError(f"fio reported no run time: {cmd}")
    return FioResult(nbytes=int(job["io_bytes"]), seconds=job["runtime"] / 1000.0)
