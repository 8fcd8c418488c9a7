"""Tensors from a checkpoint's entries, as load gives them back: on the
device asked for (map_location), as views, parameters, tied where they were.

Shared by fastpersist.load (api.py) and distributed loads (distributed/restore.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import CheckpointError, ManifestError
from ..format import dtypes

# torch.load's callable map_location: called with each tensor's storage as read
# (on the CPU) and the device it was saved from ("cuda:0"); returns the storage
# to use, or None for the saved device.
StorageMap = Callable[[torch.UntypedStorage, str], Any]
MapLocation = None | str | torch.device | Mapping[str, str] | StorageMap
# What decode calls for each tensor node (a TensorFactory, or a wrapper of one).
Factory = Callable[[dict[str, Any]], torch.Tensor]


def target_device(map_location: MapLocation, saved: str) -> str:
    """The device a tensor saved from `saved` loads onto; TypeError for a bad
    map_location."""
    if map_location is None:
        return saved
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, Mapping):
        return str(map_location.get(saved, saved))
    if callable(map_location):
        return saved  # the callable places it (TensorFactory.placed)
    raise TypeError(
        "map_location must be None, a device (str or torch.device), a dict mapping saved "
        "devices to devices, or a callable (storage, location) -> storage, not "
        f"{type(map_location).__name__}"
    )


def placed(t: torch.Tensor, storage_map: StorageMap, saved: str, where: str) -> torch.Tensor:
    """`t` (a CPU tensor as read) where torch.load's callable map_location puts
    it: storage_map(storage, saved) returns a storage (on any device) that
    the tensor is rebuilt on, or None for torch's default, the saved device."""
    if t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()  # the callable sees exactly this tensor's bytes, as torch's does
    try:
        result = storage_map(t.untyped_storage(), saved)
        if result is None:
            return t.to(saved)
        if isinstance(result, torch.TypedStorage):
            result = result.untyped()  # type: ignore[no-untyped-call]
        if not isinstance(result, torch.UntypedStorage) or result.nbytes() != t.nbytes:
            raise TypeError(f"it returned {type(result).__name__}, not the storage it was "
                            f"given (or a copy of it: an UntypedStorage of {t.nbytes} bytes)")
        return torch.empty(0, dtype=t.dtype, device=result.device).set_(
            result, 0, t.shape, t.stride())
    except (RuntimeError, AssertionError, TypeError) as exc:
        raise CheckpointError(f"{where}: map_location(storage, {saved!r}) failed for a "
                              f"tensor: {exc}") from exc
class SomeEntries(Sequence[torch.Tensor]):
    """A TensorFactory's entries where only some were read (a load's into=
    or like= part, one tensor of fastpersist.open): entry -> tensor. The
    tree's nodes refer only to those; any other is a ManifestError."""

    def __init__(self, n: int, read: Mapping[int, torch.Tensor], where: str) -> None:
        self._n, self._read, self._where = n, read, where

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, e: Any) -> Any:
        t = self._read.get(e)
        if t is None:
            raise ManifestError(f"{self._where}: tensor node refers to entry {e!r}, "
                                "which was not read")
        return t


class TensorFactory:
    """Builds each tensor node's tensor from the loaded entries.

    Nodes with the same entry, view and device get the same object, so tied
    weights stay tied; views of one entry share its storage.
    """

    def __init__(self, entries: Sequence[torch.Tensor], map_location: MapLocation,
                 where: str) -> None:
        self.entries = entries
        self.map_location = map_location
        self.where = where
        self.moved: dict[tuple[int, str], torch.Tensor] = {}
        self.made: dict[Any, torch.Tensor] = {}
        self._plain_device = target_device(map_location, "cpu")  # of a {"t", "e"} node
        self._storage_map = None if map_location is None or isinstance(
            map_location, (str, torch.device, Mapping)) else map_location

    def _plain(self, index: Any) -> torch.Tensor:
        """The tensor of a node that is only {"t": "tensor", "e": index}."""
        if type(index) is not int or not 0 <= index < len(self.entries):
            raise ManifestError(f"{self.where}: tensor node refers to entry {index!r}")
        device = self._plain_device
        entry = self.entries[index]
        if device == "cpu" == entry.device.type and self._storage_map is None:
            # The entry itself, as __call__ would give it (.to of a CPU tensor to the
            # CPU is the tensor): the same object for every node of this entry.
            return entry
        key = (index, device, "None", None, None)  # as __call__ makes it
        t = self.made.get(key)
        if t is None:
            t = self.made[key] = self._entry_on(index, device, viewed=False)
        return t

    def _entry_on(self, index: int, device: str, viewed: bool,
                  mapped: bool = True) -> torch.Tensor:
        storage_map = self._storage_map if mapped else None
        key = (index, device if storage_map is None else "map:" + device)
        if key not in self.moved:
            try:
                t = (self.entries[index].to(device) if storage_map is None else
                     placed(self.entries[index], storage_map, device, self.where))
            except (RuntimeError, AssertionError) as exc:
                raise CheckpointError(
                    f"{self.where}: cannot place a tensor on {device!r} ({exc}); pass "
                    "map_location='cpu' (or another device) to load"
                ) from exc
            # A reader may hand over an entry that lies inside a larger
            # allocation (device_load shares one among small tensors). Views
            # count their offsets from the entry's first byte, which must sit
            # on a 16-byte boundary for every element size: copy it if not.
            # (An entry with views is only ever used through views.)
            if viewed and t.storage_offset() * t.element_size() % 16:
                t = t.clone()
            self.moved[key] = t
        return self.moved[key]

    def __call__(self, node: dict[str, Any]) -> torch.Tensor:
        index = node.get("e")
        if len(node) == 2 and "t" in node:
            return self._plain(index)
        if not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise ManifestError(f"{self.where}: tensor node refers to entry {index!r}")
        # numpy values load on the CPU, whatever map_location says.
        device = "cpu" if "np" in node else target_device(self.map_location,
                                                         node.get("device", "cpu"))
        view = node.get("view")
        key = (index, device, repr(view), node.get("param"), node.get("grad"))
        if key in self.made:
            return self.made[key]
        base = self._entry_on(index, device, viewed=view is not None, mapped="np" not in node)
        t = base if view is None else self._view(base, view)
        try:
            if node.get("param"):
                t = torch.nn.Parameter(t, requires_grad=bool(node.get("grad")))
            elif node.get("grad"):
                t = t.requires_grad_(True)
        except RuntimeError as exc:  # an integer tensor marked as requiring gradients
            raise ManifestError(f"{self.where}: tensor entry {index} cannot be a parameter "
                                f"or require gradients ({exc})") from None
        self.made[key] = t
        return t

    def _view(self, base: torch.Tensor, view: Any) -> torch.Tensor:
        # The manifest's validation (format/tree.py) put the view inside its
        # entry's bytes; checked again against the storage torch holds.
        try:
            dtype = dtypes.from_name(view["dtype"])
            shape, stride, offset = list(view["shape"]), list(view["stride"]), int(view["offset"])
            extent = 0 if 0 in shape else (
                sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * dtype.itemsize
            # Offsets count from the entry's first byte, which need not be its
            # storage's (see _entry_on).
            start = base.storage_offset() * base.element_size()
            if offset % dtype.itemsize or offset < 0 or \
                    offset + extent > base.numel() * base.element_size() or any(
                s < 0 for s in stride
            ) or any(n < 0 for n in shape):
                raise ValueError("view lies outside its entry")
            return torch.empty(0, dtype=dtype, device=base.device).set_(
                base.untyped_storage(), (start + offset) // dtype.itemsize, shape, stride
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ManifestError(f"{self.where}: bad view {view!r} ({exc})") from None
