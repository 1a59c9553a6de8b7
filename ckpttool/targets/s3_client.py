"""S3 multipart uploads: the calls an output written in parts makes, each one checked.

The sink every writer of an ``s3://`` output goes through, from one process or from
many (:mod:`ckpttool.targets.s3` says who calls what):

- :meth:`S3Uploads.create` starts a multipart upload of one key and gives its id;
- :meth:`S3Uploads.upload_part` uploads part ``number`` (1..10,000) of an upload from
  any process that holds the id; a part number uploaded again replaces the first;
- :meth:`S3Uploads.list_parts` says what is there (a rerun uploads the rest);
- :meth:`S3Uploads.complete` makes the object visible under its key, all at once;
- :meth:`S3Uploads.abort` drops an upload and the parts it holds.

Checks: every part is sent with its ``Content-MD5`` (the store refuses a part whose
bytes changed on the way) and the ETag it answers must be that MD5 (a store that
answers otherwise stored something else, or is not keeping its word: refused). The
completed object's size and ETag (the MD5 of the parts' MD5s, ``-N``) are checked
with a HEAD. Stores that encrypt with KMS answer other ETags: refused, with a hint.

Calls go through s3fs's aiobotocore client, the one inputs read with: credentials
from the AWS chain, ``FSSPEC_S3_ENDPOINT_URL`` for S3-compatible stores; none is ever
shown. botocore retries throttling and 5xx answers itself; connection errors are
retried here with backoff (:func:`~ckpttool.sources.remote.base.with_retries`).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import sources
from ..errors import CkptError
from ..sources.remote import TransientError, redact, with_retries

MAX_PARTS = 10_000  # S3's limits
MIN_PART = 5 << 20  # every part but the last
MAX_PART = 5 << 30


class UploadFailed(CkptError):
    """A call to the store failed after its retries: the upload may be resumed."""


class UploadRefused(CkptError):
    """The store answered something that cannot be right (a wrong ETag or size): the
    upload cannot be trusted and is aborted."""


@dataclass(frozen=True)
class PartDone:
    """One uploaded part: its number, its ETag (quoted, as S3 gives it) and size."""

    number: int
    etag: str
    size: int


def md5_etag(data: bytes | memoryview) -> str:
    """The ETag S3 gives a part (or a single-request object) of these bytes."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


def multipart_etag(parts: Sequence[PartDone]) -> str:
    """The ETag S3 gives a completed multipart object: the MD5 of its parts' MD5s, ``-N``."""
    digest = hashlib.md5(usedforsecurity=False)
    for part in parts:
        digest.update(bytes.fromhex(part.etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(parts)}"'


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key


class S3Uploads:
    """Multipart uploads and the few other calls an output needs, on one S3 endpoint.

    Args:
        scheme: ``s3`` (or ``s3a``): the file system is the one inputs of that scheme
            read through (made again in a forked child).
    """

    def __init__(self, scheme: str = "s3") -> None:
        self.scheme = scheme
        self.requests = 0  # calls made, for tests and benchmarks

    @property
    def fs(self) -> Any:
        return sources.source_for(f"{self.scheme}://x").fs  # type: ignore[attr-defined]

    def url(self, bucket: str, key: str) -> str:
        return f"{self.scheme}://{bucket}/{key}"

    # -- one call, its errors ours ----------------------------------------------------------
    def _call(self, what: str, bucket: str, key: str, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        fs = self.fs
        where = redact(self.url(bucket, key))

        def attempt() -> Any:
            self.requests += 1
            try:
                return sync(fs.loop, fs._call_s3, method, Bucket=bucket, **kwargs)
            except CkptError:
                raise
            except FileNotFoundError as exc:
                raise _missing(exc, where, bucket) from None
            except PermissionError:
                raise CkptError(
                    f"access denied ({what})",
                    path=where,
                    hint="check the credentials in the environment or profile",
                ) from None
            except (ConnectionError, TimeoutError) as exc:
                raise TransientError(f"{type(exc).__name__} ({exc})") from None
            except OSError as exc:
                status = getattr(getattr(exc, "response", None), "status_code", None)
                if status in (429, 500, 502, 503, 504) or _is_transient(exc):
                    raise TransientError(_short(exc)) from None
                raise UploadFailed(f"cannot {what} ({_short(exc)})", path=where) from None
            except Exception as exc:  # botocore's own (endpoint unreachable, bad config)
                if "Connect" in type(exc).__name__ or "Timeout" in type(exc).__name__:
                    raise TransientError(f"{type(exc).__name__} ({_short(exc)})") from None
                raise UploadFailed(f"cannot {what} ({_short(exc)})", path=where) from None

        try:
            return with_retries(attempt, where, what)
        except (UploadFailed, UploadRefused, _NoSuchKey, _NoSuchUpload):
            raise
        except CkptError as exc:
            if exc.message.startswith(f"cannot {what} after"):  # the retries ran out
                raise UploadFailed(exc.message, path=exc.path, hint=exc.hint) from None
            raise

    # -- multipart uploads --------------------------------------------------------------------
    def create(self, bucket: str, key: str) -> str:
        """Start a multipart upload of ``key``; its id."""
        answer = self._call("start the upload", bucket, key, "create_multipart_upload", Key=key)
        return str(answer["UploadId"])

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, data: bytes | memoryview
    ) -> PartDone:
        """Upload part ``number`` (its bytes ``data``), checked: the ETag must be its MD5."""
        digest = hashlib.md5(data, usedforsecurity=False).digest()
        want = f'"{digest.hex()}"'
        answer = self._call(
            f"upload part {number}",
            bucket,
            key,
            "upload_part",
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=bytes(data) if isinstance(data, memoryview) else data,
            ContentMD5=base64.b64encode(digest).decode(),
        )
        etag = str(answer.get("ETag") or "")
        if etag != want:
            raise UploadRefused(
                f"the store answered part {number} with ETag {etag or 'none'}, "
                f"not the MD5 of the {len(data)} bytes sent ({want})",
                path=redact(self.url(bucket, key)),
                hint="a store that encrypts with KMS gives other ETags: not supported",
            )
        return PartDone(number, etag, len(data))

    def list_parts(self, bucket: str, key: str, upload_id: str) -> dict[int, PartDone] | None:
        """The parts an upload holds, by number; None when the upload is gone."""
        parts: dict[int, PartDone] = {}
        marker = 0
        while True:
            try:
                answer = self._call(
                    "list the upload's parts",
                    bucket,
                    key,
                    "list_parts",
                    Key=key,
                    UploadId=upload_id,
                    PartNumberMarker=marker,
                )
            except _NoSuchUpload:
                return None
            for item in answer.get("Parts") or []:
                number = int(item["PartNumber"])
                parts[number] = PartDone(number, str(item["ETag"]), int(item["Size"]))
            if not answer.get("IsTruncated"):
                return parts
            marker = int(answer["NextPartNumberMarker"])

    def list_uploads(self, bucket: str, key: str) -> list[str]:
        """The ids of the uploads in progress of exactly ``key``."""
        answer = self._call(
            "list the uploads in progress", bucket, key, "list_multipart_uploads", Prefix=key
        )
        return [str(u["UploadId"]) for u in answer.get("Uploads") or [] if u.get("Key") == key]

    def complete(self, bucket: str, key: str, upload_id: str, parts: Sequence[PartDone]) -> None:
        """Make the upload the object under ``key`` (visible from now on), then check it:
        its size and ETag must be those of the parts."""
        try:
            self._complete(bucket, key, upload_id, parts)
        except _NoSuchUpload:
            pass  # completed by an attempt whose answer was lost: the check below says
        self.check_object(bucket, key, sum(p.size for p in parts), multipart_etag(parts))

    def _complete(self, bucket: str, key: str, upload_id: str, parts: Sequence[PartDone]) -> None:
        self._call(
            "complete the upload",
            bucket,
            key,
            "complete_multipart_upload",
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": p.etag} for p in parts]},
        )

    def abort(self, bucket: str, key: str, upload_id: str) -> None:
        """Drop an upload and its parts (an upload already gone is fine)."""
        try:
            self._call("abort the upload", bucket, key, "abort_multipart_upload",
                       Key=key, UploadId=upload_id)  # fmt: skip
        except _NoSuchUpload:
            pass

    # -- whole objects --------------------------------------------------------------------------
    def put(self, bucket: str, key: str, data: bytes | memoryview) -> PartDone:
        """One PutObject (a small file: atomic as a completed upload is), checked."""
        digest = hashlib.md5(data, usedforsecurity=False).digest()
        want = f'"{digest.hex()}"'
        answer = self._call(
            "write the object",
            bucket,
            key,
            "put_object",
            Key=key,
            Body=bytes(data),
            ContentMD5=base64.b64encode(digest).decode(),
        )
        etag = str(answer.get("ETag") or "")
        if etag != want:
            self.delete(bucket, key)
            raise UploadRefused(
                f"the store answered ETag {etag or 'none'}, not the MD5 of the bytes sent; "
                "the object was deleted",
                path=redact(self.url(bucket, key)),
            )
        self.check_object(bucket, key, len(data), want)
        return PartDone(1, etag, len(data))

    def head(self, bucket: str, key: str) -> tuple[int, str] | None:
        """(size, ETag) of the object under ``key``, or None when there is none."""
        try:
            answer = self._call("look at the object", bucket, key, "head_object", Key=key)
        except _NoSuchKey:
            return None
        return int(answer["ContentLength"]), str(answer.get("ETag") or "")

    def check_object(self, bucket: str, key: str, size: int, etag: str) -> None:
        """The object under ``key`` is ``size`` bytes with ETag ``etag``; otherwise it is
        deleted (never a wrong object under a final key) and the upload refused."""
        found = self.head(bucket, key)
        if found is not None and found == (size, etag):
            return
        if found is not None:
            self.delete(bucket, key)
        got = "no object" if found is None else f"{found[0]} bytes, ETag {found[1]}"
        raise UploadRefused(
            f"the completed object is not what was uploaded ({got}; {size} bytes, "
            f"ETag {etag} planned); it was deleted",
            path=redact(self.url(bucket, key)),
        )

    def get(self, bucket: str, key: str, limit: int = 16 << 20) -> bytes | None:
        """A small object's bytes (a journal), or None when there is none."""
        try:
            answer = self._call("read the object", bucket, key, "get_object", Key=key)
        except _NoSuchKey:
            return None
        body = answer["Body"]
        from fsspec.asyn import sync

        try:
            data = sync(self.fs.loop, body.read, limit + 1)
        finally:
            body.close()
        if len(data) > limit:
            raise CkptError("the object is larger than expected", path=self.url(bucket, key))
        return bytes(data)

    def delete(self, bucket: str, key: str) -> None:
        self._call("delete the object", bucket, key, "delete_object", Key=key)

    def list_names(self, bucket: str, prefix: str) -> list[str]:
        """The names of the objects directly under ``prefix/`` (no deeper)."""
        names: list[str] = []
        token: dict[str, str] = {}
        folder = prefix.rstrip("/") + "/" if prefix else ""
        while True:
            answer = self._call(
                "list the folder", bucket, folder, "list_objects_v2",
                Prefix=folder, Delimiter="/", **token,
            )  # fmt: skip
            names += [str(o["Key"])[len(folder) :] for o in answer.get("Contents") or []]
            if not answer.get("IsTruncated"):
                return sorted(n for n in names if n)
            token = {"ContinuationToken": str(answer["NextContinuationToken"])}

    def has_children(self, bucket: str, prefix: str) -> bool:
        """Objects lie under ``prefix/`` (a folder, as a store shows one)."""
        folder = prefix.rstrip("/") + "/"
        answer = self._call(
            "list the folder", bucket, folder, "list_objects_v2", Prefix=folder, MaxKeys=1
        )
        return bool(answer.get("Contents"))


class _NoSuchKey(CkptError):
    pass


class _NoSuchUpload(CkptError):
    pass


def _missing(exc: FileNotFoundError, where: str, bucket: str) -> CkptError:
    text = str(exc)
    if "NoSuchUpload" in text or "upload does not exist" in text.lower():
        return _NoSuchUpload("the upload is gone", path=where)
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return CkptError(f"no such bucket {bucket!r}", path=where, hint="create it first")
    return _NoSuchKey("no such object", path=where)


def _is_transient(exc: OSError) -> bool:
    text = str(exc)
    return any(
        m in text for m in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout")
    )


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


def env_part_size() -> int | None:
    """``CKPTTOOL_S3_PART_SIZE`` (bytes, or a size with a unit): the part size, for tests
    and S3-compatible stores with other limits; None when unset."""
    from ..sizes import env_size

    return env_size("CKPTTOOL_S3_PART_SIZE")
