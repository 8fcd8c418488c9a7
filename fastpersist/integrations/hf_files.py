"""The small files FastPersistTrainer writes into a transformers checkpoint-N/
(the weights' index, the refusals a plain Trainer stops at), and which
checkpoint-N/ of a run is complete enough to resume from.

Torch-free and transformers-free, so that the rules can be checked without a
Trainer; fastpersist.integrations.transformers uses them.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from pathlib import Path

from ..adapters import is_checkpoint, replace_file

MODEL_DIR = "fastpersist-model"
TRAINER_DIR = "fastpersist-trainer"
INDEX_NAME = "model.safetensors.index.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
# transformers.trainer.OPTIMIZER_NAME and SCHEDULER_NAME: where a plain Trainer looks.
REFUSED_NAMES = ("optimizer.pt", "scheduler.pt")
REFUSAL = ("fastpersist: the optimizer and scheduler state of this checkpoint are in its "
           f"{TRAINER_DIR}/ directory, which a plain transformers Trainer cannot read; resume "
           "it with FastPersistTrainer (fastpersist.integrations.transformers)")
# The weights of a checkpoint HF wrote itself (transformers.utils' *_NAME): a
# plain Trainer's checkpoint-N/ resumes from these, not from MODEL_DIR.
HF_WEIGHTS = ("model.safetensors", INDEX_NAME, "pytorch_model.bin",
              "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils' PREFIX_CHECKPOINT_DIR


def write_index(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Write checkpoint_dir/model.safetensors.index.json for the weights in
    checkpoint_dir/fastpersist-model (from its manifest), atomically."""
    directory = Path(checkpoint_dir)
    manifest = json.loads((directory / MODEL_DIR / "manifest.json").read_text())
    weight_map = {t["name"]: f"{MODEL_DIR}/{t['file']}" for t in manifest["tensors"]}
    total = sum(int(t["length"]) for t in manifest["tensors"])
    index = {"metadata": {"total_size": total, "format": "pt", "producer": "fastpersist"},
             "weight_map": weight_map}
    target = directory / INDEX_NAME
    replace_file(target, json.dumps(index, indent=2, sort_keys=True).encode())
    return target


def write_refusals(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Write checkpoint_dir/optimizer.pt and scheduler.pt as files that torch.load
    refuses with REFUSAL in its message (with or without weights_only), so that a
    plain Trainer resuming this checkpoint stops there instead of starting the
    optimizer afresh without a word (it skips a missing optimizer.pt silently).
    Each is a torch zip archive whose pickle names a global that does not exist
    (the message): nothing in it can run, whatever loads it."""
    pickle = b"\x80\x02c" + REFUSAL.encode() + b"\nrefused\n."
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle)
        archive.writestr("archive/version", "3\n")
    for name in REFUSED_NAMES:
        replace_file(os.path.join(checkpoint_dir, name), buffer.getvalue())


def _is_refusal(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return REFUSAL.encode() in head


def is_complete(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """Whether checkpoint-N/ can be resumed: HF wrote its trainer_state.json
    (its last file), and the weights and optimizer state it refers to are
    there: fastpersist's committed, or HF's own files. A crash while
    fastpersist was still writing leaves HF's files without them."""
    directory = Path(checkpoint_dir)
    if not (directory / TRAINER_STATE_NAME).is_file():
        return False
    weights = is_checkpoint(directory / MODEL_DIR) or any(
        (directory / name).is_file() for name in HF_WEIGHTS)
    refused = _is_refusal(directory / REFUSED_NAMES[0])
    return weights and (not refused or is_checkpoint(directory / TRAINER_DIR))


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint-N/ in output_dir (None: none), as
    transformers' get_last_checkpoint, which takes the newest by name alone."""
    steps = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        if match is not None and os.path.isdir(os.path.join(output_dir, name)):
            steps.append((int(match.group(1)), name))
    for _, name in sorted(steps, reverse=True):
        path = os.path.join(output_dir, name)
        if is_complete(path):
            return path
    return None
