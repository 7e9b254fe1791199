"""The storage factory (snapckpt/storage/factory.py): a URL is refused before anything is created, a path
gets the POSIX storage with the fsync setting asked for."""
from __future__ import annotations

import pytest

from snapckpt.errors import CheckpointDirError
from snapckpt.storage import PosixStorage
from snapckpt.storage.factory import check_location, open_storage


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/x", "file:///tmp/x", "hdfs://nn/ckpt", "S3://x",
                                 " s3://lead/space", "s3:/bucket/run"])
def test_factory_refuses_urls(url):
    with pytest.raises(CheckpointDirError, match="is a URL"):
        check_location(url)
    with pytest.raises(CheckpointDirError):
        open_storage(url)


def test_factory_gives_posix_storage_for_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("SNAPCKPT_FAULT_STORAGE", raising=False)
    assert check_location(tmp_path / "ckpt") == str(tmp_path / "ckpt")
    assert check_location("relative/dir:with colon") == "relative/dir:with colon"
    s = open_storage(str(tmp_path), fsync=False, part=(0, 1))
    assert type(s) is PosixStorage and s.fsync is False
    assert type(open_storage()) is PosixStorage and open_storage().fsync is True


@pytest.mark.parametrize("url, words", [("gs://bucket/run1", "not installed (Please install gcsfs"),
                                        ("nope://bucket/run1", "Protocol not known: nope"),
                                        ("file:///tmp/ckpt", "pass the plain path '/tmp/ckpt'"),
                                        ("file://bucket/run1", "pass the plain path '/bucket/run1'")])
def test_checkpointer_refuses_a_url_it_cannot_use_before_creating_anything(url, words, tmp_path, monkeypatch):
    """Case H5: a URL given as the checkpoint directory is remote-only mode (tests/test_remote_s3.py); one that
    fsspec cannot handle (its package not installed, an unknown scheme, no bucket) is refused by name before
    any request; no local folder named ``gs:`` (or ``nope:``, ``file:``) appears in the working directory."""
    from snapckpt import Checkpointer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointDirError, match="remote-only mode") as ei:
        Checkpointer(url)
    assert words in str(ei.value) and repr(url) in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_a_url_through_pathlib_or_an_integration_is_refused_too(tmp_path, monkeypatch):
    """``Path("s3://b/r")`` collapses to ``s3:/b/r``: still a URL. Megatron's registry resolves its
    directory to an absolute path first, which would hide the scheme: it checks before. A plain relative
    path with a colon in a name stays a path."""
    from pathlib import Path

    from snapckpt.integrations.megatron.registry import get_checkpointer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointDirError, match="is a URL"):
        check_location(Path("s3://bucket/run"))
    for url in ("s3://bucket/run", "gs://bucket/run"):
        with pytest.raises(CheckpointDirError, match="is a URL"):
            get_checkpointer(url)
    assert list(tmp_path.iterdir()) == []
    assert check_location("a:b/c") == "a:b/c" and check_location("./s3://x") == "./s3://x"


@pytest.mark.parametrize("url, words", [
    ("gs://b/x", "not installed (Please install gcsfs"),
    ("nope://b/x", "Protocol not known: nope"),
    ("S3://b/x", "URL schemes are lower case"),
    ("ftp://no-such-host.invalid/x", "cannot be reached: gaierror"),  # ftp connects in its constructor
    ("/local/dir", "is not a URL"),
])
def test_remote_store_refuses_unusable_urls_naming_the_fix(url, words):
    """The remote tier's store: a scheme without its fsspec package, an unknown scheme (upper case too), a
    filesystem whose constructor cannot reach its host (ftp://: a bare socket.gaierror before, found by a
    new-user trial) or a plain path is a RemoteStorageError naming the URL."""
    from snapckpt.errors import RemoteStorageError
    from snapckpt.storage.remote import RemoteStore
    with pytest.raises(RemoteStorageError) as ei:
        RemoteStore(url)
    assert words in str(ei.value) and repr(url) in str(ei.value)


@pytest.mark.parametrize("url, words", [
    ("s3://", "names no bucket"),
    ("s3://bucket", "names no prefix in the bucket"),
    ("s3://bucket/", "names no prefix in the bucket"),
    ("s3://KEY:SECRET@bucket/run", "carries credentials"),
    ("s3://bucket/run?secret=x", "carries credentials"),
])
def test_remote_store_needs_a_bucket_and_a_prefix_and_never_echoes_credentials(url, words):
    """``s3://`` became the local relative path ``s3:`` (an IndexError, or a local folder as the 'remote'
    tier); a bucket root made the clean-up of interrupted uploads abort other applications' multipart
    uploads; credentials pasted into the URL were echoed in the error. Each is a RemoteStorageError now."""
    from snapckpt.errors import RemoteStorageError
    from snapckpt.storage.remote import RemoteStore
    with pytest.raises(RemoteStorageError, match=words) as ei:
        RemoteStore(url)
    assert "SECRET" not in str(ei.value) and "secret=x" not in str(ei.value)
    assert ":://" not in str(ei.value) and "'s3:'" not in str(ei.value), ei.value  # "s3://" was shown as 's3:'
    if "no bucket" in words:
        assert "pass s3://bucket/prefix" in str(ei.value), ei.value
