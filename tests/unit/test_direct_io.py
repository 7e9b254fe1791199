"""The O_DIRECT writer (snapckpt/storage/direct.py), in process: exact bytes for any pattern of writes and
flushes, a filesystem without O_DIRECT gets a buffered file, a read-only file left there is replaced. The
first two moved whole from tests/test_storage_direct.py (its file-size-limit test needs a child process and
stays there)."""
from __future__ import annotations

import errno
import os
import random
import threading
import time

from snapckpt.storage.direct import BUFFER_NBYTES, BUFFERS, DirectFile, open_direct


def test_any_pattern_of_writes_and_flushes_gives_the_exact_bytes(tmp_path):
    """Writes of 1 byte to more than one bounce buffer, flushes in between (a padded tail rewritten in
    place by the next write), then fsync: the file is byte for byte what was written."""
    rng = random.Random(20261130)
    data = os.urandom(3 * BUFFER_NBYTES + 12345)
    path = str(tmp_path / "f.bin")
    for trial in range(6):
        with open_direct(path) as f:
            assert isinstance(f, DirectFile)  # ext4 takes O_DIRECT; the fallback is tested below
            pos = 0
            while pos < len(data):
                n = rng.choice([1, 7, 4096, 65536, 3 << 20, BUFFER_NBYTES + 1])
                f.write(data[pos:pos + n])
                pos += n
                assert f.tell() == min(pos, len(data))
                if rng.random() < 0.2:
                    f.flush()
                    assert os.path.getsize(path) == f.tell()
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as r:
            assert r.read() == data, f"trial {trial}"


def test_filesystem_refusing_o_direct_gets_a_buffered_file(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT answers open(2) with EINVAL (older tmpfs, some network
    filesystems; this machine's kernel accepts it everywhere, so open(2) is made to refuse it here):
    open_direct falls back to an ordinary buffered file with the same bytes."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    path = str(tmp_path / "b.bin")
    with open_direct(path) as f:
        assert not isinstance(f, DirectFile)
        f.write(b"abc" * 1000)
    with open(path, "rb") as r:
        assert r.read() == b"abc" * 1000


def test_a_file_left_read_only_is_replaced_not_refused(tmp_path):
    """A part file written with a spec's ``mode=0o400`` and written again into the same partial directory
    (a crash flush of a step whose commit was abandoned on a watcher node) is replaced by a fresh file, not
    refused with EACCES: a persister that is not root cannot open a read-only file for writing. Run as
    ``nobody`` in a child when this process is root (root ignores permission bits)."""
    d = tmp_path / "part"
    d.mkdir()
    with open_direct(str(d / "f.bin")) as f:
        f.write(b"old")
    os.chmod(d / "f.bin", 0o400)
    pid = os.fork() if os.geteuid() == 0 else None
    if pid == 0:  # the child: nobody, in the directory (root's tmp_path parents are not searchable by nobody)
        code = 1
        try:
            for p in (d, d / "f.bin"):
                os.chown(p, 65534, 65534)
            os.chdir(d)
            os.setgid(65534)
            os.setuid(65534)
            with open_direct("f.bin") as f:
                f.write(b"new")
            code = 0
        finally:
            os._exit(code)
    if pid is None:
        with open_direct(str(d / "f.bin")) as f:
            f.write(b"new")
    else:
        assert os.waitpid(pid, 0)[1] == 0, "open_direct refused to replace a read-only file"
    assert (d / "f.bin").read_bytes() == b"new"


def test_several_full_buffers_are_written_out_at_once(tmp_path, monkeypatch):
    """The device gets up to ``BUFFERS - 1`` writes at a time (one at a time left this VM's disk idle between
    them: issue 18): with every background write held, the caller still hands over ``BUFFERS - 1`` full buffers
    without blocking, each at its own offset; the file then holds exactly what was written."""
    hold = threading.Event()
    started = []
    real = DirectFile._write_out

    def held(self, view, nbytes, offset):
        started.append(offset)
        hold.wait(120)
        real(self, view, nbytes, offset)

    monkeypatch.setattr(DirectFile, "_write_out", held)
    data = [os.urandom(BUFFER_NBYTES) for _ in range(BUFFERS)]
    path = str(tmp_path / "q.bin")
    f = open_direct(path)
    writer = threading.Thread(target=lambda: [f.write(d) for d in data[:BUFFERS - 1]])
    writer.start()
    writer.join(60)
    handed_over = not writer.is_alive()
    deadline = time.monotonic() + 60  # a handed-over write reaches its pool thread a moment later
    while len(started) < BUFFERS - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # and no fourth one may follow
    in_flight = sorted(started)
    hold.set()
    writer.join()
    f.write(data[-1])
    f.close()
    assert handed_over, "the caller waited for a background write before BUFFERS - 1 were in flight"
    assert in_flight == [i * BUFFER_NBYTES for i in range(BUFFERS - 1)]
    with open(path, "rb") as r:
        assert r.read() == b"".join(data)


def test_borrowed_writes_give_the_exact_bytes_and_the_aligned_middle_comes_straight_from_the_buffer(tmp_path,
                                                                                                   monkeypatch):
    """``write_borrowed`` mixed with ``write`` and ``flush`` at random (phases that agree with the file position and
    phases that do not, pieces shorter than BORROW_MIN_NBYTES, a tail left by a flush): the file is byte for byte
    what was written, and the pieces whose phase agreed were written from the caller's mapping itself (no bounce
    copy) but for their unaligned head and tail."""
    import mmap

    from snapckpt.storage import direct

    src = mmap.mmap(-1, 6 * BUFFER_NBYTES)
    src.write(os.urandom(len(src)))
    view = memoryview(src)
    straight = []
    real = direct.DirectFile._write_out

    def spy(self, v, nbytes, offset):
        if v.obj is src:
            straight.append(nbytes)
        return real(self, v, nbytes, offset)

    monkeypatch.setattr(direct.DirectFile, "_write_out", spy)
    rng = random.Random(20261205)
    path = str(tmp_path / "b.bin")
    for trial in range(5):
        straight.clear()
        expected = bytearray()
        agreed = 0
        with open_direct(path) as f:
            while len(expected) < 4 * BUFFER_NBYTES:
                pos = f.tell()
                if rng.random() < 0.3:
                    data = os.urandom(rng.choice([1, 100, 4096, 70000]))
                    f.write(data)
                else:
                    n = rng.choice([10, direct.BORROW_MIN_NBYTES + 4095, BUFFER_NBYTES + 12345, 2 * BUFFER_NBYTES])
                    if rng.random() < 0.3:  # another phase (or by chance the same)
                        at = rng.randrange(0, len(src) - n)
                    else:  # the file position's phase
                        at = rng.randrange(0, (len(src) - n) // 4096 - 1) * 4096 + pos % 4096
                    data = view[at:at + n]
                    if at % 4096 == pos % 4096 and n >= direct.BORROW_MIN_NBYTES:
                        agreed += n
                    assert f.write_borrowed(data, at % 4096) == n
                expected += data
                assert f.tell() == len(expected)
                if rng.random() < 0.1:
                    f.flush()
                    assert os.path.getsize(path) == f.tell()
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as r:
            assert r.read() == bytes(expected), f"trial {trial}"
        assert agreed > 0 and sum(straight) >= agreed - 2 * 4096 * (agreed // direct.BORROW_MIN_NBYTES + 1)
    del view
