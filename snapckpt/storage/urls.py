"""What counts as an object store URL, and the check of its shape (only :mod:`snapckpt.errors` imported: the
options, the storage factory and the remote store all need it)."""
from __future__ import annotations

import posixpath
import re
from typing import Optional, Tuple

from snapckpt.errors import RemoteURLError

__all__ = ["is_remote_url", "check_remote_url", "url_scheme", "shown_url"]

# a scheme of two or more letters and ':/': also what pathlib leaves of a URL (Path("s3://b/r") is "s3:/b/r")
_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]+):/")


# what a message must not echo: user info ("user:secret@", "token@") where a host would start, and query options
_USERINFO = re.compile(r"(?:^|(?<=[/\s]))[^/@\s]+@")
_QUERY = re.compile(r"\?.*$", re.S)


def shown_url(text: str) -> str:
    """``text`` (a URL, a mangled one such as ``s3:/key:secret@bucket/run``, or a path) as a message may show it:
    user info before an ``@`` and query options replaced by ``***``."""
    return _QUERY.sub("?***", _USERINFO.sub("***@", text))


def url_scheme(text: object) -> Optional[str]:
    """The scheme of ``text`` when it is a URL or what ``pathlib`` left of one (``"s3"`` for ``s3://b/r`` and
    ``s3:/b/r``); ``None`` for a path (``a:b/c``, ``./s3://x``) or a non-``str``."""
    m = _SCHEME.match(text) if isinstance(text, str) else None
    return m.group(1) if m else None


def is_remote_url(text: str) -> bool:
    """Whether ``text`` looks like ``scheme://...`` with a scheme of two or more characters."""
    head, sep, _ = text.partition("://")
    return bool(sep) and len(head) >= 2 and head.replace("+", "").replace("-", "").replace(".", "").isalnum()


def check_remote_url(url: object, role: str) -> Tuple[str, str]:
    """Check the shape of an object store URL without any request: ``(scheme, "scheme://bucket/prefix")``,
    trailing slashes dropped (``"s3://"`` stays ``"s3://"`` in messages, not ``"s3:"``).

    Args:
        url: the URL as the user gave it.
        role: what the URL is, for messages (``"remote_dir"``, ``"checkpoint_dir"``, ``"URL"``).

    Raises:
        RemoteURLError: not a ``str`` URL, a ``file://`` or ``http(s)://`` URL, credentials or query options in it,
            no bucket or no prefix, or an empty, ``.`` or ``..`` segment in the prefix (``s3://b//run1``); the
            message names the URL (never a credential), the cause and the fix.
    """
    if not isinstance(url, str) or not is_remote_url(url.strip()):
        shown = shown_url(url) if isinstance(url, str) else url
        raise RemoteURLError(f"{role} {shown!r} is not a URL: {role} must be an object store URL such as "
                             "'s3://bucket/run1'")
    scheme, _, rest = url.strip().partition("://")
    rest = rest.rstrip("/")
    full = f"{scheme}://{rest}"
    bucket, _, prefix = rest.partition("/")
    if scheme.lower() in ("file", "local"):  # fsspec's local filesystem: a directory, not a store
        path = "/" + rest.lstrip("/")
        raise RemoteURLError(
            f"{role} {full!r} is a {scheme}:// URL, a local path: pass the plain path {path!r} (a "
            "checkpoint directory, or a shared filesystem mounted on every node); remote storage is an "
            "object store URL such as s3://bucket/run1")
    if scheme.lower() in ("http", "https"):  # fsspec's HTTP filesystem reads only: no probe, upload or commit
        raise RemoteURLError(
            f"{role} {shown_url(full)!r} is an {scheme}:// URL, which fsspec can only read from: name the store "
            f"by its protocol and give the endpoint apart, e.g. s3://bucket/run1 with "
            f"AWS_ENDPOINT_URL={scheme}://{bucket.split('@')[-1].split('?')[0] or 'host:port'} (MinIO, Ceph and other S3-compatible "
            "stores; docs/remote.md)")
    if "@" in bucket or "?" in rest:  # credentials or options pasted into the URL: never echo them
        raise RemoteURLError(
            f"{role} for {scheme}:// carries credentials or query options in the URL; pass only "
            f"{scheme}://bucket/prefix and give credentials through the environment (docs/remote.md)")
    segments = prefix.split("/")
    if bucket and prefix.strip("/") and any(seg in ("", ".", "..") for seg in segments):
        # s3fs and the S3 API disagree on such keys ("a//b" is written, then listed as "a/b" or not at all): the
        # parts would be uploaded and never found, so no checkpoint would ever commit
        clean = posixpath.normpath("/" + "/".join(seg for seg in segments if seg)).lstrip("/") or "run1"
        raise RemoteURLError(
            f"{role} {full!r} has an empty, '.' or '..' path segment (a doubled '/'?): object stores do not "
            f"normalize keys, so its checkpoints could not be listed back; pass {scheme}://{bucket}/{clean}")
    if not bucket or not prefix.strip("/"):
        # a bucket root is shared with other data: the clean-up of interrupted uploads would touch it
        raise RemoteURLError(
            f"{role} {full!r} names no {'bucket' if not bucket else 'prefix in the bucket'}: pass "
            f"{scheme or 's3'}://bucket/prefix (one prefix per job, e.g. {scheme or 's3'}://"
            f"{bucket or 'bucket'}/run1)")
    return scheme, full
