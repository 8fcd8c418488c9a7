"""The public surface of the package, and what imports without torch."""

from __future__ import annotations

import subprocess
import sys

import fastpersist

PUBLIC = {
    "CheckpointAbortedError", "CheckpointError", "CheckpointExistsError", "CheckpointIOError",
    "CheckpointNotFoundError", "CheckpointPermissionError", "Checkpointer",
    "ChecksumMismatchError", "CorruptCheckpointError", "DaemonError", "DaemonMayStillCommitError",
    "DaemonUnavailableError", "DiskFullError",
    "DistributedCheckpointError", "ManifestError", "PickleNotAllowedError", "PostCommitError",
    "HandOff", "SaveFuture", "StateMismatchError", "TensorIndexError", "TensorNotFoundError",
    "TierError",
    "TruncatedFileError", "UnknownFileFormatError", "UnsupportedPathError",
    "UnsupportedValueError",
    "__version__", "async_save", "exit_on_preemption", "hand_off", "load", "open",
    "prepare_staging", "save",
}


def test_public_names_are_pinned() -> None:
    assert set(fastpersist.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(fastpersist, name) is not None


def test_api_functions_are_functions_even_after_their_modules_import() -> None:
    import fastpersist.saving.pipeline  # binds the submodule on the package: no shadowing

    assert callable(fastpersist.async_save) and fastpersist.async_save.__name__ == "async_save"
    assert callable(fastpersist.save) and callable(fastpersist.load)
    import fastpersist.loading.handle  # the module of fastpersist.open

    assert callable(fastpersist.open) and fastpersist.open.__name__ == "open"


def test_format_engine_and_commit_import_without_torch() -> None:
    # What a checkpoint daemon or a listing needs must not drag in torch (hundreds
    # of MiB of resident memory and seconds of start-up).
    code = (
        "import sys\n"
        "import fastpersist, fastpersist.format.manifest, fastpersist.format.safetensors_file\n"
        "import fastpersist.engine, fastpersist.knobs, fastpersist.errors\n"
        "import fastpersist.storage.commit, fastpersist.storage.retention\n"
        "import fastpersist.storage.prepared, fastpersist.protocol.shm\n"
        "import fastpersist.protocol.client, fastpersist.daemon.service\n"
        "fastpersist.engine.get_engine()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_first_save_imports_nothing_when_torch_came_first(tmp_path) -> None:
    # A process's first save used to import the torch-facing API (some 70 modules,
    # compiled from source where bytecode is not cached) inside the call that a
    # user times, and the engine's native module inside its first write (issue 37).
    code = (
        "import sys, torch, fastpersist\n"
        "before = set(sys.modules)\n"
        f"fastpersist.save({{'w': torch.ones(8)}}, {str(tmp_path / 'ckpt')!r})\n"
        "late = sorted(m for m in set(sys.modules) - before if m.startswith('fastpersist'))\n"
        "assert not late, f'imported by the first save: {late}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (tmp_path / "ckpt" / "manifest.json").is_file()


def test_a_distributed_save_of_plain_tensors_does_not_import_dtensor(tmp_path) -> None:
    # Telling DTensors from plain tensors imported torch.distributed.tensor at a
    # DDP job's first save: 40 MiB of RSS, which took a 2-rank save through the
    # daemon over FASTPERSIST_STAGING_BUDGET + 64 MiB (benchmarks/memory_ceiling.py).
    code = (
        "import os, sys, socket, torch, fastpersist\n"
        "import torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',\n"
        "                  MASTER_PORT=str(port))\n"
        "dist.init_process_group('gloo')\n"
        f"fastpersist.save({{'w': torch.ones(8)}}, {str(tmp_path / 'ckpt')!r},\n"
        "                 process_group=dist.group.WORLD)\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
