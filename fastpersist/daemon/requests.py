"""Request validation: what the daemon refuses, before anything is locked or touched.

Every check here is a pure function of the request: no lock, no I/O. A refusal
is a RequestError carrying the gRPC status code's name.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .. import knobs
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointPermissionError,
    DiskFullError,
)
from ..format import dtypes, safetensors_file
from .jobs import split_job_id

MAX_FILES = 100_000
MAX_TENSORS = 10_000_000
MAX_IN_FLIGHT_PER_CLIENT = 16


class RequestError(Exception):
    """A request the daemon refuses; `code` is the gRPC status code's name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def parse_data_file(index: int, header: bytes, data_length: int, files_total: int
                    ) -> list[safetensors_file.ParsedEntry]:
    """Check a submitted file's header against the data it comes with."""
    if not 0 <= index < files_total:
        raise invalid(f"file index {index} is outside 0..{files_total - 1}")
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
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in ordered:
        want = math.prod(e.shape) * dtypes.itemsize(e.dtype)
        if e.end - e.begin != want:
            raise invalid(f"data file {index}: tensor {e.name!r} spans {e.end - e.begin} bytes, "
                          f"its shape and dtype need {want}")
        if e.begin != cursor:
            raise invalid(f"data file {index}: tensor {e.name!r} starts at {e.begin}, expected "
                          f"{cursor} (tensors must tile the data section)")
        cursor = e.end
    if cursor != data_length:
        raise invalid(f"data file {index}: the header's tensors cover {cursor} bytes, the data "
                      f"is {data_length}")
    return ordered


def parse_tree(tree_json: str) -> Any:
    try:
        # NaN and Infinity are not JSON (the manifest is written strictly).
        return json.loads(tree_json, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"tree_json is not valid JSON: {exc}") from None


def split_job(job_id: str) -> tuple[str, str]:
    try:
        return split_job_id(job_id)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def check_client(client: str) -> None:
    if not client or len(client) > 256:
        raise invalid("client_id must be 1..256 characters")


def check_file_count(file_count: int) -> None:
    if not 0 <= file_count <= MAX_FILES:
        raise invalid(f"file_count {file_count} is outside 0..{MAX_FILES}")


def code_for(exc: CheckpointError) -> str:
    """The gRPC status code's name for a CheckpointError met serving a request."""
    if isinstance(exc, CheckpointExistsError):
        return "ALREADY_EXISTS"
    if isinstance(exc, CheckpointPermissionError):
        return "PERMISSION_DENIED"
    if isinstance(exc, DiskFullError):
        return "RESOURCE_EXHAUSTED"
    return "INTERNAL"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
