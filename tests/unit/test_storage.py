"""The POSIX storage (snapckpt/storage/posix.py) on real files in ``tmp_path``: writes through the direct-I/O
writer, atomic replacement that leaves no temporary file, listings of missing directories, deletes that
tolerate files already gone (or vanishing meanwhile) and never follow a link, and creators of one directory
racing each other."""
from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest

from snapckpt.storage import PosixStorage, StorageReader, StorageWriter


@pytest.fixture(params=[True, False], ids=["fsync", "nofsync"])
def fs(request):
    return PosixStorage(fsync=request.param)


def test_posix_storage_is_both_seams():
    assert isinstance(PosixStorage(), StorageWriter) and isinstance(PosixStorage(), StorageReader)


def test_write_then_read_back(fs, tmp_path):
    path = str(tmp_path / "a.bin")
    data = os.urandom(100_003)  # not a multiple of the O_DIRECT alignment
    f = fs.open_write(path)
    f.write(data[:5])
    f.write(data[5:])
    fs.fsync_file(f)
    f.close()
    assert fs.read_bytes(path) == data and fs.size(path) == len(data)
    with fs.open_read(path) as r:
        assert r.read(5) == data[:5]
    f = fs.open_write(path)  # opening again truncates
    f.write(b"short")
    f.close()
    assert fs.read_bytes(path) == b"short"


def test_write_atomic_replaces_and_leaves_no_temporary_file(fs, tmp_path):
    path = str(tmp_path / "latest")
    fs.write_atomic(path, b"step_00000001")
    fs.write_atomic(path, b"step_00000002")
    assert fs.read_bytes(path) == b"step_00000002"
    assert os.listdir(tmp_path) == ["latest"]


def test_write_atomic_failure_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    fs = PosixStorage(fsync=False)
    path = str(tmp_path / "manifest.json")
    fs.write_atomic(path, b"old")

    def broken_replace(src, dst):
        raise OSError(errno.EIO, "injected", dst)

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError) as ei:
        fs.write_atomic(path, b"new")
    assert ei.value.errno == errno.EIO
    assert os.listdir(tmp_path) == ["manifest.json"] and fs.read_bytes(path) == b"old"


def test_write_atomic_into_a_missing_directory_raises_file_not_found(fs, tmp_path):
    with pytest.raises(FileNotFoundError):
        fs.write_atomic(str(tmp_path / "nowhere" / "x"), b"x")
    assert os.listdir(tmp_path) == []


def test_listdir_is_sorted_and_empty_for_a_missing_directory(fs, tmp_path):
    for name in ("b", "a", ".hidden", "c"):
        (tmp_path / name).touch()
    assert fs.listdir(str(tmp_path)) == [".hidden", "a", "b", "c"]
    assert fs.listdir(str(tmp_path / "missing")) == []


def test_size_isdir_rename_and_free_bytes(fs, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"123")
    assert fs.isdir(str(tmp_path / "d")) and not fs.isdir(str(tmp_path / "f"))
    assert not fs.isdir(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        fs.size(str(tmp_path / "missing"))
    fs.rename(str(tmp_path / "d"), str(tmp_path / "e"))
    assert sorted(os.listdir(tmp_path)) == ["e", "f"]
    free = fs.free_bytes(str(tmp_path))
    assert isinstance(free, int) and 0 < free <= shutil.disk_usage(tmp_path).total
    fs.fsync_dir(str(tmp_path))  # a directory fsyncs (or is skipped) without error


def test_remove_tree_deletes_a_tree_and_tolerates_a_missing_path(fs, tmp_path):
    d = tmp_path / "step_00000001"
    (d / ".snapckpt").mkdir(parents=True)
    (d / ".snapckpt" / "manifest.json").write_text("{}")
    (d / "rank_00000.pt").write_bytes(b"x")
    fs.remove_tree(str(d))
    assert not d.exists()
    fs.remove_tree(str(d))  # already gone
    fs.remove_tree(str(tmp_path / "never" / "existed"))


def test_remove_tree_tolerates_files_vanishing_while_it_runs(tmp_path, monkeypatch):
    """Another remover (retention on a second node, an operator) deletes files of the tree while
    remove_tree walks it: each file it finds gone is skipped, and the tree is removed."""
    d = tmp_path / "old"
    (d / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        (d / name).write_bytes(b"x")
    real_unlink = os.unlink
    gone = []

    def racing_unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)  # the other remover wins the race...
        gone.append(path)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)  # ...so ours finds nothing

    monkeypatch.setattr(os, "unlink", racing_unlink)
    PosixStorage().remove_tree(str(d))
    assert not d.exists() and len(gone) == 3


def test_remove_tree_removes_a_link_never_its_target(fs, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data").write_bytes(b"keep me")
    link = tmp_path / "step_00000001"
    link.symlink_to(target, target_is_directory=True)
    fs.remove_tree(str(link))
    assert not os.path.lexists(link)
    assert (target / "data").read_bytes() == b"keep me"


def test_remove_tree_raises_other_errors(tmp_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"x")

    def refusing_unlink(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "unlink", refusing_unlink)
    with pytest.raises(PermissionError):
        PosixStorage().remove_tree(str(d))


def test_racing_makedirs_of_one_path_all_succeed(tmp_path):
    """Every rank's persister creates the same partial directory at about the same moment."""
    fs = PosixStorage()
    path = str(tmp_path / "ckpt" / ".step_00000001.partial-r" / ".snapckpt")
    barrier = threading.Barrier(8)
    errors = []

    def create():
        barrier.wait()
        try:
            fs.makedirs(path)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and os.path.isdir(path)
    fs.makedirs(path)  # and once more, existing


def test_makedirs_over_a_file_raises(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(FileExistsError):
        PosixStorage().makedirs(str(tmp_path / "f"))


def test_open_dir_fsyncs_the_directory_it_opened_even_after_a_rename(tmp_path, monkeypatch):
    """The handle fsyncs the directory it opened, under whatever name it has by then (a part marker's
    directory, which the committer may rename before the writer's fsync); ``close`` is idempotent."""
    old, new = tmp_path / ".step_00000001.partial-r", tmp_path / "step_00000001"
    old.mkdir()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd))[1])
    with PosixStorage().open_dir(str(old)) as h:
        os.rename(old, new)
        h.fsync()
        h.close()
    assert synced == [os.stat(new).st_ino]
    with pytest.raises(FileNotFoundError) as ei:
        PosixStorage().open_dir(str(old))
    assert ei.value.filename == str(old)
    with PosixStorage(fsync=False).open_dir(str(old)) as h:  # fsync disabled: nothing opened, nothing synced
        h.fsync()
    assert synced == [os.stat(new).st_ino]
