"""`fpctl inspect` and `fpctl verify`: what a checkpoint holds, and whether its
bytes still match their checksums."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..engine import get_engine
from ..errors import CorruptCheckpointError
from ..format import dtypes
from ..format.manifest import Manifest
from ..format.tree import Path as TreePath
from ..format.tree import path_text
from ..tensors.committed import read_manifest
from ..tensors.verifying import VerifyReport, verify
from ._output import (
    EXIT_CORRUPT,
    EXIT_OK,
    human_size,
    local_time,
    print_json,
    print_table,
    warn,
)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(node: Any, manifest: Manifest) -> str:
    """One phrase for a manifest tree node (see fastpersist.tensors.state for the tags)."""
    if not isinstance(node, dict):
        return _short(node)
    tag, value = node.get("t"), node.get("v")
    if tag in ("dict", "odict"):
        return f"{tag} of {len(node.get('k') or [])} keys"
    if tag in ("list", "tuple"):
        return f"{tag} of {len(value or [])} items"
    if tag == "tensor":
        numpy = _numpy_leaf(node, manifest)
        if numpy is not None:
            return (f"numpy {numpy['kind']} {numpy['dtype']} "
                    f"[{', '.join(map(str, numpy['shape']))}] (tensor {numpy['tensor']})")
        e = node.get("e")
        # A distributed checkpoint's tree refers to its globals, a single one's to its tensors.
        entries = manifest.globals if manifest.globals is not None else manifest.tensors
        name = entries[e].name if isinstance(e, int) and 0 <= e < len(
            entries) else f"<bad entry {e!r}>"
        return f"tensor {name}" + (" (view)" if "view" in node else "")
    if tag == "pickle":
        return "pickled value"
    if tag == "bytes":
        return f"bytes ({len(value or '') * 3 // 4} B)"
    return f"{tag} {_short(value)}"


def _numpy_leaf(node: dict[str, Any], manifest: Manifest) -> dict[str, Any] | None:
    """A numpy value's kind, dtype and shape (a validated manifest's), or None."""
    kind = node.get("np")
    if kind is None:
        return None
    # A distributed checkpoint's tree refers to its globals, a single one's to its tensors.
    entries = manifest.globals if manifest.globals is not None else manifest.tensors
    entry = entries[node["e"]]
    dtype, shape = entry.dtype, list(entry.shape)
    view = node.get("view")
    if view is not None:
        dtype, shape = view["dtype"], list(view["shape"])
    name = dtypes.torch_name(dtype)
    if node.get("np_dtype") == "complex128":  # stored as float64 pairs
        name, shape = "complex128", shape[:-1]
    return {"kind": kind, "dtype": name, "shape": shape, "tensor": entry.name}


def numpy_values(manifest: Manifest) -> list[dict[str, Any]]:
    """Every numpy value in the tree: its key path, kind, dtype, shape and tensor."""
    out = []
    stack: list[tuple[Any, TreePath]] = [(manifest.tree, None)]
    while stack:  # iterative: no recursion on what a manifest holds
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        tag = node.get("t")
        if tag == "tensor":
            leaf = _numpy_leaf(node, manifest)
            if leaf is not None:
                out.append({"path": path_text(path), **leaf})
        elif tag in ("dict", "odict"):
            pairs = list(enumerate(zip(node["k"], node["v"], strict=True)))
            stack += [(v, (path, k, i)) for i, (k, v) in reversed(pairs)]
            if "meta" in node:
                stack.append((node["meta"], (path, "_metadata", -1)))
        elif tag in ("list", "tuple"):
            stack += [(v, (path, i, i)) for i, v in reversed(list(enumerate(node["v"])))]
    return out


def _count(node: Any, tag: str) -> int:
    count, stack = 0, [node]
    while stack:  # iterative: no recursion on what a manifest holds
        n = stack.pop()
        if isinstance(n, dict):
            count += n.get("t") == tag
            stack += n.values()
        elif isinstance(n, list):
            stack += n
    return count


def tree_summary(manifest: Manifest) -> dict[str, Any]:
    """The shape of the non-tensor tree: its top level, references, pickles."""
    tree = manifest.tree
    summary: dict[str, Any] = {"type": _describe(tree, manifest)}
    if isinstance(tree, dict) and tree.get("t") in ("dict", "odict"):
        summary["keys"] = [
            {"key": k if not isinstance(k, dict) else _describe(k, manifest),
             "value": _describe(v, manifest)}
            for k, v in zip(tree.get("k") or [], tree.get("v") or [], strict=False)
        ]
    summary["tensor_refs"] = _count(tree, "tensor")
    summary["pickled_values"] = _count(tree, "pickle")
    summary["numpy_values"] = numpy_values(manifest)
    return summary


def _ratio(stored: int, raw: int) -> float:
    """Stored bytes per raw byte (lower is better), 1.0 for nothing stored."""
    return round(stored / raw, 4) if raw else 1.0


def _compressed(manifest: Manifest) -> bool:
    return any(t.frames is not None for t in manifest.tensors)


def stored_tensor_bytes(manifest: Manifest) -> int:
    return sum(t.stored_span for t in manifest.tensors)


def describe(path: Path | str, manifest: Manifest) -> dict[str, Any]:
    """The structured form that `fpctl inspect --json` prints."""
    return {
        "path": str(path),
        "schema_version": manifest.schema_version,
        "fastpersist_version": manifest.fastpersist_version,
        "created_unix": manifest.created_unix,
        "files": [{"name": f.name, "size": f.size, "data_start": f.data_start,
                   "header_crc32c": f"{f.header_crc32c:08x}",
                   **({"node": f.node} if f.node else {})} for f in manifest.files],
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                     "bytes": t.length, "file": t.file, "offset": t.offset,
                     "crc32c": f"{t.crc32c:08x}", "encoding": t.encoding,
                     **({"stored_bytes": t.stored_span, "frames": len(t.frames),
                         "ratio": _ratio(t.stored_span, t.length)}
                        if t.frames is not None else {})}
                    for t in manifest.tensors],
        "totals": {"files": len(manifest.files), "tensors": len(manifest.tensors),
                   "tensor_bytes": manifest.tensor_bytes, "bytes": manifest.total_bytes,
                   **({"stored_tensor_bytes": stored_tensor_bytes(manifest),
                       "ratio": _ratio(stored_tensor_bytes(manifest), manifest.tensor_bytes)}
                      if _compressed(manifest) else {})},
        "tree": tree_summary(manifest),
        **({"globals": [{"name": g.name, "dtype": g.dtype, "shape": list(g.shape),
                         "chunks": len(g.chunks)} for g in manifest.globals]}
           if manifest.globals is not None else {}),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.ckpt)
    info = describe(path, read_manifest(path))
    if args.json:
        print_json(info)
        return EXIT_OK
    print_description(path, info)
    return EXIT_OK


def print_description(path: Path | str, info: dict[str, Any]) -> None:
    """`fpctl inspect`'s text form of describe()."""
    print(f"checkpoint    {path}")
    print(f"schema        {info['schema_version']} (written by fastpersist "
          f"{info['fastpersist_version']})")
    print(f"created       {local_time(info['created_unix'])}")
    print("\nfiles:")
    print_table(["NAME", "SIZE", "BYTES"],
                [[f["name"], human_size(f["size"]), str(f["size"])] for f in info["files"]],
                right=[False, True, True])
    print("\ntensors:")
    totals = info["totals"]
    if "ratio" in totals:  # compressed: where each tensor's stored bytes went
        print_table(
            ["NAME", "DTYPE", "SHAPE", "BYTES", "STORED", "RATIO", "ENCODING", "FILE", "OFFSET",
             "CRC32C"],
            [[t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]",
              str(t["bytes"]), str(t.get("stored_bytes", t["bytes"])),
              f"{t.get('ratio', 1.0):.3f}", t["encoding"], t["file"], str(t["offset"]),
              t["crc32c"]] for t in info["tensors"]],
            right=[False, False, False, True, True, True, False, False, True, False],
        )
    else:
        print_table(
            ["NAME", "DTYPE", "SHAPE", "BYTES", "FILE", "OFFSET", "CRC32C"],
            [[t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]",
              str(t["bytes"]), t["file"], str(t["offset"]), t["crc32c"]]
             for t in info["tensors"]],
            right=[False, False, False, True, False, True, False],
        )
    print(f"\ntotal: {totals['files']} files, {totals['tensors']} tensors, "
          f"{human_size(totals['tensor_bytes'])} of tensors, {human_size(totals['bytes'])} "
          "on disk")
    if "ratio" in totals:
        print(f"compressed: tensors take {human_size(totals['stored_tensor_bytes'])} stored, "
              f"{totals['ratio']:.3f} of their raw size (zstd-bytegroup-v1)")
    tree = info["tree"]
    numpy = tree["numpy_values"]
    print(f"tree: {tree['type']}, {tree['tensor_refs']} tensor references"
          + (f" ({len(numpy)} of them numpy values)" if numpy else "")
          + (f", {tree['pickled_values']} pickled values" if tree["pickled_values"] else ""))
    if "globals" in info:
        nodes = sorted({f["node"] for f in info["files"] if "node" in f})
        print(f"distributed: {len(info['globals'])} job tensors stored as {totals['tensors']} "
              "chunks" + (f"; node-local files on {', '.join(nodes)}" if nodes else ""))
    for item in tree.get("keys", []):
        print(f"  {item['key']}: {item['value']}")
    if numpy:
        print("numpy values:")
        for item in numpy:
            print(f"  {item['path']}: numpy {item['kind']} {item['dtype']} "
                  f"[{', '.join(map(str, item['shape']))}] (tensor {item['tensor']})")


def cmd_verify(args: argparse.Namespace) -> int:
    path = Path(args.ckpt)
    return run_verify(str(path), path.name, args.json, lambda: read_manifest(path),
                      lambda manifest, progress: verify(path, get_engine(), progress=progress,
                                                        decode=not args.no_decode,
                                                        manifest=manifest))


def run_verify(where: str, name: str, as_json: bool, read: Callable[[], Manifest],
               check: Callable[[Manifest, Callable[[int], None]], VerifyReport]) -> int:
    """fpctl verify of a local or remote checkpoint: read() its manifest (once),
    check(manifest, progress) re-reads every tensor it lists."""
    try:
        manifest = read()
        start = time.perf_counter()
        # disable=None: a bar only when stderr is a terminal.
        with tqdm(total=manifest.tensor_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                  disable=None, desc=f"verify {name}", file=sys.stderr, leave=False) as bar:
            report = check(manifest, bar.update)
        seconds = time.perf_counter() - start
    except CorruptCheckpointError as exc:  # a malformed manifest: nothing else to check
        if as_json:
            print_json({"path": where, "ok": False, "problems": [str(exc)]})
        warn(str(exc))
        return EXIT_CORRUPT
    if as_json:
        print_json({"path": where, "ok": report.ok, "files": report.files,
                    "tensors": report.tensors, "bytes_checked": report.bytes_checked,
                    "seconds": seconds, "problems": report.problems})
    elif report.ok:
        rate = report.bytes_checked / seconds / 1e9 if seconds > 0 else 0.0
        print(f"OK {where}: {report.files} files, {report.tensors} tensors, "
              f"{human_size(report.bytes_checked)} checked in {seconds:.2f} s "
              f"({rate:.2f} GB/s)")
    else:
        print(f"CORRUPT {where}: {len(report.problems)} problems")
        for problem in report.problems:
            print(f"  {problem}")
    return EXIT_OK if report.ok else EXIT_CORRUPT


__all__ = ["cmd_inspect", "cmd_verify", "describe", "print_description", "run_verify",
           "tree_summary"]
