"""The operator's side of the persister: find this user's persisters and send them ``info`` or ``stop``.

Used by ``snapckpt ps`` and ``snapckpt stop`` (:mod:`snapckpt.cli.ps`). Every persister of this user on
this host keeps a runtime directory ``<runtime root>/snapckpt-<uid>/<job key>/`` (see
:mod:`snapckpt.persister.runtime_files`) holding ``persister.pid``, ``token`` and ``persister.sock``.
:func:`find_persisters` lists them; :func:`request` opens the socket, sends one operator request with
the job key and the token read from that directory (the same secret a training process presents in its
``hello``; the persister also refuses a connection from another uid), reads the answer and closes.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from snapckpt.errors import PersisterError
from snapckpt.persister import protocol as P

__all__ = ["PersisterEntry", "find_persisters", "request", "pid_alive"]


@dataclass
class PersisterEntry:
    """One runtime directory of a persister: its job key, directory and the pid its pid file names
    (``None`` when the file is missing or empty: the persister is starting or has exited)."""

    job: str
    runtime_dir: str
    pid: Optional[int]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie (exited, not yet reaped by its parent: a persister's parent
    is the training process that started it) counts as exited."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, ValueError):  # no /proc: ask the kernel
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_persisters(runtime_root: str) -> List[PersisterEntry]:
    """The runtime directories under ``runtime_root/snapckpt-<uid>/`` whose pid file names a live process
    and that have a socket, sorted by job key. Directories a crashed persister left (its log kept for
    the user) are skipped."""
    base = os.path.join(runtime_root, f"snapckpt-{os.getuid()}")
    try:
        names = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    out = []
    for job in names:
        d = os.path.join(base, job)
        try:
            with open(os.path.join(d, "persister.pid")) as f:
                text = f.read().strip()
        except OSError:
            continue
        pid = int(text) if text.isdigit() else None
        if pid is None or not pid_alive(pid) or not os.path.exists(os.path.join(d, "persister.sock")):
            continue
        out.append(PersisterEntry(job, d, pid))
    return out


def request(entry: PersisterEntry, op: str, timeout_secs: float = 10.0) -> Dict[str, Any]:
    """Send the operator request ``op`` (``"info"`` or ``"stop"``) to the persister of ``entry``; return
    its answer's fields.

    Raises:
        PersisterError: no token or socket (the persister exited meanwhile), no answer within
            ``timeout_secs`` seconds, or the persister refused the request (its error, rebuilt).
    """
    if op not in P.OPERATOR_OPS:
        raise ValueError(f"not an operator request: {op!r}")
    try:
        with open(os.path.join(entry.runtime_dir, "token")) as f:
            token = f.read().strip()
    except OSError as e:
        raise PersisterError(f"cannot read the token of job {entry.job} ({e}); has its persister exited?") from e
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_secs)
    try:
        s.connect(os.path.join(entry.runtime_dir, "persister.sock"))
        s.sendall(P.encode({"op": op, "token": token, "job": entry.job}))
        with s.makefile("rb") as f:
            line = f.readline(P.MAX_MESSAGE_NBYTES + 1)
    except socket.timeout as e:
        raise PersisterError(f"the persister of job {entry.job} (pid {entry.pid}) did not answer {op!r} within "
                             f"{timeout_secs:g} s; it may be hung (log: {entry.runtime_dir}/persister.log)") from e
    except OSError as e:
        raise PersisterError(f"cannot reach the persister of job {entry.job} (pid {entry.pid}): {e}") from e
    finally:
        s.close()
    if not line:
        raise PersisterError(f"the persister of job {entry.job} (pid {entry.pid}) closed the connection "
                             f"without answering {op!r}")
    reply = P.decode(line)
    if not reply.get("ok"):
        raise P.error_from_record(reply.get("error", {}), context=f"persister pid {entry.pid}, op {op}")
    return reply
