"""The persister's files in the job's runtime directory: made at start, removed at exit (contract 10).

Data path: none; this is the process's footprint. :mod:`snapckpt.persister.server` calls these when it
starts (the pid-file lock, the secret token, the listening socket) and when it exits (everything removed,
or everything but ``persister.log`` and ``spawn.lock`` after a crash or a failure, so that the cause can
be read). Clients find the same files through :mod:`snapckpt.persister.client`, which owns the lock
helper used here.

Files, all owner-only in the owner-only runtime directory: ``persister.pid`` (this process's pid, under
an exclusive ``flock`` while it lives), ``token`` (0600, the secret a client's ``hello`` presents),
``persister.sock`` (0600), ``spawn.lock`` (taken by clients while they start or find a persister),
``persister.log``.
"""
from __future__ import annotations

import os
import socket
import time

from snapckpt.persister.client import lock_file

__all__ = ["lock_pid_file", "write_token", "listen", "lock_spawn", "remove_runtime_files"]


def lock_pid_file(runtime_dir: str) -> int:
    """Take the job's ``persister.pid`` lock (waiting up to 30 s for a previous persister of the job to
    finish its exit) and write this process's pid into it; return the fd (the lock lives as long as it).

    Raises:
        PersisterError: another persister of this job still holds it.
    """
    pid_fd = lock_file(os.path.join(runtime_dir, "persister.pid"), time.monotonic() + 30.0,
                       "another persister of this job")
    os.ftruncate(pid_fd, 0)
    os.write(pid_fd, str(os.getpid()).encode())
    return pid_fd


def write_token(runtime_dir: str, token: str) -> None:
    """Write the secret ``token`` to ``runtime_dir/token`` (0600), atomically."""
    token_path = os.path.join(runtime_dir, "token")
    fd = os.open(token_path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, token.encode())
    os.close(fd)
    os.replace(token_path + ".tmp", token_path)


def listen(sock_path: str) -> socket.socket:
    """A non-blocking Unix socket listening at ``sock_path`` (created 0600; a stale one is replaced)."""
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600 (owner-only, as the token)
    try:
        listener.bind(sock_path)
    finally:
        os.umask(old)
    listener.listen(256)
    listener.setblocking(False)
    return listener


def lock_spawn(runtime_dir: str) -> int:
    """Take the clients' ``spawn.lock`` (so that no client is between "found the socket" and
    "connected"); return the fd, whose closing releases it."""
    return lock_file(os.path.join(runtime_dir, "spawn.lock"), time.monotonic() + 3600.0,
                     "a client starting up")


def remove_runtime_files(runtime_dir: str, keep_log: bool) -> None:
    """Delete the socket, the token and the pid file; unless ``keep_log``, also the log, the spawn lock
    and the runtime directory itself (lock files included: lockers re-check the inode they locked, see
    :func:`snapckpt.persister.client.lock_file`), so nothing of the job outlives it."""
    # the pid file goes in every case: once this process is gone its pid may be reused, and the README
    # tells users to kill the pid it names
    names = ["persister.sock", "token", "persister.pid"]
    if not keep_log:
        names += ["persister.log", "spawn.lock"]
    for name in names:
        try:
            os.unlink(os.path.join(runtime_dir, name))
        except FileNotFoundError:
            pass
    if not keep_log:
        try:
            os.rmdir(runtime_dir)
        except OSError:
            pass
