"""One fault of an object store URL, one exception type, whichever argument carried the URL: the checkpoint
directory (remote-only mode), ``remote_dir=``, ``$SNAPCKPT_REMOTE_DIR``, or the ``snapckpt`` command (exit 2,
the same message). Before, ``Checkpointer("ftp://x/y")`` raised ``CheckpointDirError``,
``Checkpointer(d, remote_dir="ftp://x/y")`` ``RemoteStorageError`` and ``remote_dir="bucket/x"`` a plain
``ValueError``; now each is a :class:`RemoteURLError`, which is all three, so callers catching any of them
still do."""
from __future__ import annotations

import pytest

from _harness import free_port
from snapckpt import Checkpointer
from snapckpt.cli import main as cli_main
from snapckpt.errors import CheckpointDirError, RemoteStorageError, RemoteURLError
from snapckpt.options import CheckpointOptions

FAULTS = [  # (url, what the message says)
    ("nope://bucket/run1", "Protocol not known: nope"),
    ("gs://bucket/run1", "is not installed"),
    ("ftp://no-such-host.invalid/run1", "cannot be reached"),  # ftp connects when made
    ("file:///tmp/run1", "pass the plain path '/tmp/run1'"),
    # fsspec reads http:// only: its probe failed with an empty NotImplementedError
    ("http://127.0.0.1:9000/bucket/run1", "s3://bucket/run1 with AWS_ENDPOINT_URL=http://127.0.0.1:9000"),
    ("https://key:secret@minio.local/bucket/run1", "AWS_ENDPOINT_URL=https://minio.local (MinIO"),
    ("s3://bucket", "names no prefix in the bucket"),
    ("s3://key:secret@bucket/run1", "carries credentials"),
    # keys are not normalized: parts were uploaded under "/run1/..." and never listed, no save ever committed
    ("s3://bucket//run1", "pass s3://bucket/run1"),
    ("s3://bucket/a/../run1/", "pass s3://bucket/run1"),
]


def _entry(entry: str, url: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    if entry == "checkpoint_dir":
        Checkpointer(url)
    elif entry == "remote_dir":
        Checkpointer(str(tmp_path / "ckpt"), remote_dir=url)
    else:
        monkeypatch.setenv("SNAPCKPT_REMOTE_DIR", url)
        Checkpointer(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("entry", ["checkpoint_dir", "remote_dir", "SNAPCKPT_REMOTE_DIR"])
@pytest.mark.parametrize("url, words", FAULTS)
def test_a_bad_url_is_one_type_wherever_it_is_passed(entry, url, words, tmp_path, monkeypatch):
    with pytest.raises(RemoteURLError) as ei:
        _entry(entry, url, tmp_path, monkeypatch)
    e = ei.value
    assert type(e) is RemoteURLError, type(e)
    assert isinstance(e, CheckpointDirError) and isinstance(e, RemoteStorageError) and isinstance(e, ValueError)
    assert words in str(e), str(e)
    assert "secret" not in str(e)
    assert list(tmp_path.iterdir()) == [], "a refused URL left something behind"


@pytest.mark.parametrize("url, words", FAULTS)
def test_the_cli_says_the_same_for_the_same_url(url, words, capsys):
    for cmd in ("ls", "verify"):
        with pytest.raises(SystemExit) as ei:
            cli_main([cmd, url])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "secret" not in err, err


def test_the_remote_dir_option_refuses_a_bad_shape_when_made():
    """On every rank, before any coordination: as a ``ValueError``, like every other option."""
    for url, words in [("bucket/run1", "is not a URL"), ("s3://bucket", "names no prefix")]:
        with pytest.raises(RemoteURLError, match=words):
            CheckpointOptions(remote_dir=url)
    assert CheckpointOptions(remote_dir="s3://bucket/run1").remote_dir == "s3://bucket/run1"


def test_an_unreachable_store_is_one_type_too(tmp_path, monkeypatch):
    """A well-formed URL whose store cannot be reached (nothing listens at the endpoint): RemoteStorageError
    from the access probe, through either argument; the CLI exits 2 naming the cause and what to check."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    url = "s3://bucket/run1"
    for entry in ("checkpoint_dir", "remote_dir"):
        with pytest.raises(RemoteStorageError, match="Could not connect to the endpoint") as ei:
            _entry(entry, url, tmp_path, monkeypatch)
        assert type(ei.value) is RemoteStorageError
    with pytest.raises(SystemExit) as ei:
        cli_main(["ls", url])
    assert ei.value.code == 2


@pytest.mark.parametrize("argv", [["inspect", "s3://bucket/run1", "1"], ["ls", "s3:/bucket/run1"],
                                  ["verify", "s3:/bucket/run1"]])
def test_the_cli_names_a_url_it_cannot_read_as_a_url(argv, capsys, tmp_path, monkeypatch):
    """``inspect`` reads local directories only, and ``s3:/`` (one slash, as pathlib leaves it) is no
    directory: the message says it is a URL and which commands read one, not "no such directory"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ei:
        cli_main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "is a URL (s3://" in err and "no such directory" not in err, err


@pytest.mark.parametrize("url", ["s3:/AKIAKEY:SeCrEt@bucket/run1", "AKIAKEY:SeCrEt@bucket/run1",
                                 "s3:/bucket/run1?token=SeCrEt"])
def test_a_mangled_url_with_credentials_is_refused_without_echoing_them(url, tmp_path, monkeypatch, capsys):
    """Right: a URL whose '//' was lost (a typo, or a pathlib.Path) or that has no scheme at all, with credentials
    or a token pasted in, is refused at every entry and by the CLI without the secret in the message (``***``
    in its place): a well-formed one never echoed them, these quoted the whole text."""
    for entry in ("checkpoint_dir", "remote_dir", "SNAPCKPT_REMOTE_DIR"):
        if entry == "checkpoint_dir" and "://" not in url and ":/" not in url:
            continue  # a plain relative path there: a local directory
        with pytest.raises((RemoteURLError, CheckpointDirError)) as err:
            _entry(entry, url, tmp_path, monkeypatch)
        assert "SeCrEt" not in str(err.value) and "***" in str(err.value), (entry, str(err.value))
    if url.startswith("s3:/"):
        for cmd in ("ls", "verify"):
            with pytest.raises(SystemExit):
                cli_main([cmd, url])
            err = capsys.readouterr().err
            assert "SeCrEt" not in err and "***" in err, err
