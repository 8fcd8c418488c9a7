"""The CheckpointIO plugin shared by lightning.pytorch and pytorch_lightning.

This module imports neither: `lightning.py` and `pytorch_lightning.py` combine
the class below with their framework's CheckpointIO base class.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fastpersist
from fastpersist import CheckpointError, UnsupportedValueError
from fastpersist.adapters import checkpoint_path, delete_checkpoint, is_checkpoint

if TYPE_CHECKING:
    from fastpersist import SaveFuture

log = logging.getLogger(__name__)

# Deeper than fastpersist stores; save() then raises, naming the key.
_MAX_DEPTH = 100
# An argparse.Namespace is stored as {NAMESPACE: {its attributes}}, a plain
# mapping (no pickle), and load_checkpoint turns it back into a Namespace: a
# LightningModule whose __init__ takes `args: Namespace` gets one again.
NAMESPACE = "__argparse.Namespace__"


def plain(obj: Any, safe_dicts: tuple[type[dict[Any, Any]], ...], depth: int = 0) -> Any:
    """`obj` with every instance of `safe_dicts` (dict subclasses that hold
    nothing but their items, like Lightning's AttributeDict) turned into a
    dict. Containers with nothing to convert are returned as they are (same
    objects: tensors keep their sharing, state dicts their _metadata)."""
    if depth > _MAX_DEPTH:
        return obj
    if type(obj) is argparse.Namespace:
        return {NAMESPACE: plain(dict(vars(obj)), safe_dicts, depth + 1)}
    if isinstance(obj, safe_dicts):
        return {k: plain(v, safe_dicts, depth + 1) for k, v in obj.items()}
    return _rebuilt(obj, lambda v: plain(v, safe_dicts, depth + 1))


def namespaces(obj: Any, depth: int = 0) -> Any:
    """`obj` with every mapping that plain() made of an argparse.Namespace
    turned back into one; containers with none are returned as they are."""
    if depth > _MAX_DEPTH:
        return obj
    if (type(obj) in (dict, OrderedDict) and list(obj) == [NAMESPACE]
            and type(obj[NAMESPACE]) is dict):
        inner = namespaces(obj[NAMESPACE], depth + 1)
        if all(type(k) is str for k in inner):
            return argparse.Namespace(**inner)
    return _rebuilt(obj, lambda v: namespaces(v, depth + 1))


def _rebuilt(obj: Any, convert: Callable[[Any], Any]) -> Any:
    """A plain dict, OrderedDict, list or tuple with `convert` applied to each
    value; the container itself when nothing changed (same object: tensors
    keep their sharing; a changed state dict keeps its _metadata)."""
    if type(obj) in (dict, OrderedDict):
        items = {k: convert(v) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        converted: dict[Any, Any] = OrderedDict(items) if type(obj) is OrderedDict else items
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            converted._metadata = meta  # type: ignore[attr-defined]
        return converted
    if type(obj) in (list, tuple):
        values = [convert(v) for v in obj]
        if all(a is b for a, b in zip(values, obj, strict=True)):
            return obj
        return values if type(obj) is list else tuple(values)
    return obj


class FastPersistCheckpointIOBase:
    """Lightning CheckpointIO that writes each checkpoint with fastpersist.

    A checkpoint is a directory: `ModelCheckpoint`'s `epoch=3-step=400.ckpt`
    becomes a directory of that name holding safetensors data files and a
    manifest. Saves are durable when they complete and atomic (an existing
    checkpoint of that name is replaced only once the new one is complete).

    async_save=False (default): save_checkpoint returns once the checkpoint is
        durable (fastpersist.save).
    async_save=True: save_checkpoint returns once every tensor is copied into
        staging memory (fastpersist.async_save); the write overlaps training.
        A failed save is raised by the next save_checkpoint, by
        remove_checkpoint/load_checkpoint of the same path, or at the latest
        by teardown() (Lightning calls it at the end of fit), which waits for
        every pending save.
    allow_pickle=False (default): a checkpoint holds only what fastpersist
        stores without pickle (tensors, numbers, strings, None, bytes, lists,
        tuples, dicts). Lightning's AttributeDict is stored as a dict (which is
        what Lightning itself writes for hyper_parameters), an argparse.Namespace
        as a dict of its attributes that load_checkpoint (and
        load_from_checkpoint) turn back into a Namespace; any other value (a
        Path among the hyperparameters, a numpy scalar in a callback's
        state) raises fastpersist.UnsupportedValueError
        naming its key, before anything is written. allow_pickle=True pickles
        such values; loading such a checkpoint then unpickles, which can run
        arbitrary code (load_checkpoint(weights_only=True) refuses it).
    map_location: where load_checkpoint puts the tensors ("cpu", as Lightning's
        TorchCheckpointIO does, unless the caller passes one).
    daemon: save through fastpersistd (as in fastpersist.save; None: the
        FASTPERSIST_DAEMON address if set, "": in-process).

    Only the global rank 0 saves (Lightning's strategies call the plugin there);
    sharded strategies (FSDP, DeepSpeed) keep their own checkpoint formats.
    """

    _safe_dicts: tuple[type[dict[Any, Any]], ...] = ()

    def __init__(self, *, async_save: bool = False, allow_pickle: bool = False,
                 map_location: Any = "cpu", verify: bool | None = None,
                 daemon: str | None = None) -> None:
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.map_location = map_location
        self.verify = verify
        self.daemon = daemon
        self._pending: list[SaveFuture] = []

    # -- CheckpointIO -------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options "
                            "(Trainer.save_checkpoint(..., storage_options=...))")
        target = _absolute(path)
        self._raise_finished_failures()
        self._wait_for(target)
        state = plain(checkpoint, self._safe_dicts)
        try:
            if self.async_save:
                try:
                    future = fastpersist.async_save(state, target, allow_pickle=self.allow_pickle,
                                                    daemon=self.daemon)
                except CheckpointError:
                    # async_save raised an earlier save's failure (it is reported now).
                    self._pending = [f for f in self._pending if not f.done()]
                    raise
                self._pending.append(future)
            else:
                fastpersist.save(state, target, allow_pickle=self.allow_pickle,
                                 daemon=self.daemon)
        except UnsupportedValueError as exc:
            raise UnsupportedValueError(
                f"Lightning checkpoint {target}: {exc}. FastPersistCheckpointIO stores "
                "tensors, numbers, strings, None, bytes, lists, tuples and dicts (and "
                "AttributeDict and argparse.Namespace, as dicts); make the value one of those "
                "(e.g. save_hyperparameters with plain values) or pass "
                "FastPersistCheckpointIO(allow_pickle=True)"
            ) from exc

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a fastpersist checkpoint directory (or, to resume a run that used
        Lightning's default plugin, a torch.save file)."""
        target = _absolute(path)
        self._wait_for(target)
        location = self.map_location if map_location is None else map_location
        allow_pickle = self.allow_pickle and weights_only is not True
        if os.path.isfile(target):
            import torch

            loaded: dict[str, Any] = torch.load(target, map_location=location,
                                                weights_only=not allow_pickle)
            return loaded
        if callable(location):
            location = _default_location(location)
        result: dict[str, Any] = namespaces(fastpersist.load(
            target, location, allow_pickle=allow_pickle, verify=self.verify))
        return result

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove a checkpoint atomically: it is renamed aside (durably) first,
        so a crash never leaves a half-deleted checkpoint under its name.
        Every pending save is waited for first, not only one to `path`:
        Lightning removes the checkpoint a new one replaces (save_top_k) right
        after starting that save, and removing it before the new one is
        durable would leave no checkpoint after a crash; if a pending save
        failed, its error is raised and nothing is removed."""
        target = _absolute(path)
        pending, self._pending = self._pending, []
        _raise_first(pending)
        p = Path(target)
        if p.is_symlink() or p.is_file():  # save_last="link", or a torch.save file
            p.unlink()
        elif p.is_dir():
            if not is_checkpoint(p):
                log.warning("%s is not a fastpersist checkpoint; not removing it", p)
                return
            delete_checkpoint(p)
        log.debug("Removed checkpoint: %s", p)

    def teardown(self) -> None:
        """Wait for every pending asynchronous save; raise the first failure."""
        pending, self._pending = self._pending, []
        _raise_first(pending)

    # -- helpers ------------------------------------------------------------

    def wait(self) -> None:
        """Block until every save so far is durable (the same as teardown)."""
        self.teardown()

    def _raise_finished_failures(self) -> None:
        finished = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        _raise_first(finished)

    def _wait_for(self, target: str) -> None:
        """Finish the pending saves to `target` before it is read, replaced or removed."""
        mine = [f for f in self._pending if str(f.path) == target]
        self._pending = [f for f in self._pending if str(f.path) != target]
        _raise_first(mine)


def _default_location(location: Any) -> Any:
    """map_location for Lightning's own default function (load_from_checkpoint
    passes it when the caller gives none): tensors back where they were saved,
    CUDA tensors to the CPU where there is no CUDA, without a call per tensor.
    Any other function is torch's callable map_location, which load takes."""
    if getattr(location, "__name__", None) == "_default_map_location" and getattr(
            location, "__module__", None) in ("lightning.pytorch.core.saving",
                                              "pytorch_lightning.core.saving"):
        import torch

        return None if torch.cuda.is_available() else "cpu"
    return location


def install_loader(saving: Any, io_class: type[FastPersistCheckpointIOBase]) -> None:
    """Make `saving` (lightning.pytorch.core.saving, or pytorch_lightning's)
    read a fastpersist checkpoint directory in load_from_checkpoint: its
    `pl_load` is wrapped; any other path, URL or file object goes to the
    original, unchanged. Idempotent."""
    original = saving.pl_load
    if getattr(original, "_fastpersist", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None,
                weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and is_checkpoint(path_or_url):
            # Pickled values only where the caller says weights_only=False, as
            # torch.load (whose default, which Lightning passes on, is True).
            return io_class(allow_pickle=weights_only is False).load_checkpoint(
                path_or_url, map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._fastpersist = True  # type: ignore[attr-defined]
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]
    saving.pl_load = pl_load


def _absolute(path: str | os.PathLike[str]) -> str:
    return str(checkpoint_path(path))


def _raise_first(futures: list[SaveFuture]) -> None:
    """Wait for every future; raise the first failure, log the others."""
    first: BaseException | None = None
    for f in futures:
        exc = f.exception()
        if exc is None:
            continue
        if first is None:
            first = exc
        else:
            log.error("asynchronous checkpoint save to %s failed: %s", f.path, exc)
    if first is not None:
        raise first


__all__ = ["NAMESPACE", "FastPersistCheckpointIOBase", "install_loader", "namespaces", "plain"]
