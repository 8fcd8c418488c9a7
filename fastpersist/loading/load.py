"""One load over any Source, and the one place that chooses the source.

load_from does what a load does wherever the bytes are, once: the pickle
policy (refused before a tensor byte is read), pairing into= with the
checkpoint, rebuilding a distributed checkpoint's tensors (like=,
resharding), streaming to an accelerator where the source can, and
decoding the tree. The Source reads and verifies the bytes: a local
directory, the object store, or a chain of a checkpoint's copies
(chain.py: the daemon's memory, the disk, peers, the store, in the order
copies.py gives them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .. import gcpause
from ..format.manifest import Manifest
from ..knobs import current as current_knobs
from ..storage.local_path import checkpoint_path
from ..tensors import device_load, state
from ..tensors import into as into_state
from ..tensors.factory import MapLocation, SomeEntries, TensorFactory, target_device
from ..tensors.source import LocalSource, Source
from ..tier.url import is_tier_url
from .chain import Chain
from .copies import copies_for


def source_for(path: str | os.PathLike[str], endpoint_url: str | None = None,
               daemon: str | None = None, tier: str | None = None) -> Source:
    """Where the checkpoint at `path` is read from: an object store for
    "s3://BUCKET/PREFIX/NAME" (endpoint_url overrides the standard AWS
    configuration's endpoint); else its copies, fastest first
    (copies.py): the memory of fastpersistd at `daemon` (None:
    FASTPERSIST_DAEMON, if set; "": none), the local directory, peers,
    the object store (`tier`: the checkpoint's URL there; else the
    daemon's tier), each read while it holds up (chain.py). Without a
    daemon or a tier, the local directory alone."""
    if is_tier_url(path):
        from ..tensors.tier_read import TierSource
        from ..tier.client import client_for
        from ..tier.url import TierURL

        return TierSource(client_for(endpoint_url), TierURL.parse(str(path)))
    local = checkpoint_path(path)
    address = current_knobs().daemon if daemon is None else daemon
    copies = copies_for(local, daemon=address or "", tier=tier, endpoint_url=endpoint_url)
    if len(copies) == 1:
        return LocalSource(local)
    return Chain(str(local), copies)


def load_from(source: Source, map_location: MapLocation = None, *, allow_pickle: bool = False,
              verify: bool | None = None, progress: Callable[[int], None] | None = None,
              like: Any = None, into: Any = None) -> Any:
    """fastpersist.load of the checkpoint in `source` (api.load says what
    each argument does)."""
    if into is not None and like is not None:
        raise TypeError("pass into= (tensors to load into) or like= (a layout to load "
                        "as), not both")
    target_device(map_location, "cpu")  # a bad map_location fails before any I/O
    with gcpause.paused():  # a manifest of many tensors makes many objects, no cycles
        return _load(source, map_location, allow_pickle,
                     current_knobs().verify_load if verify is None else verify,
                     progress, like, into)


def _load(source: Source, map_location: MapLocation, allow_pickle: bool, verify: bool,
          progress: Callable[[int], None] | None, like: Any, into: Any) -> Any:
    manifest = source.manifest()
    where = source.where
    # into= and like= read and return only the part of the tree they name.
    names = into if into is not None else like
    tree = manifest.tree if names is None else into_state.restrict(manifest.tree, names)
    pickled = state.contains_pickle(tree)
    if pickled and not allow_pickle:
        # Fail before reading gigabytes of tensors.
        state.decode(tree, lambda node: torch.empty(0), where=where)
    placement = _placement(manifest, tree, into, where)
    if manifest.globals is not None:
        from ..distributed import restore

        return restore.load(source, replace(manifest, tree=tree), map_location, like,
                            allow_pickle=allow_pickle, verify=verify, progress=progress,
                            place=placement.factory if placement else None)
    needed = into_state.entries_in(tree) if names is not None else None
    if needed is not None and len(needed) == len(manifest.tensors):
        needed = None
    wanted = manifest if needed is None else replace(
        manifest, tensors=tuple(manifest.tensors[e] for e in needed),
        files=tuple(f for f in manifest.files if f.name in {manifest.tensors[e].file
                                                              for e in needed}))
    read: list[torch.Tensor] | None = None
    ring_bytes = current_knobs().load_ring_bytes
    ring = device_load.enabled(map_location, wanted, ring_bytes)
    if ring is not None:  # straight to the accelerator, through bounded host memory
        read = source.read_to_device(
            wanted, ring, verify=verify, ring_bytes=ring_bytes, progress=progress,
            into=_renumber(placement.choose_direct(manifest.tensors, ring), needed)
            if placement else None)
    if read is None:
        direct = (placement.choose_direct(manifest.tensors, torch.device("cpu"))
                  if placement else {})
        read = source.read_tensors(wanted, verify=verify, progress=progress,
                                   into=_renumber(direct, needed))
    entries = read if needed is None else SomeEntries(
        len(manifest.tensors), dict(zip(needed, read, strict=True)), where)
    factory = TensorFactory(entries, map_location, where)
    # Without pickle nodes allow_pickle changes nothing; True spares decode its own
    # search of the tree for them (contains_pickle looks wherever decode would).
    return state.decode(tree, placement.factory(factory) if placement else factory,
                        allow_pickle=allow_pickle or not pickled, where=where)


def _renumber(by_entry: dict[int, torch.Tensor], needed: list[int] | None
              ) -> dict[int, torch.Tensor]:
    """Entry -> tensor, numbered as the records of a read of `needed` only."""
    if needed is None:
        return by_entry
    at = {e: i for i, e in enumerate(needed)}
    return {at[e]: t for e, t in by_entry.items()}


def _placement(manifest: Manifest, tree: Any, into: Any, where: str
               ) -> into_state.Placement | None:
    if into is None:
        return None
    shapes = ([g.shape for g in manifest.globals] if manifest.globals is not None
              else [r.shape for r in manifest.tensors])
    return into_state.match(tree, into, shapes, where)


__all__ = ["load_from", "source_for"]
