"""s3://BUCKET/PREFIX: where a checkpoint, or a directory of them, lives in a store.

A checkpoint directory `step-N` under a tier `s3://B/P` is the objects
`P/step-N/<file>` of bucket B, one per file of the local directory, the
manifest among them. Keys are built only from names that pass the one rule
for a checkpoint's path (storage/names.py): no empty, `.` or `..` component,
so a key never escapes the prefix it was given, and no backslash or control
character. A key found in a listing that breaks the rule (put there by
another tool) is "odd": split_key says so instead of raising.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..storage.names import component_problem

SCHEME = "s3://"


def is_tier_url(path: object) -> bool:
    """Whether `path` names a checkpoint in an object store (an s3:// string)."""
    return isinstance(path, str) and path.startswith(SCHEME)


def _check_part(part: str, text: str) -> None:
    problem = component_problem(part)
    if problem is not None:
        raise ValueError(f"{text!r}: {part!r} is not a valid component of an object key "
                         f"({problem})")


@dataclass(frozen=True)
class TierURL:
    bucket: str
    prefix: str = ""  # components joined by "/", no leading or trailing slash

    @classmethod
    def parse(cls, text: str) -> TierURL:
        """s3://BUCKET[/PREFIX]; a trailing slash is ignored. ValueError otherwise."""
        if not is_tier_url(text):
            raise ValueError(f"{text!r} is not an s3:// URL (s3://BUCKET/PREFIX)")
        bucket, _, prefix = text[len(SCHEME):].partition("/")
        if not bucket or "/" in bucket:
            raise ValueError(f"{text!r} names no bucket (s3://BUCKET/PREFIX)")
        prefix = prefix.rstrip("/")
        if prefix:
            for part in prefix.split("/"):
                _check_part(part, text)
        return cls(bucket, prefix)

    def child(self, *names: str) -> TierURL:
        """The URL of `names` (each one component, or a relative path) below this one."""
        parts = [p for name in names for p in name.split("/")]
        for part in parts:
            _check_part(part, "/".join(names))
        return TierURL(self.bucket, "/".join([self.prefix, *parts] if self.prefix else parts))

    def key(self, name: str) -> str:
        """The object key of file `name` in this directory."""
        return self.dir_prefix + name

    @property
    def dir_prefix(self) -> str:
        """The key prefix of everything below this URL ("" at the bucket's root)."""
        return self.prefix + "/" if self.prefix else ""

    @property
    def name(self) -> str:
        return self.prefix.rpartition("/")[2]

    @property
    def parent(self) -> TierURL:
        return TierURL(self.bucket, self.prefix.rpartition("/")[0])

    def split_key(self, key: str) -> tuple[str, ...] | None:
        """The components of `key` (an object key below this URL) relative to
        it; None for a key that names no valid path (an odd key: "a//b",
        "a/../b", a backslash), which no key made by child() or key() is."""
        if not key.startswith(self.dir_prefix):
            return None
        parts = tuple(key[len(self.dir_prefix):].split("/"))
        if any(component_problem(p) is not None for p in parts):
            return None
        return parts

    def relative(self, key_prefix: str) -> str:
        """`key_prefix` (below this URL) relative to it."""
        return key_prefix[len(self.dir_prefix):].strip("/")

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else \
            f"{SCHEME}{self.bucket}"
