"""Where each field of a box is: a box is the part of a global tensor that
a rank holds. plan.Item names its fields, but what ranks send and what a
plan keeps are plain tuples of the same fields (plan.Box), so the planner's
modules read a box by position, with the names here. A leaf module, so that
runs.py and tiling.py, which the planner imports, can import it too."""

from __future__ import annotations

import operator
from typing import Final

# Final, so that a type checker reads box[DTYPE] of a plan.Box as a str.
KEY: Final = 0
DTYPE: Final = 1
GLOBAL_SHAPE: Final = 2
OFFSETS: Final = 3
SHAPE: Final = 4

# Getters, in C, for the passes over hundreds of thousands of boxes.
key_of = operator.itemgetter(KEY)
offsets_of = operator.itemgetter(OFFSETS)
shape_of = operator.itemgetter(SHAPE)
tensor_of = operator.itemgetter(KEY, DTYPE, GLOBAL_SHAPE)  # which tensor it is of
kind_of = operator.itemgetter(DTYPE, SHAPE)  # what its bytes are counted by
place_of = operator.itemgetter(slice(OFFSETS, None))  # (offsets, shape)

__all__ = ["DTYPE", "GLOBAL_SHAPE", "KEY", "OFFSETS", "SHAPE", "key_of", "kind_of",
           "offsets_of", "place_of", "shape_of", "tensor_of"]
