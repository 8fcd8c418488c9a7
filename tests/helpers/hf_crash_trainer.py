"""tests/test_integration_hf.py's FastPersistTrainer run, killed (os._exit(9),
as a node dies) at a bad moment for checkpoint-AT:

    python hf_crash_trainer.py OUT AT write [ARGS_JSON]
        while its fastpersist saves write their first data file
    python hf_crash_trainer.py OUT AT train_end [ARGS_JSON]
        at on_train_end, its saves slowed (a 2 s pause before each data file),
        so that they are still in flight unless the trainer waited for them

ARGS_JSON: keyword arguments of the test module's train().
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import test_integration_hf as hf
from transformers import TrainerCallback

from fastpersist.tensors import datafile

out, at, moment = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
real = datafile.write


def write(engine: Any, directory: str, file_name: str, tensors: Any) -> Any:
    if f"{os.sep}checkpoint-{at}{os.sep}" in directory:
        if moment == "write":
            os._exit(9)
        time.sleep(2)
    return real(engine, directory, file_name, tensors)


class DieAtTrainEnd(TrainerCallback):
    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        os._exit(9)


datafile.write = write
hf.train(out, callbacks=[DieAtTrainEnd()] if moment == "train_end" else [], **kwargs)
sys.exit(f"checkpoint-{at} was never saved")
