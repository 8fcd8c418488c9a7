"""fastpersist.open: a checkpoint's tensors one at a time, or a slice of one,
reading only the bytes asked for (as safetensors' safe_open).

Names are the dotted paths into the saved tree, as str(key) for a dict key
and the position for a list or tuple item: {"model": {"fc.weight": w}} has
"model.fc.weight", an optimizer's state "optim.state.0.exp_avg" (the root
tensor of a bare saved tensor is "<root>"). Tied tensors are listed under
each of their paths. A numpy array saved in the state is read as the
tensor it is stored as.

What a read costs, by how the tensor is stored (manifest: one CRC32C per
raw record, one per frame of a compressed one, a global tensor stored as
chunks that are records of their own):
- get_tensor reads the tensor's record, or a global tensor's chunks, and
  nothing else, each verified as load verifies it.
- get_slice(name)[i:j] reads the rows i..j of dim 0 (the rest of the
  index is applied in memory to those rows). A compressed record is read
  only in the frames that hold those rows, each frame's CRC32C checked. A
  raw record has one CRC32C for the whole tensor: with verification the
  whole record is read and checked, then cut (a slice of a huge raw tensor
  costs the read of the tensor, and its memory for that while); with
  verify=False only the rows' bytes are read, unchecked. A global tensor
  is read only in the chunks that overlap the rows, each checked as a
  whole (or in its frames). A tensor that is a view of another's storage
  is read whole and cut.

The bytes come from the Source that load chooses (source_for): the daemon's
copy in memory where it holds one, the directory, the object store.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch

from ..errors import CheckpointError, TensorNotFoundError
from ..format import dtypes
from ..format.manifest import Manifest
from ..format.tree import key_text
from ..knobs import current as current_knobs
from ..tensors import state
from ..tensors.factory import (
    MapLocation,
    SomeEntries,
    TensorFactory,
    placed,
    target_device,
)
from ..tensors.plan import memory_of
from ..tensors.source import Source
from . import slicing
from .load import source_for


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the checkpoint, as metadata() shows it in place of the
    tensor: its name (for get_tensor), dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def open(path: str | os.PathLike[str], map_location: MapLocation = None, *,
         verify: bool | None = None, daemon: str | None = None, tier: str | None = None,
         allow_pickle: bool = False) -> CheckpointHandle:
    """Open the checkpoint at `path` (a directory or "s3://BUCKET/PREFIX/NAME")
    for reading tensors one at a time: keys(), get_tensor(name),
    get_slice(name)[...], metadata(). Reads the manifest only; each call reads
    the bytes it asks for (the module's docstring says which), verified
    unless verify=False (default: FASTPERSIST_VERIFY_LOAD). map_location,
    daemon and tier are load's; metadata() unpickles a pickled value only
    with allow_pickle=True. Use it as a context manager, or close()."""
    target_device(map_location, "cpu")  # a bad map_location fails before any I/O
    return CheckpointHandle(source_for(path, daemon=daemon, tier=tier), map_location,
                            verify=current_knobs().verify_load if verify is None else verify,
                            allow_pickle=allow_pickle)


class CheckpointHandle:
    """An open checkpoint (fastpersist.open): see the module's docstring."""

    def __init__(self, source: Source, map_location: MapLocation = None, *, verify: bool = True,
                 allow_pickle: bool = False) -> None:
        self._source: Source | None = source
        self._map_location, self._verify, self._allow_pickle = map_location, verify, allow_pickle
        self._manifest = source.manifest()
        self._nodes = dict(_tensor_nodes(self._manifest.tree))

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Forget the source; later calls raise CheckpointError."""
        self._source = None

    @property
    def where(self) -> str:
        return self._open().where

    def keys(self) -> list[str]:
        """Every tensor's name, in the order of the saved tree."""
        self._open()
        return list(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def info(self, name: str) -> TensorInfo:
        """The dtype and shape of tensor `name`, without reading it."""
        dtype, shape = self._dtype_shape(self._node(name))
        return TensorInfo(name, dtypes.from_name(dtype), shape)

    def metadata(self) -> Any:
        """The saved object without its tensors: each one a TensorInfo.
        Nothing but the manifest is read."""
        where = self._open().where
        names = {id(node): name for name, node in self._nodes.items()}

        def info(node: dict[str, Any]) -> Any:
            dtype, shape = self._dtype_shape(node)
            return TensorInfo(node["name"], dtypes.from_name(dtype), shape)

        return state.decode(_named(self._manifest.tree, names), info,
                            allow_pickle=self._allow_pickle, where=where)

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, as load would return it there (its device, or
        map_location's; a parameter where it was one); reads only its bytes."""
        node = self._node(name)
        e = node["e"]
        entries = SomeEntries(self._entry_count(), {e: self._read_entry(e, None)},
                              self.where)
        return TensorFactory(entries, self._map_location, self.where)(node)

    def get_slice(self, name: str) -> TensorSlice:
        """A slice of tensor `name`: index it (get_slice(name)[2:5]) to read
        those rows (see the module's docstring); get_shape() and dtype
        without reading."""
        node = self._node(name)
        return TensorSlice(self, name, node)

    # -- reading ------------------------------------------------------------------

    def _open(self) -> Source:
        if self._source is None:
            raise CheckpointError("the checkpoint handle is closed")
        return self._source

    def _node(self, name: str) -> dict[str, Any]:
        self._open()
        node = self._nodes.get(name)
        if node is None:
            near = difflib.get_close_matches(str(name), self._nodes, n=5, cutoff=0.5)
            hint = (f"; the nearest it has: {', '.join(map(repr, near))}" if near else
                    f"; it has {len(self._nodes)} tensors, e.g. "
                    f"{', '.join(map(repr, list(self._nodes)[:5]))}" if self._nodes else
                    "; it has no tensors")
            raise TensorNotFoundError(f"{self.where}: no tensor named {name!r}{hint}")
        return node

    def _entry_count(self) -> int:
        m = self._manifest
        return len(m.globals) if m.globals is not None else len(m.tensors)

    def _dtype_shape(self, node: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
        view = node.get("view")
        if view is not None:
            return view["dtype"], tuple(view["shape"])
        m, e = self._manifest, node["e"]
        entry = m.globals[e] if m.globals is not None else m.tensors[e]
        return entry.dtype, tuple(entry.shape)

    def _read_entry(self, e: int, rows: tuple[int, int] | None) -> torch.Tensor:
        """Entry e on the CPU: whole (rows None), or only rows start..stop of
        dim 0 (a tensor of those rows)."""
        source, m = self._open(), self._manifest
        if m.globals is not None:
            from ..distributed.restore import read_boxes

            g = m.globals[e]
            box = ((0,) * len(g.shape), tuple(g.shape)) if rows is None else (
                (rows[0], *(0,) * (len(g.shape) - 1)), (rows[1] - rows[0], *g.shape[1:]))
            return read_boxes(source, m, {e: box}, verify=self._verify)[e]
        r = m.tensors[e]
        sub = _only(m, e)
        if rows is None or not r.shape:
            return source.read_tensors(sub, verify=self._verify)[0]
        row_bytes = r.length // r.shape[0] if r.shape[0] else 0
        span = (rows[0] * row_bytes, rows[1] * row_bytes)
        if r.frames is not None:  # decoded only in the frames over the rows
            t = source.read_tensors(sub, verify=self._verify, spans={0: span})[0]
            return t[rows[0]:rows[1]].clone()
        if self._verify or span[1] == span[0]:  # one CRC32C covers the record: read it whole
            t = source.read_tensors(sub, verify=self._verify)[0]
            return t[rows[0]:rows[1]].clone()
        out = torch.empty((rows[1] - rows[0], *r.shape[1:]), dtype=dtypes.from_name(r.dtype))
        f = sub.files[0]
        source.check_file(f)
        source.read_ranges(f, [(memory_of(out), r.offset + span[0])], checksum=False)
        return out

    def _read_rows(self, node: dict[str, Any], cut: slicing.Cut) -> torch.Tensor:
        e = node["e"]
        if "view" in node or cut.rows is None:  # a view's rows are not its entry's
            entries = SomeEntries(self._entry_count(), {e: self._read_entry(e, None)},
                                  self.where)
            whole = TensorFactory(entries, "cpu", self.where)(
                {k: v for k, v in node.items() if k not in ("param", "grad", "device")})
            return whole[cut.rest] if cut.rows is None else whole[
                cut.rows[0]:cut.rows[1]][cut.rest]
        return self._read_entry(e, cut.rows)[cut.rest]


class TensorSlice:
    """get_slice's result: index it to read part of the tensor."""

    def __init__(self, handle: CheckpointHandle, name: str, node: dict[str, Any]) -> None:
        self._handle, self._name, self._node = handle, name, node
        info = handle.info(name)
        self.dtype, self._shape = info.dtype, info.shape

    def get_shape(self) -> list[int]:
        return list(self._shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The tensor's values at `index` (ints, positive-step slices, `...`),
        on the device get_tensor would give, a new tensor (not a view of
        more than it holds). TensorIndexError before any read for an index
        out of range."""
        cut = slicing.cut(index, self._shape, self._name, self._handle.where)
        t = self._handle._read_rows(self._node, cut)
        saved, map_location = self._node.get("device", "cpu"), self._handle._map_location
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            # Its own memory: not a view that keeps a whole tensor read for it alive.
            t = t.clone(memory_format=torch.contiguous_format)
        if callable(map_location) and not isinstance(map_location, Mapping):
            # As get_tensor and load: torch's (storage, location) callable places it.
            return placed(t, map_location, saved, self._handle.where)
        device = target_device(map_location, saved)
        return t if device == "cpu" else t.to(device)


def _only(m: Manifest, e: int) -> Manifest:
    """The manifest cut to record e (and its file)."""
    r = m.tensors[e]
    return replace(m, files=tuple(f for f in m.files if f.name == r.file), tensors=(r,))


def _tensor_nodes(tree: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, tensor node) of every tensor of the tree, in its order;
    the first node keeps a path that two keys spell alike ({"a.b": x} and
    {"a": {"b": y}})."""
    seen: set[str] = set()
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        tag = node.get("t")
        if tag == "tensor":
            name = path or "<root>"
            if name not in seen:
                seen.add(name)
                yield name, node
        elif tag in ("dict", "odict"):
            items = [(v, _join(path, k if type(k) is str else key_text(k, i)))
                     for i, (k, v) in enumerate(zip(node["k"], node["v"], strict=True))]
            stack += reversed(items)
        elif tag in ("list", "tuple"):
            stack += reversed([(v, _join(path, i)) for i, v in enumerate(node["v"])])


def _named(node: Any, names: dict[int, str]) -> Any:
    """The tree with each tensor node replaced by one that carries its name
    (and no numpy mark: metadata shows a TensorInfo for a numpy value too)."""
    if isinstance(node, list):
        return [_named(v, names) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("t") == "tensor":
        named = {"t": "tensor", "e": node["e"], "name": names.get(id(node), "")}
        if "view" in node:
            named["view"] = node["view"]
        return named
    return {k: _named(v, names) for k, v in node.items()}


def _join(parent: str, key: object) -> str:
    return f"{parent}.{key}" if parent else str(key)


__all__ = ["CheckpointHandle", "TensorInfo", "TensorSlice", "open"]
