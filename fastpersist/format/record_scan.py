"""A manifest's tensor records, read by the C scanner when they are spelled
as fastpersist writes them.

Manifest.to_json writes one raw record a line, keys in one order, compact
separators. For such a "tensors" array, Scan cuts it out of the text (the
rest, with a one-off marker in its place, goes to the general JSON parser:
files, tree, globals), and records() parses and checks it in C
(csrc/format/fpf_records.c) with every check of records.parse_tensors. With
100,000 small tensors that took a manifest's parse from 0.66 s to ~0.2 s
here (python benchmarks/save_load.py --tensors 100000).

Anything else, a spelling the writer does not make, a compressed record, any
record the checks refuse, or no C extension, makes records() return None, and
the caller parses the whole manifest the general way, which decides what it
means and words its errors. The scanner is a shortcut, never a second opinion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import dtypes
from .bounds import CRC_MAX, MAX_DIMS, MAX_ELEMENTS, MAX_FILE_BYTES
from .frames import RAW
from .records import FileRecord, TensorRecord

try:
    from .. import _format
except ImportError:  # no C extension: every manifest is parsed the general way
    _format = None  # type: ignore[assignment]

_KEY = b'\n "tensors": '
_OPEN = _KEY + b"[\n  {"
_CLOSE = b"\n ]"
_LIMITS = (MAX_DIMS, MAX_ELEMENTS, MAX_FILE_BYTES, CRC_MAX)


@dataclass(frozen=True)
class Scan:
    """A manifest's text with its "tensors" array cut out (`rest`, the array's
    place holding the JSON string `marker`) and where the array's records lie."""

    text: bytes
    start: int  # the first record's "{"
    stop: int  # just after the last record's "}"
    rest: bytes
    marker: str

    @staticmethod
    def of(text: bytes) -> Scan | None:
        """The cut, or None where the text has no array of the usual spelling.

        The marker is random, so no manifest can hold it: a rest whose top-level
        "tensors" is the marker is one whose array was the one cut out (a
        "tensors" array inside the tree holds something else there)."""
        if _format is None:
            return None
        opened = text.find(_OPEN)
        if opened < 0:
            return None
        start = opened + len(_OPEN) - 1
        stop = text.find(_CLOSE, start)  # (no newline can be inside a JSON string)
        if stop < 0:
            return None
        marker = "fastpersist-records-" + os.urandom(16).hex()
        rest = b"".join((text[:opened + len(_KEY)], b'"', marker.encode(), b'"',
                         text[stop + len(_CLOSE):]))
        return Scan(text, start, stop, rest, marker)

    def records(self, files: dict[str, FileRecord]) -> list[TensorRecord] | None:
        """The array's records, each checked alone and against the others as
        records.parse_tensors checks them, or None (parse the general way)."""
        assert _format is not None  # (Scan.of made no scan without it)
        entries = {name: (i, f.data_start, f.size) for i, (name, f) in enumerate(files.items())}
        return _format.scan_records(self.text, self.start, self.stop, entries, dtypes.ITEMSIZES,
                                  TensorRecord, RAW, _LIMITS)
