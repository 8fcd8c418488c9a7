"""What a Checkpointer does with its save pipeline besides saving: the
staging memory, waiting, and the context manager (checkpointer.py has the rest)."""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError

if TYPE_CHECKING:
    from typing import Self

    from .saving.pipeline import SavePipeline


class CheckpointerBase:
    _pipeline: SavePipeline
    allow_pickle: bool

    def close(self, *, abort: bool = False) -> None:
        raise NotImplementedError

    def prepare_staging(self, state: Any) -> int:
        """Allocate and fault in the staging memory that saves of `state` take
        (in this process's shared memory with fastpersistd), so that the first
        save() stalls no longer than the later ones; see SavePipeline.prepare_staging.
        Call it once before the training loop, with the state you will save
        (its values do not matter). Returns the bytes of staging ready: 0 for
        a distributed job, whose ranks learn their parts only at each save."""
        return self._pipeline.prepare_staging(state, allow_pickle=self.allow_pickle)

    def wait(self) -> None:
        """Block until every save so far is durable; raise if one failed."""
        self._pipeline.wait()
        self._pipeline.raise_unobserved_failure()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: abandon the save on KeyboardInterrupt/SystemExit,
        # finish it otherwise, and let the original error propagate.
        try:
            self.close(abort=not issubclass(exc_type, Exception))
        except CheckpointError as close_error:
            warnings.warn(f"checkpoint save failed while leaving on an error: {close_error}",
                          RuntimeWarning, stacklevel=2)

    @property
    def staging_bytes(self) -> int:
        """Host memory held for snapshots (reused by the next save)."""
        return self._pipeline.staging_bytes


__all__ = ["CheckpointerBase"]
