"""Fault injection seams for tests: named fault points and a storage that fails on purpose.

Both are armed by environment knobs (read through :mod:`snapckpt._internal.env`, inherited by the persister
process) and cost one global lookup when unset. Nothing here is used in production.

**Fault points** (``SNAPCKPT_FAULT_POINT``): ``;``-separated specs ``NAME[:key=value]...`` with keys

- ``rank=R``: only where the point runs for rank ``R`` (a rank process: its global rank; the persister:
  the rank whose part it writes). Commit points have no rank: a spec with ``rank=`` never matches them.
- ``step=S``: only for step ``S``;
- ``occurrence=K``: the ``K``-th matching hit in this process (default 1);
- ``action=kill|stop|sleep``: ``SIGKILL`` (default) or ``SIGSTOP`` the process itself (a hung process), or
  sleep there (widens a race window);
- ``secs=F``: seconds ``action=sleep`` sleeps (default 1).

Before acting, the process writes ``SNAPCKPT_FAULT_POINT hit NAME rank=R step=S pid=P`` to stderr (the
persister's stderr is its ``persister.log``). The points in the product code:

=========================================  ==========  =======================================================
point                                      process     where
=========================================  ==========  =======================================================
``snapshot.mid_copy``                      rank        half of the tensors copied into the slot
``snapshot.before_ready``                  rank        copy done, slot not yet handed to the persister
``persist.mid_file``                       persister   a file of the part half written (occurrence K: file K)
``persist.before_part_marker``             persister   every file written and fsynced, no part marker yet
``commit.before_rename``                   persister   manifest written, partial directory not renamed
``commit.between_renames``                 persister   re-commit of a step: old directory moved aside, new
                                                       one not yet renamed (fires only when replacing)
``commit.before_tracker``                  persister   renamed, tracker not yet replaced
``commit.after_tracker_before_retention``  persister   tracker replaced, retention not run
=========================================  ==========  =======================================================

**Storage faults** (``SNAPCKPT_FAULT_STORAGE``): a JSON object ``{"phase": P, "errno": E, "rank": R,
"step": S, "after_bytes": B}`` (only ``phase`` required; ``errno`` defaults to ``ENOSPC``), or ``@PATH``:
the plan is read from file ``PATH`` at each part and commit (a missing or empty file: no fault), so a test
can change it while one persister lives. The persister
builds its storage with :func:`storage`, which wraps :class:`~snapckpt.storage.posix.PosixStorage` in
:class:`FaultyStorage` when the plan's rank and step select the part (or the commit, which has no rank)
being written. Phases: ``open`` (``open_write``), ``write`` (a write once ``after_bytes`` bytes of the file
are written), ``fsync`` (every ``fsync_file``, the small atomic files' included), ``part_marker`` (the rank's part marker), ``manifest``,
``rename`` (the commit's rename), ``tracker`` (the tracker file). Every call of the phase fails.
"""
from __future__ import annotations

import errno as _errno
import json
import os
import signal
import sys
import time
from typing import BinaryIO, Dict, List, Optional

from snapckpt._internal import env as _env
from snapckpt.storage.posix import PosixStorage

__all__ = ["point", "armed", "set_rank", "storage", "FaultyStorage", "POINTS", "PHASES"]

POINTS = ("snapshot.mid_copy", "snapshot.before_ready", "persist.mid_file", "persist.before_part_marker",
          "commit.before_rename", "commit.between_renames", "commit.before_tracker",
          "commit.after_tracker_before_retention")
PHASES = ("open", "write", "fsync", "part_marker", "manifest", "rename", "tracker")

_specs: Optional[List[Dict[str, object]]] = None  # parsed once; [] when unset
_hits: Dict[int, int] = {}
_rank: Optional[int] = None


def _parse(raw: str) -> List[Dict[str, object]]:
    out = []
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        name, *kvs = part.split(":")
        if name not in POINTS:
            raise ValueError(f"SNAPCKPT_FAULT_POINT: unknown point {name!r}; known: {', '.join(POINTS)}")
        spec: Dict[str, object] = {"name": name, "occurrence": 1, "action": "kill"}
        for kv in kvs:
            key, _, value = kv.partition("=")
            if key in ("rank", "step", "occurrence") and value.isdigit():
                spec[key] = int(value)
            elif key == "action" and value in ("kill", "stop", "sleep"):
                spec[key] = value
            elif key == "secs" and value.replace(".", "", 1).isdigit():
                spec[key] = float(value)
            else:
                raise ValueError(f"SNAPCKPT_FAULT_POINT: bad selector {kv!r} in {part!r} (rank=, step=, "
                                 "occurrence=, action=kill|stop|sleep, secs=)")
        out.append(spec)
    return out


def armed() -> bool:
    """Whether any fault point is armed in this process."""
    global _specs
    if _specs is None:
        _specs = _parse(_env.fault_point())
    return bool(_specs)


def set_rank(rank: int) -> None:
    """Record this process's global rank (used by points called without one)."""
    global _rank
    _rank = rank


def point(name: str, *, step: int, rank: Optional[int] = -1) -> None:
    """Fault point ``name`` for ``step`` (``rank=-1``: this process's rank; ``None``: no rank).

    Returns at once when ``SNAPCKPT_FAULT_POINT`` is unset; otherwise SIGKILLs or SIGSTOPs this process
    on the selected hit (see the module docstring).

    Raises:
        ValueError: the knob's spec is malformed (on the first call).
    """
    global _specs
    if _specs is None:
        _specs = _parse(_env.fault_point())
    if not _specs:
        return
    if rank == -1:
        rank = _rank
    for i, spec in enumerate(_specs):
        if spec["name"] != name or spec.get("step", step) != step:
            continue
        if "rank" in spec and spec["rank"] != rank:
            continue
        _hits[i] = _hits.get(i, 0) + 1
        if _hits[i] != spec["occurrence"]:
            continue
        sys.stderr.write(f"SNAPCKPT_FAULT_POINT hit {name} rank={rank} step={step} pid={os.getpid()}\n")
        sys.stderr.flush()
        if spec["action"] == "sleep":
            time.sleep(float(spec.get("secs", 1.0)))
            return
        os.kill(os.getpid(), signal.SIGSTOP if spec["action"] == "stop" else signal.SIGKILL)


def storage(*, fsync: bool, rank: Optional[int], step: int) -> PosixStorage:
    """The persister's storage for rank ``rank``'s part (``None``: the commit) of ``step``: a
    :class:`FaultyStorage` when ``SNAPCKPT_FAULT_STORAGE`` selects it, else a plain ``PosixStorage``.

    Raises:
        ValueError: the plan is not valid JSON or names an unknown phase.
    """
    raw = _env.fault_storage()
    if raw.startswith("@"):
        try:
            with open(raw[1:]) as f:
                raw = f.read().strip()
        except FileNotFoundError:
            raw = ""
    if not raw:
        return PosixStorage(fsync=fsync)
    try:
        plan = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"SNAPCKPT_FAULT_STORAGE is not JSON: {raw!r}") from e
    if plan.get("phase") not in PHASES:
        raise ValueError(f"SNAPCKPT_FAULT_STORAGE: phase must be one of {PHASES}, not {plan.get('phase')!r}")
    if plan.get("step", step) != step or ("rank" in plan and plan["rank"] != rank):
        return PosixStorage(fsync=fsync)
    return FaultyStorage(plan["phase"], int(plan.get("errno", _errno.ENOSPC)),
                         int(plan.get("after_bytes", 0)), fsync=fsync)


class FaultyStorage(PosixStorage):
    """A :class:`PosixStorage` whose every call of one phase raises ``OSError(errno)``.

    Args:
        phase: one of :data:`PHASES` (see the module docstring).
        errno: the ``errno`` of the raised ``OSError`` (``ENOSPC``, ``EFBIG``, ``EIO``...).
        after_bytes: phase ``write``: bytes of each file written before the failure.
    """

    def __init__(self, phase: str, errno: int, after_bytes: int = 0, *, fsync: bool = True) -> None:
        super().__init__(fsync=fsync)
        self.phase, self.errno, self.after_bytes = phase, errno, after_bytes

    def _fail(self, path: str) -> None:
        raise OSError(self.errno, f"{os.strerror(self.errno)} (injected: {self.phase})", path)

    def open_write(self, path: str) -> BinaryIO:
        if self.phase == "open":
            self._fail(path)
        f = super().open_write(path)
        return _FailingFile(f, self, path) if self.phase == "write" else f

    def fsync_file(self, fileobj: BinaryIO) -> None:
        if self.phase == "fsync":
            self._fail(getattr(fileobj, "name", "?"))
        super().fsync_file(getattr(fileobj, "raw_file", fileobj))

    def write_atomic(self, path: str, data: bytes) -> None:
        base = os.path.basename(path)
        is_sidecar = os.path.basename(os.path.dirname(path)) == ".snapckpt"
        if (self.phase == "part_marker" and is_sidecar and base.startswith("part_")) or \
                (self.phase == "manifest" and is_sidecar and base == "manifest.json") or \
                (self.phase == "tracker" and not is_sidecar):
            self._fail(path)
        super().write_atomic(path, data)

    def rename(self, src: str, dst: str) -> None:
        if self.phase == "rename":
            self._fail(src)
        super().rename(src, dst)


class _FailingFile:
    """A file that raises on the write that would pass ``after_bytes``."""

    def __init__(self, raw_file: BinaryIO, owner: FaultyStorage, path: str) -> None:
        self.raw_file, self.owner, self.path, self.written = raw_file, owner, path, 0

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if self.written + n > self.owner.after_bytes:
            self.owner._fail(self.path)
        self.written += n
        return self.raw_file.write(data)

    def flush(self) -> None:
        self.raw_file.flush()

    def fileno(self) -> int:
        return self.raw_file.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw_file.close()

    def close(self) -> None:
        self.raw_file.close()
