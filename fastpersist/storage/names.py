"""The one rule for a component of a checkpoint's path: what every place a
checkpoint goes can name.

A checkpoint lives on a local file system and, with a tier, under an object
key (tier/url.py). The daemon refuses at Begin (daemon/paths.py) any path
the tier could not name later: a checkpoint it accepted must be uploadable,
since by the time the tier sees it the checkpoint is committed and nothing
may fail any more. The tier's keys and listings apply the same rule.

Refused: "", "." and ".." (a key must never climb out of its prefix, nor a
path out of its root), "/" inside a component, a backslash (a path separator
to half of the tools that read keys), control characters (S3 lists keys in
XML 1.0, which cannot carry most of them), and what is not UTF-8 (a local
name of undecodable bytes; an object key is UTF-8).

Torch-free.
"""

from __future__ import annotations


def component_problem(part: str) -> str | None:
    """Why `part` cannot be one component of a checkpoint's path; None if it can."""
    if part in ("", ".", ".."):
        return "an empty, '.' or '..' component"
    if "/" in part:
        return "a '/' inside a component"
    if "\\" in part:
        return "a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in part):
        return "a control character"
    try:
        part.encode("utf-8")
    except UnicodeEncodeError:
        return "bytes that are not UTF-8"
    return None


def path_problem(relative: str) -> str | None:
    """The first problem of the components of `relative` ("a/b/c"); None if none."""
    for part in relative.split("/"):
        problem = component_problem(part)
        if problem is not None:
            return f"{part!r} has {problem}"
    return None


__all__ = ["component_problem", "path_problem"]
