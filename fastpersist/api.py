"""fastpersist.save and fastpersist.load: drop-ins for torch.save/torch.load on state dicts."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, plan, state
from .engine import get_engine
from .errors import CheckpointError, ManifestError
from .format import dtypes
from .knobs import current as current_knobs
from .persist import CheckpointWriter
from .snapshot import group_into_files

MapLocation = None | str | torch.device | Mapping[str, str]


def save(obj: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
         daemon: str | None = None, process_group: Any = None,
         node_local: bool = False) -> None:
    """Save `obj` as a checkpoint directory at `path`.

    `obj` is what torch.save takes for checkpoints: nested dicts, OrderedDicts,
    lists and tuples of tensors, numbers, strings, None, bytes, torch dtypes,
    devices and sizes (`model.state_dict()`, `optimizer.state_dict()`), and
    numpy arrays and scalars (stored as tensors, loaded as numpy: an RNG
    state from np.random.get_state() needs no pickle). Anything else needs
    pickle and raises UnsupportedValueError unless allow_pickle=True.

    When save returns, the checkpoint is durable: data and manifest fsynced,
    the directory renamed into place and its parent fsynced. An existing
    checkpoint at `path` is replaced atomically; until then it stays intact,
    and a crash at any moment leaves either the old or the new one. Missing
    parent directories are created. Errors are CheckpointError subclasses
    (DiskFullError, CheckpointPermissionError, ...) and leave nothing behind.

    With a daemon (`daemon="unix:///PATH"` or FASTPERSIST_DAEMON; "" forces
    in-process) fastpersistd writes it from shared memory, with the same
    result on disk; `path` must lie under the daemon's --root.

    In a torch.distributed job, pass process_group (e.g. torch.distributed.group.WORLD)
    and call save on every rank of it: each unique byte of the job is written by
    exactly one rank, balanced over nodes and ranks, and rank 0 commits the
    job manifest last (fastpersist/distributed/coordinator.py). DTensors are
    saved as their global tensors. The tree's non-tensor values are taken from
    rank 0. node_local=True: each rank passes its node's local path and each
    node keeps the files its ranks wrote. With a daemon, each rank hands its
    part to its own node's daemon and the job is committed there.
    """
    address = current_knobs().daemon if daemon is None else daemon
    if process_group is not None:
        group = None if process_group == "world" else process_group
        if address:
            # Staged in shared memory, and each node's daemon writes its ranks' parts.
            from .distributed.saver import saver_for

            saver_for(group, node_local, address).save(
                obj, path, allow_pickle=allow_pickle).result()
            return
        from .distributed import coordinator

        coordinator.save(obj, path, group, node_local=node_local, allow_pickle=allow_pickle)
        return
    if node_local:
        raise ValueError("node_local=True needs process_group (a distributed save)")
    if address:
        from .remote import remote_saver

        remote_saver(address).save(obj, path, allow_pickle=allow_pickle,
                                   overlap_writes=True).result()
        return
    target = Path(os.path.abspath(os.fspath(path)))
    tree, leaves = state.encode(obj, allow_pickle=allow_pickle)
    stored = plan.plan_tensors(leaves)
    writer = CheckpointWriter.begin(target, tree, stored)
    try:
        # The same cut into data files as async and daemon saves: one layout on disk.
        for file in group_into_files(stored, 0, current_knobs().file_bytes):
            writer.write_file(file.tensors)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _target_device(map_location: MapLocation, saved: str) -> str:
    if map_location is None:
        return saved
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    if isinstance(map_location, Mapping):
        return str(map_location.get(saved, saved))
    raise TypeError(
        "map_location must be None, a device (str or torch.device) or a dict mapping saved "
        f"devices to devices, not {type(map_location).__name__}"
    )


class _TensorFactory:
    """Builds each tensor node's tensor from the loaded entries.

    Nodes with the same entry, view and device get the same object, so tied
    weights stay tied; views of one entry share its storage.
    """

    def __init__(self, entries: list[torch.Tensor], map_location: MapLocation, where: str) -> None:
        self.entries = entries
        self.map_location = map_location
        self.where = where
        self.moved: dict[tuple[int, str], torch.Tensor] = {}
        self.made: dict[Any, torch.Tensor] = {}

    def _entry_on(self, index: int, device: str) -> torch.Tensor:
        key = (index, device)
        if key not in self.moved:
            try:
                self.moved[key] = self.entries[index].to(device)
            except (RuntimeError, AssertionError) as exc:
                raise CheckpointError(
                    f"{self.where}: cannot place a tensor on {device!r} ({exc}); pass "
                    "map_location='cpu' (or another device) to load"
                ) from exc
        return self.moved[key]

    def __call__(self, node: dict[str, Any]) -> torch.Tensor:
        index = node.get("e")
        if not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise ManifestError(f"{self.where}: tensor node refers to entry {index!r}")
        # numpy values load on the CPU, whatever map_location says.
        device = "cpu" if "np" in node else _target_device(self.map_location,
                                                          node.get("device", "cpu"))
        view = node.get("view")
        key = (index, device, repr(view), node.get("param"), node.get("grad"))
        if key in self.made:
            return self.made[key]
        base = self._entry_on(index, device)
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
            storage = base.untyped_storage()
            if offset % dtype.itemsize or offset < 0 or offset + extent > storage.nbytes() or any(
                s < 0 for s in stride
            ) or any(n < 0 for n in shape):
                raise ValueError("view lies outside its storage")
            return torch.empty(0, dtype=dtype, device=base.device).set_(
                storage, offset // dtype.itemsize, shape, stride
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ManifestError(f"{self.where}: bad view {view!r} ({exc})") from None


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    *,
    allow_pickle: bool = False,
    verify: bool | None = None,
    progress: Callable[[int], None] | None = None,
    like: Any = None,
) -> Any:
    """Load the checkpoint at `path` and return an object equal to what was saved.

    Tensors go back to the device they were saved from unless `map_location`
    (a device, or a dict from saved device to device, as in torch.load) says
    otherwise. Every tensor's CRC32C is checked unless verify=False (default:
    FASTPERSIST_VERIFY_LOAD, on); a mismatch raises ChecksumMismatchError naming
    the file and tensor. Nothing from the checkpoint is unpickled unless
    allow_pickle=True. progress(n), if given, is called as each n bytes of
    tensors have been read (for progress bars).
    """
    _target_device(map_location, "cpu")  # a bad map_location fails before any I/O
    p = Path(os.path.abspath(os.fspath(path)))
    manifest = checkpoint.read_manifest(p)
    if verify is None:
        verify = current_knobs().verify_load
    if state.contains_pickle(manifest.tree) and not allow_pickle:
        # Fail before reading gigabytes of tensors.
        state.decode(manifest.tree, lambda node: torch.empty(0), where=str(p))
    if manifest.globals is not None:
        from .distributed import restore

        return restore.load(p, manifest, map_location, like, allow_pickle=allow_pickle,
                            verify=verify, progress=progress)
    entries = checkpoint.read_tensors(p, manifest, get_engine(), verify=verify,
                                      progress=progress)
    factory = _TensorFactory(entries, map_location, str(p))
    return state.decode(manifest.tree, factory, allow_pickle=allow_pickle, where=str(p))
