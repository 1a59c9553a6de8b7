"""Object stores through fsspec: ``s3://``, ``hf://``, ``gs://``, ``az://`` and the rest.

fsspec is the file-system layer DCP and huggingface_hub already use; each protocol
lives in its own package (s3fs, huggingface_hub, gcsfs, adlfs), installed with an
extra (``pip install 'ckpttool[s3]'``). Credentials come from where those packages
look (environment, profiles, ``huggingface-cli login``); ckpttool never reads or
shows them. Endpoints and options come from fsspec's configuration, e.g.
``FSSPEC_S3_ENDPOINT_URL`` for an S3-compatible server.

``s3://`` ranges are GetObject calls with ``IfMatch`` set to the ETag of first
contact, and their ``ContentRange``, length and ETag are checked as HTTP's are; the
other protocols read with ``cat_file(path, start, end)``, checked for length (their
identity is the one ``info`` gives: ETag, generation, blob id). ``hf://`` paths are
``hf://user/repo[@revision]/path`` (``hf://datasets/user/repo/...`` for datasets), as
huggingface_hub's ``HfFileSystem`` reads them.
"""

from __future__ import annotations

import importlib
import os
import re
import urllib.parse
from typing import Any

from ...errors import CkptError, InputNotFoundError
from .base import RemoteSource, Stat, TransientError, check_changed, redact, with_retries
from .http import HttpSource

# scheme -> (module fsspec needs for it, the extra or package that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "pip install 'ckpttool[s3]'"),
    "s3a": ("s3fs", "pip install 'ckpttool[s3]'"),
    "hf": ("huggingface_hub", "pip install 'ckpttool[hf]'"),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
    "abfss": ("adlfs", "pip install adlfs"),
    "oci": ("ocifs", "pip install ocifs"),
    "oss": ("ossfs", "pip install ossfs"),
    "webhdfs": ("fsspec", "pip install fsspec"),
    "sftp": ("paramiko", "pip install paramiko"),
    "ssh": ("paramiko", "pip install paramiko"),
}
STORE_SCHEMES = tuple(PACKAGES)
TAG_KEYS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "blob_id", "last_commit")
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class StoreSource(RemoteSource):
    """Files of an fsspec file system, read by ranges (see the module docstring)."""

    name = "store"

    def __init__(self, scheme: str) -> None:
        super().__init__(scheme)
        module, install = PACKAGES.get(scheme, ("fsspec", "pip install fsspec"))
        try:
            importlib.import_module("fsspec")
            importlib.import_module(module)
        except ImportError:
            raise CkptError(
                f"reading {scheme}:// paths needs the package {module}",
                hint=install,
            ) from None
        self._install = install
        self._fs: Any = None
        self._pid = -1
        self.fs  # noqa: B018  (made now: a protocol that cannot be set up fails here)
        self._listing: dict[str, list[str]] = {}
        # hf://: file bytes by validated ranged GETs of the file's resolve URL (HfFileSystem's
        # own files read ahead in blocks of megabytes; inspect needs a few KB)
        self._http = _HubHttp(self) if scheme == "hf" else None
        self._urls: dict[str, str] = {}

    @property
    def fs(self) -> Any:
        """The fsspec file system, made again in a forked child (the readers' prescan):
        async file systems (s3fs) refuse to be used across a fork."""
        if self._pid != os.getpid():
            import fsspec

            try:
                self._fs = fsspec.filesystem(self.scheme, skip_instance_cache=self._pid != -1)
            except (ImportError, ValueError) as exc:
                raise CkptError(
                    f"cannot read {self.scheme}:// paths ({exc})", hint=self._install
                ) from None
            self._pid = os.getpid()
        return self._fs

    # -- paths: fsspec's own (no scheme) and ours (with it) --------------------------
    def _bare(self, path: str) -> str:
        return path.split("://", 1)[1].rstrip("/") if "://" in path else path.rstrip("/")

    def _call(self, what: str, path: str, call: Any) -> Any:
        """An fsspec call with its errors as ours: missing -> exit 2 naming the path,
        denied -> a hint about credentials, network trouble retried."""

        def attempt() -> Any:
            try:
                return call()
            except FileNotFoundError:
                raise InputNotFoundError("no such file or folder", path=redact(path)) from None
            except PermissionError:
                raise CkptError(
                    "access denied",
                    path=redact(path),
                    hint="check the credentials in the environment or profile",
                ) from None
            except CkptError:
                raise
            except (ConnectionError, TimeoutError) as exc:
                raise TransientError(f"{type(exc).__name__} ({exc})") from None
            except OSError as exc:
                status = getattr(getattr(exc, "response", None), "status_code", None)
                if status == 404:
                    raise InputNotFoundError(
                        "no such file, folder or repository", path=redact(path)
                    ) from None
                if status in (401, 403):
                    raise CkptError(
                        f"access denied or no such repository (HTTP {status})",
                        path=redact(path),
                        hint="check the name and the token (HF_TOKEN, huggingface-cli login)",
                    ) from None
                if status in (429, 500, 502, 503, 504):
                    raise TransientError(f"HTTP {status}") from None
                if self.scheme in ("s3", "s3a") and _is_changed(exc):
                    raise CkptError(
                        "changed while being read (ETag differs from first contact)",
                        path=redact(path),
                        hint="read it again once it is written",
                    ) from None
                raise CkptError(f"cannot {what} ({_short(exc)})", path=redact(path)) from None
            except ValueError as exc:
                raise CkptError(f"cannot {what} ({_short(exc)})", path=redact(path)) from None

        return with_retries(attempt, path, what)

    # -- primitives --------------------------------------------------------------------
    def _stat(self, path: str) -> Stat:
        info = self._call("reach it", path, lambda: self.fs.info(self._bare(path)))
        self.count(0, 1)
        if info.get("type") == "directory":
            raise CkptError("is a folder, not a file", path=redact(path))
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise CkptError("the store gives no size for it", path=redact(path))
        tags = tuple((k.lower(), str(info[k])) for k in TAG_KEYS if info.get(k) is not None)
        return Stat(size, tags)

    def exists(self, path: str) -> bool:
        if path.rstrip("/") in self._stats:
            return True
        found = self._call("reach it", path, lambda: self.fs.exists(self._bare(path)))
        self.count(0, 1)
        return bool(found)

    def isdir(self, path: str) -> bool:
        if path in self._stats:
            return False
        found = self._call("reach it", path, lambda: self.fs.isdir(self._bare(path)))
        self.count(0, 1)
        return bool(found)

    def listdir(self, path: str) -> list[str]:
        key = path.rstrip("/")
        names = self._listing.get(key)
        if names is None:
            entries = self._call(
                "list the folder", path, lambda: self.fs.ls(self._bare(path), detail=False)
            )
            self.count(0, 1)
            names = self._listing[key] = sorted(
                {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""}
            )
        return list(names)

    def _fetch_into(self, path: str, view: memoryview, offset: int, stat: Stat) -> None:
        if self._http is not None:
            url = self._urls.get(path)
            if url is None:
                url = self._urls[path] = self.fs.url(self._bare(path))
            self._http._stats.setdefault(url, Stat(stat.size))
            try:
                self._http._fetch_into(url, view, offset, self._http._stats[url])
            except CkptError as exc:  # shown with the hf:// path, not the resolve URL
                raise CkptError(exc.message, path=redact(path), hint=exc.hint) from None
            return
        if self.scheme in ("s3", "s3a"):
            data = self._call("read", path, lambda: self._s3_range(path, offset, len(view), stat))
        else:
            data = self._call(
                "read",
                path,
                lambda: self.fs.cat_file(self._bare(path), start=offset, end=offset + len(view)),
            )
            self.count(len(data), 1)
        if len(data) != len(view):
            raise CkptError(
                f"asked for {len(view)} bytes at {offset}, the store sent {len(data)}",
                path=redact(path),
            )
        view[:] = data

    def _s3_range(self, path: str, offset: int, size: int, stat: Stat) -> bytes:
        """One GetObject of bytes ``offset..offset+size-1`` of the version seen first."""
        from fsspec.asyn import sync

        bucket, key, version = self.fs.split_path(self._bare(path))
        tags = dict(stat.tag)
        extra: dict[str, str] = {}
        if "etag" in tags:
            extra["IfMatch"] = tags["etag"]
        if version:
            extra["VersionId"] = version
        last = offset + size - 1

        async def get() -> tuple[dict[str, Any], bytes]:
            response = await self.fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={offset}-{last}", **extra
            )
            try:
                return response, await response["Body"].read()
            finally:
                response["Body"].close()

        response, data = sync(self.fs.loop, get)
        self.count(len(data), 1)
        got = response.get("ContentRange") or ""
        match = CONTENT_RANGE.match(got)
        now = [("etag", str(response["ETag"]))] if response.get("ETag") else []
        check_changed(path, stat, Stat(int(match.group(3)) if match else stat.size, tuple(now)))
        if match is None or (int(match.group(1)), int(match.group(2))) != (offset, last):
            raise CkptError(
                f"asked for bytes {offset}-{last}, the store sent ContentRange {got!r}",
                path=redact(path),
            )
        if len(data) < size:
            raise TransientError(f"the store sent {len(data)} of {size} bytes")
        return data


class _HubHttp(HttpSource):
    """The ranged GETs of an ``hf://`` source: the Hub's headers (the token) go to the
    Hub's own host only, never to the storage a resolve URL redirects to."""

    def __init__(self, owner: StoreSource) -> None:
        super().__init__("https")
        self.owner = owner
        self.host = urllib.parse.urlsplit(owner.fs.endpoint).netloc

    def count(self, nbytes: int, requests: int = 1) -> None:
        self.owner.count(nbytes, requests)

    def headers_for(self, parts: urllib.parse.SplitResult) -> dict[str, str]:
        if parts.netloc != self.host:
            return {}
        from huggingface_hub.utils import build_hf_headers

        return dict(build_hf_headers(token=self.owner.fs.token))


def _is_changed(exc: OSError) -> bool:
    text = str(exc)
    # s3fs turns a failed IfMatch (412 PreconditionFailed) into an OSError whose text
    # is the service's: "At least one of the pre-conditions you specified did not hold"
    return any(m in text for m in ("PreconditionFailed", "pre-conditions you specified"))


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__
