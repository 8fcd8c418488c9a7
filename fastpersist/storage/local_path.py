"""The one check that a save's target is a local (or shared-filesystem) path.

A URL handed to a save (`s3://bucket/x`, `gs://...`, `file:///x`) is not a
path: made absolute, `s3://bucket/x` becomes the local directory
`./s3:/bucket/x`, and the save would report success for a checkpoint that
never reached the store. Every entry point that writes a checkpoint turns
its path into an absolute one here, so none can forget the check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import UnsupportedPathError

# RFC 3986's scheme, then "://": what every URL a user would pass looks like.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def checkpoint_path(path: str | os.PathLike[str], what: str = "a checkpoint") -> Path:
    """`path` made absolute (not resolved: a symlink stays a symlink), or
    UnsupportedPathError if it is a URL. `what` names the path in the error
    ("a checkpoint", "the Checkpointer's root")."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text)
    if match:
        scheme = match.group(1).lower()
        if scheme == "s3":
            hint = ("save() and async_save() in one process write s3://BUCKET/PREFIX (in lower "
                    "case) straight to the store; fastpersistd and distributed jobs write to a "
                    "filesystem and copy to the store in the background: Checkpointer(root, "
                    f"tier={text!r}), or fastpersistd --tier {text}; fastpersist.load({text!r}) "
                    "reads them back")
        elif scheme == "file":
            hint = f"pass the path itself ({text[len('file://'):] or '/'!r})"
        else:
            hint = (f"fastpersist writes checkpoints to a local or shared filesystem (and copies "
                    f"them to S3-compatible stores with tier='s3://...'); {scheme}:// is not "
                    "supported")
        raise UnsupportedPathError(f"{text!r} is a URL, not a path for {what}: {hint}")
    return Path(os.path.abspath(text))
