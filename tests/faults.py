"""Fault-injection toolkit for the tests (issue 7): arm faults, kill or hang processes, damage files.

The product-side seams are in :mod:`snapckpt._internal.faultpoints` (named fault points, a storage that fails by phase
and rank); this module builds their environment knobs and adds what a test does from outside:

- :func:`point_env` / :func:`storage_env` / :func:`slow_env`: environment for a launch (inherited by the
  node persister the ranks start), arming one fault point, one storage fault, or a slow persister;
- :func:`kill_job`, :func:`kill_persisters`, :func:`hang_persisters` / :func:`unhang`: SIGKILL ranks like
  an elastic launcher does when one dies, SIGKILL the persister, SIGSTOP/SIGCONT it (a hung persister);
- :func:`small_shm`: a small shared-memory directory for the ``shm_dir`` option (a tmpfs of that size
  when running as root, else a plain directory: the arena's capacity check reads ``statvfs``);
- :func:`limit_file_size`: ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored, so writes past it fail with
  ``EFBIG`` like a full disk (on a running persister once its arena slots exist: slot files count too);
- :func:`damage`: corrupt one byte, truncate every file, or delete one rank's files of a checkpoint;
- :func:`committed` / :func:`verify_all`: the committed checkpoints of a directory and their checks;
- :func:`refuse_thread_starts`: in-process threads of one name fail to start after the first
  (``RuntimeError: can't start new thread``, as under a process or cgroup thread limit);
- :class:`FaultPoint` and :func:`draw_points`: the seeded random matrix (point x rank x step x damage).
"""
from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import random
import resource
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import psutil

from snapckpt._internal.faultpoints import PHASES, POINTS
from snapckpt.ondisk.manifest import check_checksums, list_committed
from snapckpt.storage import PosixStorage

RANK_POINTS = ("snapshot.mid_copy", "snapshot.before_ready")
PERSIST_POINTS = ("persist.mid_file", "persist.before_part_marker")
COMMIT_POINTS = ("commit.before_rename", "commit.before_tracker", "commit.after_tracker_before_retention")
# commit.between_renames fires only when a step directory is re-committed (never in the matrix's runs):
# test_commit_crash.py arms it itself
DRAWN_POINTS = RANK_POINTS + PERSIST_POINTS + COMMIT_POINTS
DAMAGES = ("none", "corrupt_byte", "truncate", "missing_rank")


def point_env(name: str, *, rank: Optional[int] = None, step: Optional[int] = None,
              occurrence: Optional[int] = None, action: str = "kill") -> Dict[str, str]:
    """``{"SNAPCKPT_FAULT_POINT": spec}`` arming point ``name`` (see :mod:`snapckpt._internal.faultpoints`)."""
    assert name in POINTS, name
    spec = name + "".join(f":{k}={v}" for k, v in (("rank", rank), ("step", step), ("occurrence", occurrence))
                          if v is not None)
    if action != "kill":
        spec += f":action={action}"
    return {"SNAPCKPT_FAULT_POINT": spec}


def storage_env(phase: str, err: int = _errno.ENOSPC, *, rank: Optional[int] = None,
                step: Optional[int] = None, after_bytes: int = 0) -> Dict[str, str]:
    """``{"SNAPCKPT_FAULT_STORAGE": plan}``: the persister's storage fails in ``phase`` with ``err``."""
    assert phase in PHASES, phase
    plan = {"phase": phase, "errno": err, "after_bytes": after_bytes}
    if rank is not None:
        plan["rank"] = rank
    if step is not None:
        plan["step"] = step
    return {"SNAPCKPT_FAULT_STORAGE": json.dumps(plan)}


def slow_env(secs_per_write: float) -> Dict[str, str]:
    """A slow persister: it sleeps ``secs_per_write`` before each record it writes."""
    return {"SNAPCKPT_FAULT_WRITE_DELAY_SECS": str(secs_per_write)}


def kill_job(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (what torchrun does when one rank dies) and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def wait_first_exit(procs: Sequence[subprocess.Popen], timeout: float) -> Optional[subprocess.Popen]:
    """The first rank to exit within ``timeout`` seconds (``None`` if all still run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                return p
        time.sleep(0.05)
    return None


def kill_persisters(snap_env) -> List[int]:
    """SIGKILL the test's persister processes; return their pids once they are gone."""
    procs = snap_env.persisters()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def hang_persisters(snap_env) -> List[psutil.Process]:
    """SIGSTOP the test's persisters (a hung persister); :func:`unhang` resumes them."""
    procs = snap_env.persisters()
    for p in procs:
        p.suspend()
    return procs


def unhang(procs: Sequence[psutil.Process]) -> None:
    """SIGCONT processes stopped by :func:`hang_persisters`."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.resume()


@contextlib.contextmanager
def small_shm(path: str, size_bytes: int) -> Iterator[str]:
    """A shared-memory directory of about ``size_bytes`` for the ``shm_dir`` option.

    As root: a tmpfs of that size mounted at ``path`` (unmounted at the end). Otherwise ``path`` stays a
    plain directory and only its filesystem's real capacity bounds it (put it on ``/dev/shm``).
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", path],
                                 capture_output=True).returncode == 0
    try:
        yield path
    finally:
        if mounted and subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


def limit_file_size(nbytes: int, pid: Optional[int] = None) -> None:
    """Files cannot grow past ``nbytes`` (``EFBIG``, like a full disk): in process ``pid`` (``prlimit``;
    a running persister, once its arena slots exist, since slot files count too) or, with ``pid=None``,
    in this process and its future children, with ``SIGXFSZ`` ignored so the write fails instead of
    killing the process (CPython ignores ``SIGXFSZ`` already). ``nbytes=-1`` lifts the limit."""
    limit = resource.RLIM_INFINITY if nbytes < 0 else nbytes
    if pid is not None:
        psutil.Process(pid).rlimit(psutil.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        return
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _data_files(path: str, rank: Optional[int] = None) -> List[str]:
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".snapckpt"]
        out += [os.path.join(root, f) for f in sorted(files)]
    if rank is not None:
        marks = (f"rank_{rank:05d}", f"rank_{rank}_", f"rank_{rank:02d}_", f"__{rank}_", f"_{rank}.")
        out = [f for f in out if any(m in os.path.basename(f) for m in marks)]
    return sorted(out)


def damage(path: str, how: str, *, rank: int = 1) -> List[str]:
    """Damage the committed checkpoint directory ``path``; return the files touched.

    ``corrupt_byte``: flip one byte in the middle of the largest data file; ``truncate``: every data file
    to 0 bytes (power loss before fsync, case B3); ``missing_rank``: delete the files that belong to
    ``rank`` (names containing its zero-padded or plain rank).

    Raises:
        AssertionError: nothing to damage (no data file, or none of ``rank``).
    """
    if how == "corrupt_byte":
        files = [max(_data_files(path), key=os.path.getsize)]
        with open(files[0], "r+b") as f:
            f.seek(os.path.getsize(files[0]) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    elif how == "truncate":
        files = _data_files(path)
        for f in files:
            os.truncate(f, 0)
    elif how == "missing_rank":  # a rank that writes nothing (DeepSpeed ZeRO-0 rank 1): rank 0's files
        files = _data_files(path, rank) or _data_files(path, 0)
        for f in files:
            os.unlink(f)
    else:
        raise ValueError(f"unknown damage {how!r}; one of {DAMAGES}")
    assert files, f"nothing to damage ({how}) in {path}"
    return files


def committed(ckpt_dir: str) -> Dict[int, str]:
    """``{step: dirname}`` of the checkpoints committed in ``ckpt_dir`` (valid manifest, sizes right)."""
    return {c.step: c.dirname for c in list_committed(PosixStorage(), ckpt_dir)}


def verify_all(ckpt_dir: str) -> List[str]:
    """Problems of every committed checkpoint (sizes and checksums against its manifest); ``[]`` if none."""
    problems = []
    for c in list_committed(PosixStorage(), ckpt_dir, quick_check=False):
        try:
            check_checksums(PosixStorage(), c.path, c.manifest)
        except Exception as e:  # noqa: BLE001 - reported as a problem
            problems.append(f"{c.dirname}: {e}")
    return problems


@dataclass(frozen=True)
class FaultPoint:
    """One random fault: ``point`` fires for ``rank`` (``None``: the commit) at ``step``; after the crash
    the newest committed checkpoint gets ``damage`` (then the persister is killed too, so that the
    restart must read the disk)."""

    point: str
    rank: Optional[int]
    step: int
    damage: str = "none"

    def env(self) -> Dict[str, str]:
        return point_env(self.point, rank=self.rank, step=self.step)

    def __str__(self) -> str:
        return f"{self.point}@rank={self.rank},step={self.step},damage={self.damage}"


def draw_points(seed: int, n: int, *, steps: int, disk_every: int, world_size: int,
                points: Sequence[str] = DRAWN_POINTS) -> List[FaultPoint]:
    """``n`` seeded fault points; persist and commit points only on DISK steps (multiples of
    ``disk_every``), snapshot points on any step but the first; a quarter carry a damage."""
    rng = random.Random(seed)
    disk_steps = [s for s in range(1, steps + 1) if s % disk_every == 0]
    out = []
    for _ in range(n):
        name = rng.choice(list(points))
        if name in RANK_POINTS:
            step, rank = rng.randint(2, steps), rng.randrange(world_size)
        elif name in PERSIST_POINTS:
            step, rank = rng.choice(disk_steps), rng.randrange(world_size)
        else:
            step, rank = rng.choice(disk_steps), None
        kinds = DAMAGES[1:] if world_size > 1 else ("corrupt_byte", "truncate")  # one rank cannot go missing
        dmg = rng.choice(kinds) if rng.random() < 0.25 else "none"
        out.append(FaultPoint(name, rank, step, dmg))
    return out


def refuse_thread_starts(monkeypatch, name: str) -> List[threading.Thread]:
    """Make every start of a thread named ``name`` after the first raise ``RuntimeError("can't start new
    thread")`` (as a process or cgroup thread limit does); returns the list of the threads that started."""
    real_start, started = threading.Thread.start, []

    def start(self):
        if self.name == name and started:
            raise RuntimeError("can't start new thread")
        started.append(self)
        return real_start(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    return started
