"""Builds the C engine; everything else about the package is in pyproject.toml.

The extension needs only a C compiler, the Python headers and the Linux kernel
headers. It is never compiled against torch.
"""

import os

from setuptools import Extension, setup

# In layer order, lowest first (csrc/fp_internal.h; tests/test_c_layout.py).
SOURCES = ["fp_crc32c.c", "fp_util.c", "fp_fault.c", "fp_piece.c", "fp_ring.c", "fp_write_job.c",
           "fp_read_job.c", "fp_pool.c", "fp_uring.c", "fp_write.c", "fp_read.c", "fp_dir.c",
           "fp_gather.c", "fp_module.c"]
CODEC_SOURCES = ["fpc_planes.c", "fpc_zstd_literals.c", "fpc_module.c"]
FORMAT_SOURCES = ["fpf_records.c", "fpf_header.c", "fpf_module.c"]

# FASTPERSIST_SANITIZE=1 builds with ASan/UBSan for the sanitizer CI job.
extra_compile = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-fvisibility=hidden"]
extra_link = ["-pthread"]
if os.environ.get("FASTPERSIST_SANITIZE"):
    extra_compile += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    extra_link += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "fastpersist._engine",
            sources=[os.path.join("csrc", s) for s in SOURCES],
            depends=[os.path.join("csrc", h) for h in ("fp_engine.h", "fp_internal.h")],
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
        ),
        # The codec's core: byte planes and literals-only zstd frames (csrc/codec/fpc.h).
        # -O3: its loops are the ones worth vectorizing.
        Extension(
            "fastpersist._codec",
            sources=[os.path.join("csrc", "codec", s) for s in CODEC_SOURCES],
            depends=[os.path.join("csrc", "codec", "fpc.h")],
            extra_compile_args=[*extra_compile, "-O3"],
            extra_link_args=extra_link,
        ),
        # The format's per-tensor loops (csrc/format/fpf.h): manifest records, headers.
        Extension(
            "fastpersist._format",
            sources=[os.path.join("csrc", "format", s) for s in FORMAT_SOURCES],
            depends=[os.path.join("csrc", "format", "fpf.h")],
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
        ),
    ]
)
