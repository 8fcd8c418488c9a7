"""The S3 client of the tier: boto3/botocore, configured the standard AWS way.

Credentials, region and endpoint come from where every AWS tool finds them:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE,
~/.aws/config and ~/.aws/credentials, instance and container roles,
AWS_REGION / AWS_DEFAULT_REGION, and AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3,
or `endpoint_url` in a profile) for an S3-compatible store. `endpoint_url=`
overrides the endpoint explicitly. Signing is botocore's.

Why boto3: botocore's standard retry mode retries throttling and transient
errors a bounded number of times with jittered exponential backoff; it
speaks conditional puts (If-None-Match) and is what S3-compatible stores
test against. Against the
local moto server, obstore (Rust) uploaded no faster (73-87 vs 73-97 MiB/s
for 256 MiB, 4-16 parts in flight; moto is the bottleneck either way) and
would add a second credential chain. boto3 is an optional dependency (the
`tier` extra), imported only when a tier is used. Uploads go part by part
through parts.py (not s3transfer, which can neither check the bytes it reads
nor take up an upload a killed uploader left open).

Every request retries FASTPERSIST_TIER_ATTEMPTS times in all, each waiting at
most FASTPERSIST_TIER_TIMEOUT seconds for the store's answer; an error that
remains is translated into a CheckpointError (tier_error) naming what was
being done.

Torch-free: the daemon imports this module.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from ..errors import (
    BucketNotFoundError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    StoreCredentialsError,
    TierError,
)
from ..knobs import current as current_knobs
from .url import TierURL

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_PRECONDITION = {"PreconditionFailed", "412"}
# A conditional write that raced another one (S3 asks the client to retry).
_CONFLICT = {"ConditionalRequestConflict", "409"}


def _boto() -> tuple[Any, Any]:
    try:
        import boto3
        import botocore.config
    except ImportError as exc:
        raise TierError(f"the object-store tier needs boto3 ({exc}): "
                        "pip install 'fastpersist[tier]'") from None
    return boto3, botocore.config


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def tier_error(exc: BaseException, what: str) -> CheckpointError:
    """The CheckpointError for a failed request while doing `what`."""
    if isinstance(exc, CheckpointError):
        return exc
    # botocore's exceptions by name: botocore is imported only with a tier.
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return StoreCredentialsError(
            f"{what}: no credentials for the object store ({exc}); set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials, an instance "
            "role), and AWS_ENDPOINT_URL for an S3-compatible store")
    code = error_code(exc)
    if code == "NoSuchBucket":
        return BucketNotFoundError(f"{what}: the bucket does not exist (NoSuchBucket)")
    if code in _NOT_FOUND:
        return CheckpointNotFoundError(f"{what}: not found ({code})")
    if code in _DENIED:
        return CheckpointPermissionError(f"{what}: permission denied ({code})")
    return TierError(f"{what}: {exc}")


class S3:
    """One boto3 client (thread-safe) and the transfer settings of the knobs."""

    def __init__(self, endpoint_url: str | None = None) -> None:
        boto3, config = _boto()
        k = current_knobs()
        self.concurrency = k.tier_concurrency
        self.part_bytes = k.tier_part_bytes
        self.endpoint_url = endpoint_url
        cfg = config.Config(
            retries={"max_attempts": k.tier_attempts, "mode": "standard"},
            max_pool_connections=self.concurrency + 4,
            connect_timeout=min(10, k.tier_timeout), read_timeout=k.tier_timeout,
            tcp_keepalive=True,
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url,
                                                     config=cfg)
        self.conditional_puts = True  # False once the store refused If-None-Match

    # -- objects -----------------------------------------------------------

    def get(self, url: TierURL, name: str, limit: int) -> bytes | None:
        """The object `name` under `url`, at most `limit` bytes; None if absent."""
        got = self.get_with_metadata(url, name, limit)
        return None if got is None else got[0]

    def get_with_metadata(self, url: TierURL, name: str, limit: int
                          ) -> tuple[bytes, dict[str, str]] | None:
        """As get(), with the object's user metadata."""
        key = url.key(name)
        try:
            response = self.client.get_object(Bucket=url.bucket, Key=key)
        except Exception as exc:
            if error_code(exc) in _NOT_FOUND - {"NoSuchBucket"}:
                return None
            raise tier_error(exc, f"reading s3://{url.bucket}/{key}") from exc
        body = response["Body"]
        try:
            if response.get("ContentLength", 0) > limit:
                raise TierError(f"s3://{url.bucket}/{key} is {response['ContentLength']} "
                                f"bytes, more than the {limit} this version reads")
            return bytes(body.read()), dict(response.get("Metadata") or {})
        except Exception as exc:
            raise tier_error(exc, f"reading s3://{url.bucket}/{key}") from exc
        finally:
            body.close()

    def exists(self, url: TierURL, name: str) -> bool:
        """Whether object `name` under `url` exists (a HEAD)."""
        key = url.key(name)
        try:
            self.client.head_object(Bucket=url.bucket, Key=key)
        except Exception as exc:
            if error_code(exc) in _NOT_FOUND - {"NoSuchBucket"}:
                return False
            raise tier_error(exc, f"looking for s3://{url.bucket}/{key}") from exc
        return True

    def put_new(self, url: TierURL, name: str, data: bytes,
                metadata: dict[str, str] | None = None) -> bool:
        """Create object `name` under `url` only if it does not exist (a
        conditional put, If-None-Match: *). False if it exists. A store that
        does not support conditional puts gets a check and a plain put (racy:
        say so in its documentation)."""
        key = url.key(name)
        if self.conditional_puts:
            try:
                self.client.put_object(Bucket=url.bucket, Key=key, Body=data, IfNoneMatch="*",
                                       Metadata=metadata or {})
                return True
            except Exception as exc:
                code = error_code(exc)
                if code in _PRECONDITION or code in _CONFLICT:
                    return False
                if code not in ("NotImplemented", "501"):
                    raise tier_error(exc, f"writing s3://{url.bucket}/{key}") from exc
                self.conditional_puts = False
        if self.get(url, name, len(data) + 1) is not None:
            return False
        self.put(url, name, data, metadata)
        return True

    def put(self, url: TierURL, name: str, data: bytes,
            metadata: dict[str, str] | None = None) -> None:
        key = url.key(name)
        try:
            self.client.put_object(Bucket=url.bucket, Key=key, Body=data,
                                   Metadata=metadata or {})
        except Exception as exc:
            raise tier_error(exc, f"writing s3://{url.bucket}/{key}") from exc

    # -- multipart uploads part by part (parts.py) ---------------------------------

    def start_upload(self, url: TierURL, name: str, metadata: dict[str, str]) -> str:
        key = url.key(name)
        try:
            return str(self.client.create_multipart_upload(
                Bucket=url.bucket, Key=key, Metadata=metadata)["UploadId"])
        except Exception as exc:
            raise tier_error(exc, f"starting an upload of s3://{url.bucket}/{key}") from exc

    def unfinished_upload(self, url: TierURL, name: str
                          ) -> tuple[str, dict[int, tuple[str, int]]] | None:
        """The newest multipart upload of url/name still open (its uploader
        stopped: a crash, a kill) and its parts: (upload id, {number: (ETag,
        size)}); None if there is none."""
        key = url.key(name)
        try:
            found = [(stamp, upload_id) for k, upload_id, stamp in self._uploads(url.bucket, key)
                     if k == key]
            if not found:
                return None
            upload_id = max(found)[1]
            parts: dict[int, tuple[str, int]] = {}
            paginator = self.client.get_paginator("list_parts")
            for page in paginator.paginate(Bucket=url.bucket, Key=key, UploadId=upload_id):
                for p in page.get("Parts", []):
                    parts[int(p["PartNumber"])] = (str(p["ETag"]), int(p["Size"]))
        except Exception as exc:
            if error_code(exc) == "NoSuchUpload":  # finished or aborted meanwhile
                return None
            raise tier_error(exc, f"listing the parts of s3://{url.bucket}/{key}") from exc
        return upload_id, parts

    def upload_part(self, url: TierURL, name: str, upload_id: str, number: int,
                    body: bytes) -> dict[str, Any]:
        """Part `number` (from 1); what complete_upload needs of it."""
        key = url.key(name)
        try:
            out = self.client.upload_part(Bucket=url.bucket, Key=key, UploadId=upload_id,
                                          PartNumber=number, Body=body)
        except Exception as exc:
            raise tier_error(exc, f"uploading part {number} of s3://{url.bucket}/{key}"
                             ) from exc
        return {"PartNumber": number, "ETag": out["ETag"]}

    def complete_upload(self, url: TierURL, name: str, upload_id: str,
                        parts: list[dict[str, Any]]) -> None:
        key = url.key(name)
        try:
            self.client.complete_multipart_upload(
                Bucket=url.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": sorted(parts, key=lambda p: p["PartNumber"])})
        except Exception as exc:
            raise tier_error(exc, f"completing the upload of s3://{url.bucket}/{key}") from exc

    def read_range(self, url: TierURL, name: str, offset: int, length: int,
                   consume: Callable[[Any], None]) -> None:
        """One ranged GET of bytes [offset, offset+length) of object `name`;
        consume(body) reads the streaming body (readinto). EOFError if the
        object ends first."""
        key = url.key(name)
        if length == 0:
            return
        try:
            body = self.client.get_object(Bucket=url.bucket, Key=key,
                                          Range=f"bytes={offset}-{offset + length - 1}")["Body"]
        except Exception as exc:
            if error_code(exc) in ("InvalidRange", "416"):
                raise EOFError(f"{name} ends before byte {offset}") from None
            raise tier_error(exc, f"reading s3://{url.bucket}/{key}") from exc
        try:
            consume(body)
        except EOFError:
            raise
        except Exception as exc:
            raise tier_error(exc, f"reading s3://{url.bucket}/{key}") from exc
        finally:
            body.close()

    def read_into(self, url: TierURL, name: str, offset: int, buf: memoryview) -> None:
        """Fill `buf` with the bytes of object `name` from `offset` (one ranged
        GET, read straight into `buf`). EOFError if the object ends first."""
        self.read_range(url, name, offset, len(buf),
                        lambda body: read_exact(body, buf, f"{name} at byte {offset}"))

    def objects(self, url: TierURL) -> Iterator[tuple[str, int, float]]:
        """(key, size, last modified) of every object below `url`."""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=url.bucket, Prefix=url.dir_prefix):
                for obj in page.get("Contents", []):
                    yield obj["Key"], int(obj["Size"]), _stamp(obj.get("LastModified"))
        except Exception as exc:
            raise tier_error(exc, f"listing {url}") from exc

    def delete(self, bucket: str, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            try:
                out = self.client.delete_objects(Bucket=bucket,
                                                 Delete={"Objects": batch, "Quiet": True})
            except Exception as exc:
                raise tier_error(exc, f"deleting from s3://{bucket}") from exc
            errors = out.get("Errors") or []
            if errors:
                e = errors[0]
                raise TierError(f"deleting s3://{bucket}/{e.get('Key')}: {e.get('Code')} "
                                f"{e.get('Message', '')}")

    def multipart_uploads(self, url: TierURL) -> Iterator[tuple[str, str, float]]:
        """(key, upload id, initiated) of the multipart uploads begun below `url`."""
        try:
            yield from self._uploads(url.bucket, url.dir_prefix)
        except Exception as exc:
            raise tier_error(exc, f"listing multipart uploads under {url}") from exc

    def _uploads(self, bucket: str, prefix: str) -> Iterator[tuple[str, str, float]]:
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for u in page.get("Uploads", []):
                yield u["Key"], u["UploadId"], _stamp(u.get("Initiated"))

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            if error_code(exc) != "NoSuchUpload":
                raise tier_error(exc, f"aborting the upload of s3://{bucket}/{key}") from exc


def read_exact(body: Any, view: memoryview, what: str) -> None:
    """Fill `view` from a streaming body; EOFError if it ends first."""
    got, n = 0, len(view)
    while got < n:
        k = body.readinto(view[got:])
        if not k:
            raise EOFError(f"{what}: the object ends {n - got} bytes early")
        got += k


def _stamp(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else 0.0


_default: dict[tuple[str | None, ...], S3] = {}
_default_lock = threading.Lock()
_ENVIRONMENT = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def client_for(endpoint_url: str | None = None) -> S3:
    """A process-wide S3 client per endpoint (None: the standard AWS
    configuration), made again when the environment that configures it changes."""
    key = (endpoint_url, *(os.environ.get(name) for name in _ENVIRONMENT))
    with _default_lock:
        s3 = _default.get(key)
        if s3 is None:
            s3 = _default[key] = S3(endpoint_url)
        return s3
