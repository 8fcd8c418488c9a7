"""DeepSpeed: `engine.save_checkpoint` / `load_checkpoint` through fastpersist.

    import deepspeed
    from fastpersist.integrations import deepspeed as fp_deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=config, ...)
    fp_deepspeed.use(engine)                    # or use(engine, decoupled=True, daemon=...)
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})
    engine.load_checkpoint("ckpt")              # the tag named by ckpt/latest

or, from the DeepSpeed config, after `fp_deepspeed.install()` (once, before
`deepspeed.initialize`): `"checkpoint": {"fastpersist": {"decoupled": true}}`
(the keys are use()'s keyword arguments). DeepSpeed itself picks its
checkpoint engine from a fixed list (`create_checkpoint_engine`: torch, the
DeepNVMe writer, decoupled, DataStates) and `deepspeed.initialize` takes no
engine argument; install() wraps that function so that the config can name
this one. use() replaces `engine.checkpoint_engine` on an initialized engine,
which is all DeepSpeed reads.

Layout: DeepSpeed names its files, `SAVE_DIR/TAG/mp_rank_00_model_states.pt`,
`.../zero_pp_rank_0_mp_rank_00_optim_states.pt`, ...; each becomes a
fastpersist checkpoint *directory* of that name (safetensors data files and a
manifest), committed atomically on its own. DeepSpeed finds them by the same
names (it globs and tests for existence), so load_checkpoint, ZeRO's partition
discovery and the `latest` file work unchanged. DeepSpeed's offline tools that
torch.load these paths (zero_to_fp32.py) need them converted first:
`fpctl restore PATH --to FILE --allow-pickle` (a torch file,
DeepSpeed's objects included). load() also reads plain torch files, so a run
saved with DeepSpeed's TorchCheckpointEngine resumes under this one.

When things are durable: save() returns once the state is copied into staging
memory; the files are written in the background (several at once).
commit(), which DeepSpeed calls at the end of save_checkpoint (decoupled=False)
or at the next optimizer step (decoupled=True), waits until every rank's files
of the tag are durable (a failure on any rank raises CheckpointError on every
rank, naming it), then rank 0 points `latest` at the tag atomically and
durably; only then does DeepSpeed write `latest` again (the same tag, with a
plain write). So `latest` never names a tag whose files are not all committed,
and a crash during a save leaves the previous tag and its `latest` intact.
A save() that raises in the caller (allow_pickle=False and a value that needs
pickle, an error while snapshotting) leaves its file missing, so it marks the
open tag failed: that tag's commit raises CheckpointError on every rank, naming
the tag, the rank and the file, and `latest` keeps naming the previous tag.
Decoupled, a caller that catches save_checkpoint's error meets it once more, at
the tag's commit (the next engine.step(), a save_checkpoint of another tag, or
destroy()), as with a file that failed in the background; a save_checkpoint of
the same tag again starts it afresh.
Saving a tag that already exists replaces its files one by one, each
atomically: a crash in between leaves a mix of old and new files in that tag.

Pickle: DeepSpeed's state holds objects that are not tensors or plain values
(its loss scaler, the `ds_config`, parameter shape dicts), which its own
TorchCheckpointEngine pickles and loads with `weights_only=False`. So
allow_pickle=True is this engine's default: those values are pickled into the
manifest's tree and unpickled on load, which runs code from the checkpoint;
load only checkpoints you trust, as with DeepSpeed's own engine. The tensors
are never pickled. allow_pickle=False refuses such state (UnsupportedValueError
naming the key) on save, and refuses to unpickle on load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

import fastpersist
from fastpersist import CheckpointError
from fastpersist.adapters import fsync_dir, pipeline_for, point_latest

if TYPE_CHECKING:
    from fastpersist import SaveFuture

ENGINE_NAME = "FastPersistCheckpointEngine"
CONFIG_KEY = "fastpersist"  # "checkpoint": {"fastpersist": {...}}, with install()


class FastPersistCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine that writes each file DeepSpeed saves as a
    fastpersist checkpoint (module docstring: layout, durability, pickle).

    daemon: write through fastpersistd ("unix:///PATH"; None: FASTPERSIST_DAEMON
        if set; "": in this process). The paths must lie under its --root.
    decoupled: False (default): save_checkpoint returns once the tag is durable.
        True: it returns once the state is snapshotted; the files are written
        while training goes on, and the next optimizer step (engine.step())
        commits the tag (waits for them, then writes `latest`), as DeepSpeed's
        DecoupledCheckpointEngine does; engine.destroy() commits a last one.
    allow_pickle: True (default): DeepSpeed's non-tensor objects are pickled.
    verify: check every CRC32C on load (None: FASTPERSIST_VERIFY_LOAD, on).
    max_in_flight: files persisting at once (each one's snapshot is held in
        staging memory until it is written).
    """

    def __init__(self, config_params: Any = None, *, daemon: str | None = None,
                 decoupled: bool = False, allow_pickle: bool = True,
                 verify: bool | None = None, max_in_flight: int = 4) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.daemon = daemon
        self.decoupled = decoupled
        self.allow_pickle = allow_pickle
        self.verify = verify
        self._pipeline = pipeline_for(daemon, shared=False, max_in_flight=max_in_flight)
        self._pending: dict[str, SaveFuture] = {}
        self._commit_info: CheckpointCommitInfo | None = None
        # Files of the open tag whose save() raised: no future reports them, so
        # commit() gathers these with the futures' failures.
        self._raised: list[str] = []

    # -- DeepSpeed's CheckpointEngine ----------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._commit_info is not None and self._commit_info != info:
            if self.decoupled:
                # Not committed yet (two saves without a step between); a tag
                # whose save() raised is refused there, on every rank.
                self.commit(self._commit_info)
            else:
                # The last save_checkpoint raised before its commit: its tag may
                # lack files, so `latest` is not pointed at it; its saves still
                # in flight end first, and a failure of theirs is raised here.
                self._commit_info = None
                self.wait()
        # The same tag again saves every file again: an earlier attempt's raise
        # no longer leaves one missing.
        self._raised = []
        self._commit_info = info

    def makedirs(self, path: str | os.PathLike[str], exist_ok: bool = False) -> None:
        """os.makedirs, with each directory it makes fsynced into its parent
        (DeepSpeed makes SAVE_DIR and SAVE_DIR/TAG with it)."""
        target = Path(os.path.abspath(path))
        missing = [p for p in (target, *target.parents) if not p.exists()]
        os.makedirs(target, exist_ok=exist_ok)
        for made in reversed(missing):
            fsync_dir(made.parent)

    def save(self, state_dict: Any, path: str) -> None:
        """Snapshot `state_dict` and write it to `path` in the background; durable
        once commit() returns."""
        target = os.path.abspath(path)
        try:
            earlier = self._pending.pop(target, None)
            if earlier is not None:  # the same file twice in one tag: in order
                earlier.result()
            self._pending[target] = self._pipeline.save(state_dict, target,
                                                        allow_pickle=self.allow_pickle)
        except BaseException as exc:
            # The caller may catch this and go on to commit the tag: remember
            # that this file is missing so that commit() refuses it.
            self._raised.append(f"rank {_rank()}: {target}: save() raised "
                                f"{type(exc).__name__}: {exc}")
            raise

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state saved at `path`: a fastpersist checkpoint, or a torch file
        (TorchCheckpointEngine's). map_location as torch.load takes it."""
        target = os.path.abspath(path)
        pending = self._pending.get(target)
        if pending is not None:
            pending.result()
        if os.path.isfile(target):
            return torch.load(target, map_location=map_location,
                              weights_only=not self.allow_pickle)
        if callable(map_location):
            state = fastpersist.load(target, "cpu", allow_pickle=self.allow_pickle,
                                     verify=self.verify)
            return _relocated(state, map_location)
        return fastpersist.load(target, map_location, allow_pickle=self.allow_pickle,
                                verify=self.verify)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait until every rank's files of `info.tag` are durable (raising a
        failure of any rank's on every rank), then, on rank 0 and if
        info.save_latest, point SAVE_DIR/latest at the tag (atomic, fsynced).
        A file whose save() raised on any rank fails the tag the same way."""
        failures = self._raised + self._wait_all()
        self._raised = []
        failures = _gathered(failures)
        self._commit_info = None
        if failures:
            raise CheckpointError(f"DeepSpeed checkpoint {info.tag!r} in {info.save_dir} was "
                                  "not saved: " + "; ".join(failures))
        if info.save_latest and _rank() == 0:
            fd = os.open(info.save_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                point_latest(fd, str(info.tag))
            finally:
                os.close(fd)
        return True

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self._commit_info if self.decoupled else None

    def cleanup(self) -> None:
        """Commit a decoupled tag still open (engine.destroy() calls this);
        raises as commit() does for a tag with a file not saved."""
        if self._commit_info is not None and self.decoupled:
            self.commit(self._commit_info)

    def preserves_storage_sharing(self) -> bool:
        # fastpersist stores the bytes each tensor views, not its whole storage,
        # so DeepSpeed need not clone views before saving (it does for torch.save).
        return False

    # -- beyond DeepSpeed's interface ---------------------------------------------------

    def wait(self) -> None:
        """Block until every save handed over so far is durable; raise the first failure."""
        failures = self._wait_all()
        if failures:
            raise CheckpointError("DeepSpeed checkpoint not saved: " + "; ".join(failures))

    def close(self) -> None:
        """Finish the saves in flight and stop the writer thread."""
        self._pipeline.close()

    def _wait_all(self) -> list[str]:
        pending, self._pending = self._pending, {}
        failures = []
        for path, future in pending.items():
            exc = future.exception()
            if exc is not None:
                failures.append(f"rank {_rank()}: {path}: {exc}")
        return failures


def use(engine: Any, **options: Any) -> FastPersistCheckpointEngine:
    """Make an initialized DeepSpeed engine save and load its checkpoints through
    fastpersist (options: FastPersistCheckpointEngine's keyword arguments).
    Call it on every rank, before the first save_checkpoint/load_checkpoint.
    Returns the new checkpoint engine."""
    current = engine.checkpoint_engine
    if not isinstance(current, FastPersistCheckpointEngine):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        if not isinstance(current, TorchCheckpointEngine):
            # Those engines decide which ranks write (is_data_parallel_writer), and
            # DeepSpeed fixed its writers from that answer at initialize.
            raise ValueError(f"the engine's checkpoint engine is {type(current).__name__} "
                             "(the DeepSpeed config's checkpoint.writer or datastates); remove "
                             "that section to checkpoint through fastpersist")
    else:
        current.cleanup()
        current.close()
    mine = FastPersistCheckpointEngine(**options)
    engine.checkpoint_engine = mine
    return mine


def install() -> None:
    """Let a DeepSpeed config select this engine: `"checkpoint": {"fastpersist":
    {...}}` (use()'s options; `{}` for the defaults) in the config given to
    deepspeed.initialize. Call once per process, before deepspeed.initialize.
    Configs without that key keep DeepSpeed's own choice."""
    import deepspeed.runtime.engine as ds_engine

    create = ds_engine.create_checkpoint_engine
    if getattr(create, "fastpersist_wrapped", None) is not None:
        return

    def create_checkpoint_engine(config_params: Any, *args: Any, **kwargs: Any) -> Any:
        options = config_options(config_params)
        if options is None:
            return create(config_params, *args, **kwargs)
        return FastPersistCheckpointEngine(config_params, **options)

    create_checkpoint_engine.fastpersist_wrapped = create  # type: ignore[attr-defined]
    ds_engine.create_checkpoint_engine = create_checkpoint_engine


def config_options(config_params: Any) -> dict[str, Any] | None:
    """use()'s options from a DeepSpeedConfig's checkpoint.fastpersist (None: absent)."""
    raw = getattr(config_params, "_param_dict", None) or {}
    options = (raw.get("checkpoint") or {}).get(CONFIG_KEY)
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"DeepSpeed config checkpoint.{CONFIG_KEY} must be an object of "
                         f"FastPersistCheckpointEngine's options, not {options!r}")
    if (raw.get("checkpoint") or {}).get("writer") is not None:
        raise ValueError(f"DeepSpeed config: checkpoint.{CONFIG_KEY} and checkpoint.writer "
                         "each choose a checkpoint engine; keep one")
    return dict(options)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


def _gathered(failures: list[str]) -> list[str]:
    """Every rank's failures, on every rank (also the barrier that makes rank 0
    write `latest` only after every rank's files are durable)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return failures
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, failures)
    return [f for rank_failures in everyone for f in rank_failures]


def _relocated(state: Any, fn: Callable[[Any, str], Any]) -> Any:
    """torch.load's callable map_location applied to a state loaded on the CPU:
    fn(storage, "cpu") for each tensor, which moves to the device of the storage
    fn returns (DeepSpeed passes `lambda storage, loc: storage`: stay on the CPU)."""
    if isinstance(state, torch.Tensor):
        moved = fn(state.untyped_storage(), "cpu")
        return state if moved.device == state.device else state.to(moved.device)
    if isinstance(state, dict):
        for key, value in state.items():
            state[key] = _relocated(value, fn)
        return state
    if isinstance(state, list):
        return [_relocated(v, fn) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(_relocated(v, fn) for v in state)
    return state
