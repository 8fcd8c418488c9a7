"""torch.save's own format, for `.pt`/`.pth`/`.bin` names and file objects.

Loading follows torch.load: weights_only=True (torch's allowlist of
tensors, containers, numbers, strings, dtypes, devices, sizes) unless the
caller passes allow_pickle=True, and map_location goes straight to
torch.load (a device, a dict, or a callable). Saving writes with torch.save,
after checking that what is saved needs no pickle to load back (unless
allow_pickle=True), so that a file fastpersist wrote loads with
weights_only=True: a value that would need pickle (an object, a numpy
array, which torch pickles) is refused before anything is written.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from ..errors import (
    CheckpointError,
    CheckpointIOError,
    CorruptCheckpointError,
    PickleNotAllowedError,
    TruncatedFileError,
    UnsupportedValueError,
)
from ..storage.commit import os_error
from ..tensors import state
from ..tensors.factory import MapLocation
from .kinds import Kind

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_OPERAND = re.compile(r"Unsupported operand (\d+)")
# torch's words for a file that ends early (zip: no central directory; the
# legacy format: an unpickler's EOF).
_TRUNCATED = ("central directory", "unexpected EOF", "Ran out of input", "truncated",
              "failed reading file")


def check_storable(obj: Any, allow_pickle: bool, where: str) -> None:
    """UnsupportedValueError, naming the value's path, for anything in `obj`
    that torch.load(weights_only=True) would refuse."""
    if allow_pickle:
        return
    try:
        tree, _ = state.encode(obj)  # refuses objects that need pickle, naming them
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"{where}: {exc}") from None
    for node in state.tree_nodes(tree):
        if node.get("t") == "tensor" and "np" in node:
            raise UnsupportedValueError(
                f"{where}: a numpy value in the state needs pickle in a torch.save file (torch "
                "pickles numpy arrays, and torch.load(weights_only=True) refuses them); save it "
                "as a tensor, save to a checkpoint directory or a .safetensors name instead, "
                "or pass allow_pickle=True")


def save(obj: Any, out: str | IO[bytes], allow_pickle: bool, where: str) -> None:
    """torch.save(obj, out) after check_storable."""
    check_storable(obj, allow_pickle, where)
    torch.save(obj, out)


def write_file(obj: Any, path: Path, where: str) -> None:
    """torch.save(obj) into a new file at `path` (checked already), through a
    Python file object: torch's own file writer turns a failed write (a full
    disk) into a RuntimeError without its errno, Python's file keeps the OSError."""
    with open(path, "xb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            cause = exc.__cause__ or exc.__context__
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                raise cause from None
            raise CheckpointIOError(errno.EIO, f"{where}: torch.save failed: {exc}") from exc


def load(src: str | IO[bytes], kind: Kind, map_location: MapLocation, allow_pickle: bool,
         where: str) -> Any:
    """torch.load of a torch.save file or stream, its failures as CheckpointErrors
    that name `where`."""
    if kind is Kind.TORCH_ZIP:
        _check_zip_end(src, kind, where)
    try:
        return torch.load(src, map_location=map_location,  # type: ignore[arg-type]
                          weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        names = sorted(set(_GLOBAL.findall(text)))
        if any(_missing(n) for n in names):  # a name cut short: a truncated file
            raise _corrupt(where, kind, EOFError(f"it names {', '.join(names)}, which does "
                                                 "not exist")) from None
        if not allow_pickle and ("Unsupported" in text or "WeightsUnpickler" in text):
            operand = _OPERAND.search(text)
            holds = (f"pickled objects ({', '.join(names)})" if names else
                     f"pickle opcode {operand.group(1)} (a pickle protocol above 2)"
                     if operand else "pickled objects")
            raise PickleNotAllowedError(
                f"{where}: {kind.value} that holds {holds}, which torch.load(weights_only=True) "
                "refuses; unpickling can run arbitrary code, so pass allow_pickle=True only if "
                "you trust the file") from None
        raise _corrupt(where, kind, exc) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, IndexError,
            struct.error) as exc:  # (the last two: torch's unpickler at a cut end)
        text = str(exc).split("\n")[0]
        if isinstance(exc, RuntimeError) and "device" in text.lower():
            # A place this process has no device for: the file is fine.
            raise CheckpointError(f"{where}: cannot place its tensors ({text}); pass "
                                  "map_location='cpu' (or another device) to load") from None
        raise _corrupt(where, kind, exc) from None
    except TypeError as exc:
        if not callable(map_location):
            raise
        # torch rebuilds each storage from what the callable returned, and says
        # only that its arguments did not fit (as factory.placed reports it).
        text = str(exc).split("\n")[0]
        raise CheckpointError(f"{where}: map_location(storage, location) failed for a "
                              f"tensor: {text} (it must return the storage it was given, a "
                              "copy of it on some device, or None)") from exc
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # torch's zip reader seeking past a cut end
            raise _corrupt(where, kind, exc) from None
        raise os_error(exc, f"cannot read {where}") from None


# A zip archive ends with its central directory's end record: the 4 bytes
# below, then 18 bytes and a comment of at most 65,535 bytes.
_ZIP_END = b"PK\x05\x06"
_ZIP_TAIL = 22 + 65535


def _check_zip_end(src: str | IO[bytes], kind: Kind, where: str) -> None:
    """TruncatedFileError for a zip without its end record (a file cut short,
    which torch's reader reports as a seek error or a miniz message)."""
    f = open(src, "rb") if isinstance(src, str) else src  # noqa: SIM115
    try:
        start = f.tell()
        size = f.seek(0, os.SEEK_END) - start
        f.seek(start + max(0, size - _ZIP_TAIL))
        tail = f.read()
        f.seek(start)
    finally:
        if isinstance(src, str):
            f.close()
    if _ZIP_END not in tail:
        raise TruncatedFileError(f"{where}: {kind.value} that is truncated or corrupt (its zip "
                                 "archive has no end record)")


def _missing(name: str) -> bool:
    """Whether `name` (module.attribute) is certainly not a real global: its
    module is imported and lacks it. Modules not imported are not imported here
    (that could run code from a name in the file)."""
    module, _, attr = name.rpartition(".")
    if not module or not attr:  # a GLOBAL always names both
        return True
    loaded = sys.modules.get(module)
    return loaded is not None and not hasattr(loaded, attr)


def _corrupt(where: str, kind: Kind, exc: BaseException) -> CorruptCheckpointError:
    text = str(exc).split("\n")[0][:300]
    if isinstance(exc, EOFError) or any(t in text for t in _TRUNCATED):
        return TruncatedFileError(f"{where}: {kind.value} that is truncated or corrupt ({text})")
    return CorruptCheckpointError(f"{where}: {kind.value} that torch.load cannot read ({text})")
