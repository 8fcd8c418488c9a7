"""`fpctl gather`: one checkpoint from the node directories of a node-local one."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..distributed.gather import gather
from ._output import EXIT_OK, human_size


def cmd_gather(args: argparse.Namespace) -> int:
    copied = gather([Path(d) for d in args.dirs], Path(args.to))
    print(f"gathered {human_size(copied)} from {len(args.dirs)} director"
          f"{'y' if len(args.dirs) == 1 else 'ies'} into {args.to}")
    return EXIT_OK
