"""Training-process side of the persister: find or start it, send requests, detect death and hangs.

Sequence: :meth:`PersisterClient.connect` takes the job's ``spawn.lock`` (``flock``; released by the
kernel if the holder dies, case C8), tries the socket, and if nobody answers starts
``python -m snapckpt.persister`` in a new session (so a ``kill -9`` of the training process group does not
reach it) and waits, bounded, until the socket accepts (case C7). It then sends ``hello`` with the token
the persister wrote. Each :meth:`request` is one JSON line out and one back, bounded by
``request_timeout_secs``: end of stream means the persister died (:class:`PersisterDiedError`), no answer
in time means it is hung (:class:`PersisterTimeoutError`). After either the connection is dropped; the
next ``connect`` starts a new persister if the old one is gone.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Tuple

from snapckpt._internal.private_dirs import private_dir
from snapckpt.errors import (PersistError, PersisterDiedError, PersisterError, PersisterTimeoutError,
                             ProtocolVersionError)
from snapckpt.persister import protocol as P
from snapckpt.storage.urls import is_remote_url

__all__ = ["PersisterClient", "job_key", "job_of_run", "job_dirs", "lock_file", "private_dir", "JOB_KEY_LEN"]

JOB_KEY_LEN = 16


def job_key(checkpoint_dir: str, job_id: Optional[str]) -> str:
    """16 hex digits naming a job on a host: ``sha256(uid, realpath(checkpoint_dir), job_id)`` (a URL of
    remote-only mode as it is)."""
    where = checkpoint_dir if is_remote_url(checkpoint_dir) else os.path.realpath(checkpoint_dir)
    raw = f"{os.getuid()}\0{where}\0{job_id or ''}".encode()
    return hashlib.sha256(raw).hexdigest()[:JOB_KEY_LEN]


def job_of_run(run_id: str) -> str:
    """The job key a run id starts with (run ids are ``job key + 12 random hex digits``)."""
    return run_id[:JOB_KEY_LEN]


def job_dirs(runtime_root: str, shm_root: str, key: str) -> tuple:
    """``(runtime_dir, arena_dir)`` of a job: ``<runtime>/snapckpt-<uid>/<key>``, ``<shm>/snapckpt-<uid>-<key>``."""
    uid = os.getuid()
    return (os.path.join(runtime_root, f"snapckpt-{uid}", key),
            os.path.join(shm_root, f"snapckpt-{uid}-{key}"))


def lock_file(path: str, deadline: float, what: str) -> int:
    """Take an exclusive ``flock`` on ``path`` (created 0600, its directory 0700 if missing) before the
    monotonic ``deadline``; return the open fd (closing it releases the lock).

    The persister deletes its runtime directory, lock files included, when it exits after a clean life;
    a locker that got the lock on a file that has meanwhile been unlinked or replaced drops it and tries
    again on the current file, so two processes never both believe they hold the lock.

    Raises:
        PersisterTimeoutError: another live process held it until the deadline (``what`` names it).
    """
    while True:
        private_dir(os.path.dirname(path))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise PersisterTimeoutError(f"could not take {path} within the deadline ({what} "
                                                    "holds it)")
                    time.sleep(0.02)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def _pid_in(path: str) -> Optional[int]:
    """The pid written in a ``persister.pid`` file, or ``None`` (missing, unreadable, not a number)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _hung_state(pid: Optional[int]) -> str:
    """What ``/proc`` says of a persister that does not answer: stopped (``SIGSTOP``, a debugger), gone, or
    running (it may be hung); a phrase for an error message."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, ValueError, TypeError):
        return "it may be hung"
    if state in ("T", "t"):
        return "it is stopped (SIGSTOP or a debugger: resume it with kill -CONT, or kill it)"
    if state in ("Z", "X"):
        return "it has exited"
    return f"it is alive (state {state}) but may be hung"


#: The remedy every :class:`PersisterDiedError` names.
RESTART_HINT = ("the next snapckpt call starts a new persister; repeat any save that was not committed "
                "(its snapshot is lost)")


class PersisterClient:
    """One connection from one rank of a training process to its node persister.

    Args:
        runtime_dir: the job's runtime directory (socket, token, locks, log).
        arena_dir: the job's arena directory (passed to a persister this client starts).
        job: the job key (:func:`job_key`).
        startup_timeout_secs, request_timeout_secs, idle_timeout_secs: bounds in seconds.
    """

    def __init__(self, runtime_dir: str, arena_dir: str, job: str, *, startup_timeout_secs: float,
                 request_timeout_secs: float, idle_timeout_secs: float) -> None:
        self.runtime_dir = runtime_dir
        self.arena_dir = arena_dir
        self.job = job
        self.startup_timeout_secs = startup_timeout_secs
        self.request_timeout_secs = request_timeout_secs
        self.idle_timeout_secs = idle_timeout_secs
        self.sock: Optional[socket.socket] = None
        self.rfile = None
        self.persister_pid: Optional[int] = None
        # one entry per request sent whose reply is not read yet, in the order the persister answers: None for a
        # reply to drop (a KeyboardInterrupt in the wait for it, a plain post), or what a checked post asked
        # (its refusal is raised by the next request, :meth:`settle`)
        self._owed: Deque[Optional[str]] = deque()
        #: called (no arguments) right after this client started a persister, while it waits for it to listen
        self.on_spawn: Optional[Callable[[], None]] = None
        if len(self.sock_path.encode()) > 107:
            raise PersisterError(
                f"runtime directory {runtime_dir!r} is too long for a unix socket path "
                f"({len(self.sock_path.encode())} bytes > 107); set runtime_dir= (or SNAPCKPT_RUNTIME_DIR) "
                "to a shorter directory such as /tmp")
        private_dir(os.path.dirname(runtime_dir))
        private_dir(runtime_dir)

    @property
    def log_path(self) -> str:
        return os.path.join(self.runtime_dir, "persister.log")

    @property
    def sock_path(self) -> str:
        return os.path.join(self.runtime_dir, "persister.sock")

    def _try_connect(self) -> Optional[socket.socket]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.sock_path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            return None

    def _spawn(self) -> Tuple[subprocess.Popen, int]:
        """Start the persister; return it and the read end of the pipe it writes to once it listens."""
        import snapckpt

        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(snapckpt.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        ready_r, ready_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "snapckpt.persister", "--runtime-dir", self.runtime_dir,
                 "--arena-dir", self.arena_dir, "--job", self.job,
                 "--idle-timeout-secs", str(self.idle_timeout_secs), "--ready-fd", str(ready_w)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True,
                close_fds=True, pass_fds=(ready_w,))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            log.close()
            os.close(ready_w)
        return proc, ready_r

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 2000))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def connect(self, hello: Dict[str, Any]) -> Dict[str, Any]:
        """Find or start the persister and say hello; return the hello response.

        A persister killed a moment ago can still accept a connection while its threads exit and then
        reset it; such a hello is retried (a live persister is found or started) until the deadline.

        Raises:
            PersisterTimeoutError: no persister answered within ``startup_timeout_secs``.
            PersisterDiedError: every persister found died during the hello, until the deadline.
            PersisterError: the persister refused the hello (another job on this directory...).
        """
        deadline = time.monotonic() + self.startup_timeout_secs
        while True:
            try:
                return self._connect_once(hello, deadline)
            except PersisterDiedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _connect_once(self, hello: Dict[str, Any], deadline: float) -> Dict[str, Any]:
        self.close()
        lock_fd = lock_file(os.path.join(self.runtime_dir, "spawn.lock"), deadline,
                            "another process of this job")
        ready = -1  # the read end of the started persister's readiness pipe
        try:
            sock = self._try_connect()
            proc = None
            while sock is None:
                if proc is None:
                    proc, ready = self._spawn()
                    if self.on_spawn is not None:
                        self.on_spawn()
                elif proc.poll() is not None and proc.returncode != 0:
                    raise PersisterError(f"the snapckpt persister exited with code {proc.returncode} at "
                                         f"startup; its log ({self.log_path}) ends with:\n{self._log_tail()}")
                left = deadline - time.monotonic()
                if left < 0:
                    raise PersisterTimeoutError(
                        f"the snapckpt persister did not start listening on {self.sock_path} within "
                        f"{self.startup_timeout_secs:g} s; raise persister_startup_timeout_secs or see "
                        f"{self.log_path}")
                if ready >= 0:
                    # woken by its "listening" byte, or by end of file when it exits; bounded slices so
                    # that an exit is seen (a grandchild could keep the pipe open)
                    if select.select([ready], [], [], min(left, 0.2))[0]:
                        os.close(ready)
                        ready = -1
                else:  # listening already said, or exited: poll (rare)
                    time.sleep(0.02)
                sock = self._try_connect()
        finally:
            os.close(lock_fd)
            if ready >= 0:
                os.close(ready)
        self.sock = sock
        self.sock.settimeout(self.request_timeout_secs)
        self.rfile = sock.makefile("rb")
        with open(os.path.join(self.runtime_dir, "token")) as f:
            token = f.read().strip()
        return self._hello(token, hello)

    def _hello(self, token: str, hello: Dict[str, Any]) -> Dict[str, Any]:
        """Send ``hello`` (this side's protocol version, the token, ``hello``'s fields); return its reply.

        Raises:
            ProtocolVersionError: the persister runs another protocol version (an older one refuses the
                version field itself); the connection is closed.
            Any other refusal of ``hello``, as :meth:`request`.
        """
        try:
            reply = self.request("hello", protocol=P.PROTOCOL_VERSION, token=token, job=self.job, **hello)
        except PersistError as e:  # an older persister's refusal of the unknown "protocol" field
            if "op 'hello': fields" not in str(e):
                raise
            self.close()
            raise P.version_mismatch(P.PROTOCOL_VERSION, None, self._pid()) from e
        except ProtocolVersionError:
            self.close()
            raise
        self.persister_pid = reply.get("persister_pid")
        return reply

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def request(self, op: str, **fields: Any) -> Dict[str, Any]:
        """Send one request and return the ``ok`` response's fields. The answers of checked posts come first
        (:meth:`settle`).

        Raises:
            PersisterDiedError / PersisterTimeoutError: as described in the module docstring.
            Any error the persister returned, rebuilt with its original type (also the refusal of a checked post,
            before this request is sent).
        """
        self.settle()
        self._send(op, fields)
        self._owed.append(None)
        while True:
            line = self._read_line(op)
            self._owed.popleft()
            if not self._owed:
                break  # this request's reply; the lines before it answered interrupted requests or posts
        return self._reply(line, f"op {op}")

    def post(self, op: str, check: bool = False, **fields: Any) -> None:
        """Send one request without waiting for its answer, which the persister sends in order; the next
        :meth:`request` reads it first. ``check`` False: the answer is dropped, for a request whose refusal changes
        nothing for the caller (``stream``: the persister then writes the slot at ``ready``). ``check`` True: the
        next :meth:`request` or :meth:`settle` raises its refusal (a MEMORY save's ``ready``: the round trip is
        off the training thread, and the answer is there by the next request).

        Raises:
            PersisterDiedError: not connected, or the send failed (the connection is then closed).
        """
        self._send(op, fields)
        self._owed.append((f"{op} of step {fields['step']}" if "step" in fields else op) if check else None)

    def settle(self) -> None:
        """Read the answers of the checked posts sent so far (waiting for them if needed; those of dropped
        requests before them too).

        Raises:
            The refusal of the first checked post the persister refused, rebuilt with its original type (the
            answers after it stay owed); PersisterDiedError / PersisterTimeoutError as for :meth:`request`.
        """
        while any(what is not None for what in self._owed):
            line = self._read_line(self._owed[0] or "an earlier request")
            what = self._owed.popleft()
            if what is not None:
                self._reply(line, f"op {what}, sent without waiting for its answer")

    def _send(self, op: str, fields: Dict[str, Any]) -> None:
        if self.sock is None:
            raise PersisterDiedError(f"not connected to the snapckpt persister (it died or was closed); {RESTART_HINT}")
        try:
            self.sock.sendall(P.encode({"op": op, **fields}))
        except OSError as e:
            self.close()
            raise PersisterDiedError(
                f"lost the snapckpt persister (pid {self._pid()}) during {op!r}: {e}; snapshots it held in "
                f"memory are gone, committed checkpoints are intact; {RESTART_HINT} (log: {self.log_path})") from e

    def _read_line(self, op: str) -> bytes:
        """The next answer line (``op`` names the request for errors).

        Raises:
            PersisterDiedError (end of stream, connection lost) / PersisterTimeoutError (no answer in time).
        """
        if self.sock is None:
            raise PersisterDiedError(f"not connected to the snapckpt persister (it died or was closed); {RESTART_HINT}")
        try:
            line = self.rfile.readline(P.MAX_MESSAGE_NBYTES + 1)
        except socket.timeout as e:
            self._abandon()
            pid = self._pid()
            raise PersisterTimeoutError(
                f"the snapckpt persister (pid {pid}) did not answer {op!r} within "
                f"{self.request_timeout_secs:g} s; {_hung_state(pid)}; committed checkpoints "
                f"are intact. If it is only slow (an overloaded node), raise request_timeout_secs; if it is "
                f"hung, kill it (kill -9 {pid if pid else 'its pid, in persister.pid'}): {RESTART_HINT} "
                f"(log: {self.log_path})") from e
        except OSError as e:
            self.close()
            raise PersisterDiedError(
                f"lost the snapckpt persister (pid {self._pid()}) during {op!r}: {e}; snapshots "
                f"it held in memory are gone, committed checkpoints are intact; {RESTART_HINT} "
                f"(log: {self.log_path})") from e
        if not line:
            self.close()
            raise PersisterDiedError(
                f"the snapckpt persister (pid {self._pid()}) died (connection closed during {op!r}); "
                f"snapshots it held in memory are gone, committed checkpoints are intact; {RESTART_HINT} "
                f"(log: {self.log_path})")
        return line

    def _reply(self, line: bytes, context: str) -> Dict[str, Any]:
        reply = P.decode(line)
        if not reply.get("ok"):
            raise P.error_from_record(reply.get("error", {}), context=f"persister pid {self._pid()}, {context}")
        return reply

    def _pid(self) -> Optional[int]:
        """The persister's pid for messages: from ``hello``'s reply, or before it from ``persister.pid``."""
        return self.persister_pid or _pid_in(os.path.join(self.runtime_dir, "persister.pid"))

    def _abandon(self) -> None:
        """Give up this connection after a request timed out: queue an ``abandon`` behind the unanswered
        request (no reply awaited) and close. The persister reads it before the end of the stream, so a
        hung persister that recovers does not take this live process for a dead rank."""
        try:
            self.sock.send(P.encode({"op": "abandon"}), socket.MSG_DONTWAIT)
        except OSError:
            pass
        self.close()

    def close(self, bye: bool = False) -> None:
        """Close the connection; with ``bye`` tell the persister it is a clean close. The answers still owed to
        checked posts are dropped (the caller settles them first if it wants their refusals)."""
        if self.sock is None:
            return
        self._owed = deque(None for _ in self._owed)
        if bye:
            try:
                self.request("bye")
            except PersisterError:
                pass
        if self.sock is not None:
            try:
                self.rfile.close()
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self.rfile = None
        self._owed.clear()
