"""tests/test_integration_hf.py's accelerate run with rotating checkpoints
(total_limit=1), killed (os._exit(9), as a node dies) while fastpersist
writes the first data file of its second checkpoint, checkpoint_1:

    python accelerate_crash.py PROJECT_DIR sync|async
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import test_integration_hf as hf

from fastpersist.tensors import datafile

project, mode = Path(sys.argv[1]), sys.argv[2]
real = datafile.write


def write(engine: Any, directory: str, file_name: str, tensors: Any) -> Any:
    if f"{os.sep}checkpoint_1{os.sep}" in directory:
        os._exit(9)
    return real(engine, directory, file_name, tensors)


datafile.write = write
hf.accelerate_run(project / "unused", rotating=project, async_save=mode == "async")
sys.exit("checkpoint_1 was never saved")
