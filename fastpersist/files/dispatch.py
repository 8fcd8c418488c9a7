"""Which single-file format a save or load is for, and running it.

api.save and api.load ask here first: a file object, a torch or
safetensors file name (save), or a regular file (load, by its first bytes)
is handled in this package; anything else (None) is a checkpoint directory,
as before. A name that already is a directory stays a checkpoint directory,
whatever its suffix.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnsupportedPathError
from ..knobs import current as current_knobs
from ..storage.local_path import checkpoint_path
from ..tensors.factory import MapLocation, target_device
from ..tier.url import is_tier_url
from . import file_objects, single_safetensors, torch_file
from .kinds import SAFETENSORS_SUFFIX, TORCH_SUFFIXES, Kind, file_kind, is_file_object
from .replace import replace_atomically


def is_file_target(target: Any) -> bool:
    """Whether save(obj, target) writes a single file (else a checkpoint directory)."""
    return save_kind(target) is not None


def save_kind(target: Any) -> Kind | None:
    """The file save(obj, target) writes, or None for a checkpoint directory."""
    if is_file_object(target):
        return Kind.TORCH_ZIP
    name = os.fsdecode(os.fspath(target))
    suffix = os.path.splitext(name.rstrip("/"))[1].lower()
    if suffix not in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX) or name.endswith("/"):
        return None
    if is_tier_url(target):
        # Saved as a checkpoint, "model.pt" would become a prefix of objects
        # that no torch.load or safetensors reader expects there.
        raise UnsupportedPathError(
            f"{name} names a single file ({suffix}) in an object store, which save does not "
            "write: save a single file to a local path (or a file object) and upload it, or "
            "save a checkpoint to an s3:// prefix without a file suffix "
            "(s3://BUCKET/PREFIX/step-N)")
    if os.path.isdir(name):
        return None
    return Kind.SAFETENSORS if suffix == SAFETENSORS_SUFFIX else Kind.TORCH_ZIP


def store_file_hint(source: Any) -> str:
    """What to add to "no checkpoint at s3://..." when the URL names a single
    file (load reads checkpoints from a store, not single objects), else ""."""
    if not is_tier_url(source):
        return ""
    suffix = os.path.splitext(str(source).rstrip("/"))[1].lower()
    if suffix not in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX):
        return ""
    return (f"; if {source} is a single {suffix} object, load does not read single files "
            "from an object store: download it to a local path (or into an io.BytesIO) and "
            "load that")


def save_file(obj: Any, target: Any, *, allow_pickle: bool, options: dict[str, Any]) -> None:
    """save() to one file (or file object); `options`: save's other
    arguments, which a single file cannot take."""
    kind = save_kind(target)
    assert kind is not None, "save_file of a checkpoint directory"
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
        # (allow_pickle permits nothing here: a safetensors file holds tensors only)
        tensors = single_safetensors.stored_tensors(obj, where)
        replace_atomically(path, kind, lambda tmp: single_safetensors.write(tensors, tmp))
    else:
        torch_file.check_storable(obj, allow_pickle, where)
        replace_atomically(path, kind, lambda tmp: torch_file.write_file(obj, tmp, where))


def is_file_source(source: Any) -> bool:
    """Whether load(source) reads a single file: a file object or a regular
    file (else a checkpoint directory, an object store URL, or nothing there,
    which the directory load reports)."""
    if is_file_object(source):
        return True
    return not is_tier_url(source) and checkpoint_path(source).is_file()


def load_file(source: Any, map_location: MapLocation, *, allow_pickle: bool,
              verify: bool | None, options: dict[str, Any]) -> Any:
    """load() of a file or file object, by its first bytes (a regular file of
    no known kind: UnknownFileFormatError)."""
    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise TypeError(f"{', '.join(given)}: load of a single file (a torch.save or "
                        "safetensors file, or a file object) takes map_location, allow_pickle "
                        "and verify only")
    target_device(map_location, "cpu")  # a bad map_location fails before any I/O
    verify = current_knobs().verify_load if verify is None else verify
    if is_file_object(source):
        return file_objects.load(source, map_location, allow_pickle, verify)
    path = checkpoint_path(source)
    kind = file_kind(path)
    if kind is Kind.SAFETENSORS:
        return single_safetensors.load(path, map_location, verify, str(path))
    return torch_file.load(str(path), kind, map_location, allow_pickle, str(path))
