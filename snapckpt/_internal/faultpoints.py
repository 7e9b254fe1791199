"""Fault injection seams for tests: named fault points and a storage that fails on purpose.

Both are armed by environment knobs (read through :mod:`snapckpt._internal.env`, inherited by the persister
process) and cost one global lookup when unset. Nothing here is used in production.

**Fault points** (``SNAPCKPT_FAULT_POINT``): ``;``-separated specs ``NAME[:key=value]...`` with keys

- ``rank=R``: only where the point runs for rank ``R`` (a rank process: its global rank; the persister:
  the rank whose part it writes). Commit points have no rank: a spec with ``rank=`` never matches them.
- ``step=S``: only for step ``S``;
- ``occurrence=K``: the ``K``-th matching hit in this process (default 1);
- ``action=kill|stop|sleep|wait``: ``SIGKILL`` (default) or ``SIGSTOP`` the process itself (a hung process),
  sleep there (widens a race window), or wait there until file ``path`` exists (holds a phase until the
  test has seen what it needs, whatever the machine's load);
- ``secs=F``: seconds ``action=sleep`` sleeps (default 1), the most ``action=wait`` waits (default 300);
- ``path=P``: the file ``action=wait`` waits for (no ``:`` or ``;`` in it).

Before acting, the process writes ``SNAPCKPT_FAULT_POINT hit NAME rank=R step=S pid=P`` to stderr (the
persister's stderr is its ``persister.log``). The points in the product code:

=========================================  ==========  =======================================================
point                                      process     where
=========================================  ==========  =======================================================
``snapshot.mid_copy``                      rank        half of the tensors copied into the slot
``snapshot.before_ready``                  rank        copy done, slot not yet handed to the persister
``persist.mid_file``                       persister   a file of the part half written (occurrence K: file K)
``persist.before_part_marker``             persister   every file written and fsynced, no part marker yet
``persist.after_part_marker``              persister   part marker renamed into place (the committer may count
                                                       it), its directory not yet fsynced
``commit.before_rename``                   persister   manifest written, partial directory not renamed
``commit.between_renames``                 persister   re-commit of a step: old directory moved aside, new
                                                       one not yet renamed (fires only when replacing)
``commit.before_tracker``                  persister   renamed, tracker not yet replaced
``commit.after_tracker_before_retention``  persister   tracker replaced, retention not run
``commit.retention_listed``                persister   retention listed the committed directories, retired
                                                       none yet (its decisions hold until it has renamed)
``commit.remove_failed_partial``           persister   a commit failed; its partial directory not yet deleted
``remote.mid_upload``                      persister   a block of a data object sent to the remote tier
``remote.before_manifest``                 persister   every data object uploaded, no manifest object yet
``remote.before_tracker``                  persister   manifest object written, tracker object not yet
``replica.before_send``                    persister   a snapshot of the rank taken off a sender's queue, not
                                                       yet sent to the peer node (``action=sleep``: a replica
                                                       that lags behind)
=========================================  ==========  =======================================================

**Storage faults** (:mod:`snapckpt._testing.faulty_storage`) (``SNAPCKPT_FAULT_STORAGE``): a JSON object ``{"phase": P, "errno": E, "rank": R,
"step": S, "after_bytes": B}`` (only ``phase`` required; ``errno`` defaults to ``ENOSPC``), or ``@PATH``:
the plan is read from file ``PATH`` at each part and commit (a missing or empty file: no fault), so a test
can change it while one persister lives. The persister
builds its storage with :func:`snapckpt.storage.factory.open_storage`, which wraps :class:`~snapckpt.storage.posix.PosixStorage` in
:class:`FaultyStorage` when the plan's rank and step select the part (or the commit, which has no rank)
being written. Phases: ``open`` (``open_write``), ``write`` (a write once ``after_bytes`` bytes of the file
are written), ``fsync`` (every ``fsync_file``, the small atomic files' included), ``part_marker`` (the rank's part marker), ``manifest``,
``rename`` (the commit's rename), ``tracker`` (the tracker file). Every call of the phase fails.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict, List, Optional

from snapckpt._internal import env as _env

__all__ = ["point", "armed", "set_rank", "POINTS", "PHASES"]

POINTS = ("snapshot.mid_copy", "snapshot.before_ready", "persist.mid_file", "persist.before_part_marker",
          "persist.after_part_marker", "commit.before_rename", "commit.between_renames", "commit.before_tracker",
          "commit.after_tracker_before_retention", "commit.retention_listed", "commit.remove_failed_partial", "remote.mid_upload",
          "remote.before_manifest", "remote.before_tracker", "replica.before_send")
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
            elif key == "action" and value in ("kill", "stop", "sleep", "wait"):
                spec[key] = value
            elif key == "path" and value:
                spec[key] = value
            elif key == "secs" and value.replace(".", "", 1).isdigit():
                spec[key] = float(value)
            else:
                raise ValueError(f"SNAPCKPT_FAULT_POINT: bad selector {kv!r} in {part!r} (rank=, step=, "
                                 "occurrence=, action=kill|stop|sleep|wait, secs=, path=)")
        if spec["action"] == "wait" and "path" not in spec:
            raise ValueError(f"SNAPCKPT_FAULT_POINT: action=wait needs path= (the file to wait for) in {part!r}")
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
        if spec["action"] == "wait":
            deadline = time.monotonic() + float(spec.get("secs", 300.0))
            while not os.path.exists(str(spec["path"])) and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        os.kill(os.getpid(), signal.SIGSTOP if spec["action"] == "stop" else signal.SIGKILL)
