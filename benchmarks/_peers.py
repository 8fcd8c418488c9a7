"""fastpersist and the systems it is compared with, each behind the same small interface.

Every `save` returns only once the checkpoint is durable: peers that do not fsync on their
own get `fsync_tree` (files, directories and the parent entry) inside the timed region.
One-time setup that a trainer pays once per job (DeepSpeed's aio handle and page-locked
buffer) happens in `setup`, outside the timed region and the memory baseline.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from _state import (
    STATE_KEYS,
    StateSpec,
    build_skeleton,
    flatten_tensors,
    verify_flat,
    verify_nested,
)
from _system import fsync_path, fsync_tree

REPO_ROOT = Path(__file__).resolve().parent.parent


class Method:
    """A way to save and (maybe) load the benchmark state."""

    name = ""
    label = ""
    suffix = ""  # file name suffix, or "" for a checkpoint directory
    can_load = True

    def probe(self) -> str | None:
        """None if usable here, else the reason it is skipped. May be slow (builds, imports)."""
        return None

    def setup(self) -> None:
        """Per-process preparation that is neither timed nor counted in peak memory."""

    def prepare_save(self, path: Path) -> None:
        """Untimed preparation before a save that needs to know where it writes."""

    def facts(self) -> dict[str, Any]:
        """What the result should record about how this process ran the method (JSON)."""
        return {}

    def prepare_load(self, spec: StateSpec) -> None:
        """Untimed preparation before a cold load (imports, in-place destinations)."""

    def save(self, state: dict[str, Any], path: Path) -> None:
        raise NotImplementedError

    def load(self, path: Path, spec: StateSpec) -> object:
        raise NotImplementedError

    def verify(self, loaded: object, spec: StateSpec) -> None:
        verify_nested(loaded, spec)


def _import_fastpersist() -> Any:
    """The installed package, else the in-tree one (an editable checkout not yet installed)."""
    try:
        import fastpersist
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        sys.modules.pop("fastpersist", None)
        import fastpersist
    return fastpersist


class FastPersist(Method):
    name = "fastpersist"
    label = "fastpersist.save/load"

    def probe(self) -> str | None:
        try:
            fp = _import_fastpersist()
        except Exception as exc:  # any import failure means "not there yet", not a crash
            return f"import fastpersist failed: {type(exc).__name__}: {exc}"
        missing = [name for name in ("save", "load") if not hasattr(fp, name)]
        if missing:
            return f"fastpersist has no {', '.join(missing)}"
        return None

    def setup(self) -> None:
        self._fp = _import_fastpersist()
        # fastpersist imports its API (and torch) on first use; a program
        # imports it before it saves, as it imports torch or safetensors.torch,
        # whose imports are not timed either.
        self._fp.save, self._fp.load  # noqa: B018

    def prepare_load(self, spec: StateSpec) -> None:
        self.setup()

    def save(self, state: dict[str, Any], path: Path) -> None:
        self._fp.save(state, str(path))  # durable on return by contract: no extra fsync

    def load(self, path: Path, spec: StateSpec) -> object:
        return self._fp.load(str(path))


class FastPersistInto(FastPersist):
    """fastpersist.load(path, into=state): into a state already in memory, as a
    trainer resuming has its model built (its pages touched) before it loads. Its
    save is fastpersist.save again (a second sample of that row)."""

    name = "into"
    label = "fastpersist.load(into=state in memory)"

    def prepare_load(self, spec: StateSpec) -> None:
        self.setup()
        self._dest = build_skeleton(spec)
        _touch(self._dest)

    def load(self, path: Path, spec: StateSpec) -> object:
        return self._fp.load(str(path), into=self._dest)


class FastPersistThenCopy(FastPersistInto):
    """What a resume does without into=: fastpersist.load, then each tensor
    copied into the state in memory (as Module.load_state_dict copies)."""

    name = "loadcopy"
    label = "fastpersist.load + copy_ into state in memory"

    def load(self, path: Path, spec: StateSpec) -> object:
        loaded = self._fp.load(str(path))
        _copy_into(self._dest, loaded)
        return self._dest


def _copy_into(dest: object, source: object) -> None:
    if isinstance(dest, torch.Tensor):
        with torch.no_grad():
            dest.copy_(source)  # type: ignore[arg-type]
    elif isinstance(dest, dict):
        assert isinstance(source, dict)
        for key, value in dest.items():
            if isinstance(value, (torch.Tensor, dict, list, tuple)):
                _copy_into(value, source[key])
            else:
                dest[key] = source[key]
    elif isinstance(dest, (list, tuple)):
        assert isinstance(source, (list, tuple))
        for i, (d, src) in enumerate(zip(dest, source, strict=True)):
            if isinstance(d, (torch.Tensor, dict, list, tuple)):
                _copy_into(d, src)
            elif isinstance(dest, list):
                dest[i] = src


def _touch(obj: object) -> None:
    """Write every tensor of a state, as a model's initialisation does."""
    if isinstance(obj, torch.Tensor):
        obj.zero_()
    elif isinstance(obj, dict):
        for value in obj.values():
            _touch(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _touch(value)


class Baseline(FastPersist):
    """Another fastpersist (save_load.py --baseline DIR, which the worker puts first on
    sys.path): the same calls, for before/after comparisons in one interleaved run."""

    name = "baseline"
    label = "fastpersist baseline (--baseline)"


class BaselineInto(FastPersistInto):
    """The --baseline package's load(into=) (its save as Baseline's)."""

    name = "baseline_into"
    label = "baseline load(into=) (--baseline)"


class TorchSave(Method):
    name = "torch"
    label = "torch.save/load"
    suffix = ".pt"

    def save(self, state: dict[str, Any], path: Path) -> None:
        torch.save(state, path)
        fsync_tree(path)

    def load(self, path: Path, spec: StateSpec) -> object:
        return torch.load(path, map_location="cpu", weights_only=True)


class SafeTensors(Method):
    name = "safetensors"
    label = "safetensors save_file/load_file"
    suffix = ".safetensors"

    def probe(self) -> str | None:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            return f"import safetensors failed: {exc}"
        return None

    def prepare_load(self, spec: StateSpec) -> None:
        import safetensors.torch  # noqa: F401  (import cost is not load cost)

    def save(self, state: dict[str, Any], path: Path) -> None:
        from safetensors.torch import save_file

        # safetensors holds only tensors: plain values (step, param_groups) ride in the
        # string metadata as JSON, which is how they would survive a real conversion.
        tensors, metadata = flatten_tensors(state)
        save_file(tensors, str(path), metadata=metadata)
        fsync_tree(path)

    def load(self, path: Path, spec: StateSpec) -> object:
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")

    def verify(self, loaded: object, spec: StateSpec) -> None:
        assert isinstance(loaded, dict)
        verify_flat(loaded, spec)


class Dcp(Method):
    name = "dcp"
    label = "torch.distributed.checkpoint (1 process)"

    def probe(self) -> str | None:
        try:
            import torch.distributed.checkpoint  # noqa: F401
        except ImportError as exc:
            return f"import torch.distributed.checkpoint failed: {exc}"
        return None

    def setup(self) -> None:
        import warnings

        import torch.distributed.checkpoint as dcp

        # Without a process group DCP saves and loads in this one process, and says so.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        self._dcp: Any = dcp  # save/load are not in its __all__ for type checkers

    def prepare_load(self, spec: StateSpec) -> None:
        self.setup()
        # DCP loads in place into a state of the right shapes, as a trainer resuming does.
        self._dest = build_skeleton(spec)

    def save(self, state: dict[str, Any], path: Path) -> None:
        # Default FileSystemWriter (sync_files=True); fsync_tree adds .metadata and the dirs.
        self._dcp.save(state, checkpoint_id=str(path))
        fsync_tree(path)

    def load(self, path: Path, spec: StateSpec) -> object:
        self._dcp.load(self._dest, checkpoint_id=str(path))
        return self._dest


def _has_einval(exc: BaseException | None) -> bool:
    """Whether EINVAL is anywhere in an exception's cause/context chain."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class TorchCheckpointing(Method):
    """Meta's torch-checkpointing (what torchtitan uses): `CheckpointManager` with its
    synchronous saver, one `torch.save` file per top-level key written by its
    `LocalFileSystemStorage`, then renamed from `tmp_<name>` onto the final directory.

    The library never fsyncs (no fsync/fdatasync/syncfs anywhere in 0.1.1; its
    LocalFileSystemStorage writes through a plain file object), so `fsync_tree` makes the
    result durable inside the timed region, as for torch.save. Its default storage opens
    every file with O_DIRECT (LocalFileSystemStorageConfig.use_direct_io=True) but then
    writes torch.save's unaligned zip records through it: on filesystems that enforce
    O_DIRECT alignment (ext4, XFS) the first write fails with EINVAL and the save fails.
    So each save process first tries the default on a tiny state next to the target; if
    that fails with EINVAL, the measured save uses use_direct_io=False (the configuration
    that works there) and the result says so. Its default manager saves asynchronously
    (a staging copy, then a writer subprocess); the synchronous saver is measured because
    the time until durable is what this table compares.
    """

    name = "torchckpt"
    label = "torch-checkpointing CheckpointManager (sync)"

    def _import(self) -> Any:
        import torch_checkpointing

        return torch_checkpointing

    def probe(self) -> str | None:
        try:
            self._import()
        except Exception as exc:
            return (f"import torch_checkpointing failed: {type(exc).__name__}: {exc}"
                    " (pip install torch-checkpointing==0.1.1)")
        return None

    def _manager(self, use_direct_io: bool = True) -> Any:
        from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        return CheckpointManager(CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=use_direct_io),
        ))

    def setup(self) -> None:
        self._import()
        self._facts: dict[str, Any] = {}

    def prepare_save(self, path: Path) -> None:
        # The writer's temporary directory: a stale one from a crashed save would be reused.
        shutil.rmtree(path.parent / f"tmp_{path.name}", ignore_errors=True)
        trial = path.parent / f"{path.name}.odirect-trial"
        use_direct_io = True
        try:
            self._manager().save(str(trial), {"trial": torch.arange(1000.0)})
            # Where the O_DIRECT open itself is refused, its WriteStream quietly writes
            # buffered: say which of the two the default amounted to here.
            from torch_checkpointing.storage.filesystem import WriteStream

            with WriteStream(trial / "open-check", "wb", use_direct_io=True) as stream:
                direct = stream.using_direct_io
            self._facts["note"] = (
                "library default (use_direct_io=True): "
                + ("files written with O_DIRECT" if direct else
                   "O_DIRECT open refused, so its own buffered fallback")
                + "; no fsync of its own"
            )
        except Exception as exc:
            if not _has_einval(exc):
                raise
            use_direct_io = False
            self._facts["note"] = (
                "O_DIRECT (the library default) refused here (EINVAL on unaligned"
                " torch.save writes): measured with use_direct_io=False; no fsync of its own"
            )
        finally:
            for leftover in (trial, trial.parent / f"tmp_{trial.name}"):
                shutil.rmtree(leftover, ignore_errors=True)
        self._facts["direct_io"] = use_direct_io
        self._save_manager = self._manager(use_direct_io)

    def facts(self) -> dict[str, Any]:
        return self._facts

    def prepare_load(self, spec: StateSpec) -> None:
        self.setup()
        # The library's defaults: use_direct_io governs only its writes; this load path
        # reads buffered, in 64 MiB ranges on 8 threads, into one anonymous mapping.
        self._load_manager = self._manager()

    def save(self, state: dict[str, Any], path: Path) -> None:
        # The sync saver returns once every file is written and the directory renamed.
        self._save_manager.save(str(path), state)
        fsync_tree(path)  # the library does not fsync: files, directories, parent entry

    def load(self, path: Path, spec: StateSpec) -> object:
        # into={key: None}: new tensors (views of one buffer it reads the files into), as
        # torch.load would give; a trainer resuming may instead load into its live state.
        return dict(self._load_manager.load(str(path), into=dict.fromkeys(STATE_KEYS)))


class DeepSpeedFastWriter(Method):
    """torch.save into DeepSpeed's FastFileWriter (O_DIRECT via its async_io op, double buffer).

    Built the way deepspeed.runtime.model_checkpointing.CheckpointWriterFactory does, with
    its defaults: 64 MiB double I/O buffer, aio block 1 MiB, queue depth 8, overlap events.
    """

    name = "deepspeed"
    label = "DeepSpeed FastFileWriter + torch.save"
    suffix = ".pt"
    can_load = False  # DeepSpeed reads these files back with plain torch.load

    IO_BUFFER_BYTES = 64 * 2**20

    def _import(self) -> Any:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed.io.fast_file_writer as ffw
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.utils import UtilsBuilder

        # On CPU-only torch, deepspeed.ops.op_builder resolves to the CPU accelerator's
        # builders, which lack UtilsBuilder; the generic one builds fine.
        ffw.UtilsBuilder = UtilsBuilder
        return ffw, AsyncIOBuilder

    def probe(self) -> str | None:
        try:
            ffw, aio_builder = self._import()
        except Exception as exc:
            return f"import deepspeed failed: {type(exc).__name__}: {exc}"
        if not aio_builder().is_compatible(verbose=False):
            return "DeepSpeed async_io op is not compatible here (libaio-dev missing?)"
        try:
            # First use JIT-compiles both ops (minutes); later processes load the cache.
            aio_builder().load()
            ffw.UtilsBuilder().load()
        except Exception as exc:
            return f"building DeepSpeed ops failed: {type(exc).__name__}: {exc}"
        return None

    def setup(self) -> None:
        ffw, aio_builder = self._import()
        self._ffw = ffw
        self._handle = (
            aio_builder()
            .load()
            .aio_handle(
                block_size=2**20,
                queue_depth=8,
                single_submit=False,
                overlap_events=True,
                intra_op_parallelism=1,
            )
        )
        # The factory uses Tensor.pin_memory(), which CPU-only torch refuses; DeepSpeed's
        # own NVMe perf tool (nvme/test_ds_aio_utils.py) uses the handle's mlock'ed tensor.
        self._buffer = self._handle.new_cpu_locked_tensor(
            self.IO_BUFFER_BYTES, torch.empty(0, dtype=torch.uint8)
        )
        self._buffer.zero_()

    def save(self, state: dict[str, Any], path: Path) -> None:
        config = self._ffw.FastFileWriterConfig(
            dnvme_handle=self._handle, pinned_tensor=self._buffer
        )
        writer = self._ffw.FastFileWriter(file_path=str(path), config=config)
        torch.save(state, writer)
        writer.close()  # drains the buffers and fsyncs the file
        fsync_path(path.parent)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (FastPersist(), FastPersistInto(), FastPersistThenCopy(), Baseline(),
              BaselineInto(), TorchSave(), SafeTensors(), Dcp(), TorchCheckpointing(),
              DeepSpeedFastWriter())
}
