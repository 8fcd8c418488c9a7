"""Which single-file format a save or load is for, and running it.

api.save and api.load ask here first: a file object, a torch or
safetensors file name (save), or a regular file (load, by its first bytes)
is handled in this package; anything else (None) is a checkpoint directory,
as before. A name that already is a directory stays a checkpoint directory,
whatever its suffix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..storage.local_path import checkpoint_path
from ..tensors.factory import MapLocation, target_device
from ..tier.url import is_tier_url
from . import file_objects, single_safetensors, torch_file
from .kinds import SAFETENSORS_SUFFIX, TORCH_SUFFIXES, Kind, file_kind, is_file_object
from .replace import replace_atomically


def save_kind(target: Any) -> Kind | None:
    """The file save(obj, target) writes, or None for a checkpoint directory."""
    if is_file_object(target):
        return Kind.TORCH_ZIP
    if is_tier_url(target):
        return None
    name = os.fsdecode(os.fspath(target))
    suffix = os.path.splitext(name.rstrip("/"))[1].lower()
    if suffix not in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX) or name.endswith("/") or \
            os.path.isdir(name):
        return None
    return Kind.SAFETENSORS if suffix == SAFETENSORS_SUFFIX else Kind.TORCH_ZIP


def save_file(obj: Any, target: Any, kind: Kind, *, allow_pickle: bool,
              options: dict[str, Any]) -> None:
    """save() to one file (or file object); `options`: save's other
    arguments, which a single file cannot take."""
    given = sorted(k for k, v in options.items() if v)
    if given:
        raise TypeError(f"{', '.join(given)}: not for a single file (a file object or a "
                        f"{'/'.join(TORCH_SUFFIXES)}/{SAFETENSORS_SUFFIX} name); save to a "
                        "checkpoint directory for those")
    if is_file_object(target):
        file_objects.save(obj, target, allow_pickle)
        return
    path = checkpoint_path(target, "a file")
    where = str(path)
    if kind is Kind.SAFETENSORS:
        if allow_pickle:
            raise TypeError(f"{where}: a .safetensors file holds no pickled values; "
                            "allow_pickle=True is for .pt names and directories")
        tensors = single_safetensors.stored_tensors(obj, where)
        replace_atomically(path, kind, lambda tmp: single_safetensors.write(tensors, tmp))
    else:
        torch_file.check_storable(obj, allow_pickle, where)
        replace_atomically(path, kind, lambda tmp: torch_file.write_file(obj, tmp, where))


def load_kind(source: Any) -> Kind | None:
    """What load(source) reads: a file's kind, None for a checkpoint
    directory (or an object store URL, or nothing: the directory load says
    so). UnknownFileFormatError for a file of no known kind."""
    if is_file_object(source) or is_tier_url(source):
        return None
    path = checkpoint_path(source)
    if not path.is_file():
        return None
    return file_kind(path)


def load_file(source: Any, kind: Kind | None, map_location: MapLocation, *,
              allow_pickle: bool, verify: bool, options: dict[str, Any]) -> Any:
    """load() of a file or file object (kind None: a file object)."""
    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise TypeError(f"{', '.join(given)}: load of a single file (a torch.save or "
                        "safetensors file, or a file object) takes map_location, allow_pickle "
                        "and verify only")
    target_device(map_location, "cpu")  # a bad map_location fails before any I/O
    if is_file_object(source):
        return file_objects.load(source, map_location, allow_pickle, verify)
    assert kind is not None
    path = Path(checkpoint_path(source))
    if kind is Kind.SAFETENSORS:
        return single_safetensors.load(path, map_location, verify, str(path))
    return torch_file.load(str(path), kind, map_location, allow_pickle, str(path))
