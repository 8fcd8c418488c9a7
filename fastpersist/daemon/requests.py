"""Request validation: what the daemon refuses, before anything is locked or touched.

Every check here is a pure function of the request: no lock, no I/O. A refusal
is a RequestError carrying the gRPC status code's name.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import errno
import json
import re
from collections.abc import Mapping
from typing import Any

from .. import knobs
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    DiskFullError,
)
from ..format import dtypes, safetensors_file
from .jobs import split_job_id

MAX_FILES = 100_000
MAX_TENSORS = 10_000_000
MAX_IN_FLIGHT_PER_CLIENT = 16
# Bounds on what a request may hold, checked before any arithmetic on it: a
# shape of 300,000 huge dimensions is a 3 MB header, and multiplying it out
# takes minutes (the cost grows with the product's digits).
MAX_HEADER_BYTES = 32 << 20
MAX_DIMS = 64
MAX_DIM = 2**63 - 1
MAX_NAME_BYTES = 64 << 10  # a tensor's name (its key path in the state)
MAX_ID_BYTES = 512  # checkpoint and job ids, nodes: what the daemon gave out is shorter
MAX_EXTRA_FILES = 8  # CommitJob's files: a format's own metadata beside the manifest
# A data chunk of a client's stream, SubmitStream's or CommitStream's (the client
# library sends 1 MiB ones; earlier ones 4 MiB).
MAX_STREAM_CHUNK = 4 << 20
# Plain names, never hidden (the daemon's marker, staging) and never in the data
# files' namespace; manifest.json is the daemon's to write. Matched whole and
# case-folded (a case-insensitive file system would take MANIFEST.JSON for it).
_EXTRA_FILE_NAME = re.compile(r"(?!data-)(?!manifest\.json\Z)[a-z0-9_][a-z0-9_.-]{0,127}")


class RequestError(Exception):
    """A request the daemon refuses; `code` is the gRPC status code's name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def shown(text: str, limit: int = 80) -> str:
    """A request's string for a message: quoted, and cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_data_file(index: int, header: bytes, data_length: int, files_total: int
                    ) -> list[safetensors_file.ParsedEntry]:
    """Check a submitted file's header against the data it comes with. Pure,
    and linear in the header's size: callers run it before taking the lock."""
    if not 0 <= index < files_total:
        raise invalid(f"file index {index} is outside 0..{files_total - 1}")
    if len(header) > MAX_HEADER_BYTES:
        raise invalid(f"data file {index}: the header is over {MAX_HEADER_BYTES} bytes")
    try:
        data_start, entries, _ = safetensors_file.parse_header(header)
    except safetensors_file.HeaderError as exc:
        raise invalid(f"data file {index}: {exc}") from None
    if data_start != len(header):
        raise invalid(f"data file {index}: the header is {len(header)} bytes but says "
                      f"{data_start}")
    if data_start % knobs.ALIGNMENT:
        raise invalid(f"data file {index}: the data section starts at {data_start}, not on a "
                      f"{knobs.ALIGNMENT}-byte boundary")
    for e in entries.values():
        _check_entry(index, e, data_length)
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in ordered:
        if e.begin != cursor:
            raise invalid(f"data file {index}: tensor {shown(e.name)} starts at {e.begin}, "
                          f"expected {cursor} (tensors must tile the data section)")
        cursor = e.end
    if cursor != data_length:
        raise invalid(f"data file {index}: the header's tensors cover {cursor} bytes, the data "
                      f"is {data_length}")
    return ordered


def _check_entry(index: int, e: safetensors_file.ParsedEntry, data_length: int) -> None:
    """One tensor: bounded sizes first, then its shape against its bytes."""
    what = f"data file {index}: tensor {shown(e.name)}"
    if len(e.name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise invalid(f"{what}: the name is over {MAX_NAME_BYTES} bytes")
    if len(e.shape) > MAX_DIMS:
        raise invalid(f"{what} has more than {MAX_DIMS} dimensions")
    if any(not 0 <= d <= MAX_DIM for d in e.shape):
        raise invalid(f"{what} has a dimension outside 0..2**63-1")
    if not 0 <= e.begin <= e.end <= data_length:
        raise invalid(f"{what} lies outside the {data_length}-byte data section")
    # The product stops growing past the data's length: every number stays small.
    want = dtypes.itemsize(e.dtype) if 0 not in e.shape else 0
    for d in e.shape:
        want *= d
        if want > data_length:
            raise invalid(f"{what}: its shape and dtype need more bytes than the data holds")
    if e.end - e.begin != want:
        raise invalid(f"{what} spans {e.end - e.begin} bytes, its shape and dtype need {want}")


def check_names(names: list[str]) -> None:
    """tensor_order of a Commit."""
    if len(names) > MAX_TENSORS:
        raise invalid(f"tensor_order has more than {MAX_TENSORS} names")
    if any(len(n) > MAX_NAME_BYTES for n in names):
        raise invalid(f"a name in tensor_order is over {MAX_NAME_BYTES} characters")


def check_extra_files(files: Mapping[str, bytes]) -> None:
    """CommitJob's files: few, each a plain new name (their sizes are bounded
    by the message's)."""
    if len(files) > MAX_EXTRA_FILES:
        raise invalid(f"a job commit carries at most {MAX_EXTRA_FILES} files, not {len(files)}")
    for name in files:
        if not _EXTRA_FILE_NAME.fullmatch(name.casefold()):
            raise invalid(f"a job commit cannot write a file named {shown(name)}: a file "
                          "beside the manifest has a plain name (letters, digits, '_', '.', "
                          "'-'; not hidden, not data-*, not manifest.json)")


def check_id(ident: str, what: str = "checkpoint") -> None:
    if len(ident) > MAX_ID_BYTES:
        raise RequestError("NOT_FOUND", f"no {what} with an id of {len(ident)} characters")


def parse_tree(tree_json: str) -> Any:
    try:
        # NaN and Infinity are not JSON (the manifest is written strictly).
        return json.loads(tree_json, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"tree_json is not valid JSON: {exc}") from None


def split_job(job_id: str) -> tuple[str, str]:
    if len(job_id) > MAX_ID_BYTES:
        raise invalid(f"a job id is at most {MAX_ID_BYTES} characters")
    try:
        return split_job_id(job_id)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def check_client(client: str) -> None:
    if not client or len(client) > 256:
        raise invalid("client_id must be 1..256 characters")


def check_compression(compression: str, frame_bytes: int) -> int:
    """Begin's compression and frame size: the frame size to pack files in
    (0: no compression; a frame_bytes of 0 takes the daemon's own knob). Also
    refuses compression where the daemon cannot do it (no numpy or zstandard)."""
    if compression == "":
        return 0
    if compression != "zstd":
        raise invalid(f"compression must be \"zstd\" or \"\", not {shown(compression)}")
    try:
        from ..codec import packing  # noqa: F401  (numpy, zstandard)
    except ImportError as exc:
        raise RequestError("FAILED_PRECONDITION", f"fastpersistd cannot compress: {exc}; "
                           "install numpy and zstandard where it runs, or save without "
                           "compression") from None
    if frame_bytes == 0:
        return knobs.current().frame_bytes
    if frame_bytes % knobs.ALIGNMENT or frame_bytes > knobs.MAX_FRAME_BYTES:
        raise invalid(f"frame_bytes {frame_bytes} must be a positive multiple of "
                      f"{knobs.ALIGNMENT} and at most {knobs.MAX_FRAME_BYTES}")
    return frame_bytes


def check_file_count(file_count: int) -> None:
    if not 0 <= file_count <= MAX_FILES:
        raise invalid(f"file_count {file_count} is outside 0..{MAX_FILES}")


def code_for(exc: CheckpointError) -> str:
    """The gRPC status code's name for a CheckpointError met serving a request.
    INTERNAL is kept for the daemon's own bugs: an error of the file system
    (a directory that vanished or was replaced while the request ran, a
    failing disk) is the state of the system the request met."""
    if isinstance(exc, CheckpointExistsError):
        return "ALREADY_EXISTS"
    if isinstance(exc, CheckpointPermissionError):
        return "PERMISSION_DENIED"
    if isinstance(exc, DiskFullError):
        return "RESOURCE_EXHAUSTED"
    if isinstance(exc, CheckpointNotFoundError):
        return "NOT_FOUND"
    if getattr(exc, "errno", None) in (errno.ENAMETOOLONG, errno.EINVAL):
        return "INVALID_ARGUMENT"
    return "FAILED_PRECONDITION"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def check_durability(durability: str, job_id: str, frame_bytes: int, memory_on: bool) -> bool:
    """Begin's durability: whether the checkpoint is memory-only ("memory")."""
    if not durability:
        return False
    if durability != "memory":
        raise invalid(f"durability must be \"memory\" or \"\" (disk), not {shown(durability)}")
    if not memory_on:
        raise RequestError("FAILED_PRECONDITION",
                           "a memory-only checkpoint is kept in fastpersistd's memory tier, "
                           "which is off: start fastpersistd with --memory-tier-count N "
                           "(and --memory-tier-bytes), or save to disk")
    if job_id:
        raise invalid("a part of a distributed job cannot be memory-only")
    if frame_bytes:
        raise invalid("a memory-only checkpoint is kept raw: save it without compression")
    return True
