"""TCP ports for the tests' rendezvous and servers: reserved across every process on the host, and the one
error that says a launcher lost its port anyway.

Kept apart from ``_harness`` (which imports torch) so that a child process of a test can draw ports cheaply.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, TypeVar

import psutil

#: The ports drawn from, ``[lo, hi)``: below the kernel's ephemeral range (32768-60999 here), so no socket
#: bound to port 0 (the persisters' peer channels, gloo's pairs, a client's end) can be given one of them.
PORT_RANGE: Tuple[int, int] = (20000, 32768)

#: Where the reservations live: one lock file per port, shared by every process on the host (every pytest-xdist
#: worker, and every other test session running beside this one). The files stay; a held lock is the reservation.
LOCK_DIR = os.path.join(tempfile.gettempdir(), "snapckpt-test-ports")

_PORTS = random.SystemRandom()
_held: Dict[int, Tuple[int, bool]] = {}  # port -> (fd of its locked file, kept for the session)


class RendezvousPortTaken(AssertionError):
    """A launch failed because its rendezvous port was bound by a process outside the reservation (EADDRINUSE
    at the rendezvous store's bind); ``port`` is that port, ``result`` the failed launch where the launcher
    hands it back after its last retry. The harness relaunches on a fresh port where it owns the launch
    (:func:`retry_on_port_taken`: ``run_ranks``, ``run_torchrun``, ``start_torchrun``, ``Rig.torchrun_all``)."""

    def __init__(self, port: int, output: str, result: Any = None) -> None:
        super().__init__(f"the rendezvous port {port} was taken by another process (EADDRINUSE when the "
                         f"rendezvous store bound it):\n{output[-4000:]}")
        self.port, self.result = port, result


def free_port(*, session: bool = False) -> int:
    """A TCP port of :data:`PORT_RANGE`, free on 127.0.0.1 and reserved for the caller: no other draw on this
    host gets it while the reservation holds.

    The reservation is an exclusive ``flock`` on ``LOCK_DIR/<port>``, taken before the port is checked with a
    bind (without ``SO_REUSEADDR``, so a port a closed socket still holds in ``TIME_WAIT`` is skipped too). It
    holds until :func:`release_ports` (the autouse fixture of tests/conftest.py calls it when each test has
    torn down), or with ``session`` until this process exits (a server that lives for the session); a
    process that dies drops its locks with it. The lock, not the file, is the reservation: the files are never
    removed (removing one could let two processes lock two different files of one name).

    History: the port used to be checked with a bind, released, and returned, so two draws (two xdist
    workers, or two launches of one test) could get the same port before either launcher bound it, and a
    server of another test could bind it in between (a torchrun rendezvous failed with EADDRINUSE in CI).
    Before that, ports came from ``bind(0)`` (the kernel gives them to any ``bind(0)`` again: a torchrun agent
    connected to another test's peer channel and waited forever), and from the ``random`` module (a Trainer
    seeds it: two xdist workers drew the same ports in step). The draw still uses the OS's randomness.

    Raises:
        RuntimeError: every port of the range is reserved or bound.
    """
    lo, hi = PORT_RANGE
    _make_lock_dir()
    start = _PORTS.randrange(hi - lo)
    for i in range(hi - lo):  # from a random start, every port once
        port = lo + (start + i) % (hi - lo)
        if port in _held:
            continue
        fd = os.open(os.path.join(LOCK_DIR, str(port)), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue  # another process's reservation
            raise
        if not _bindable(port):
            os.close(fd)
            continue
        _held[port] = (fd, session)
        return port
    raise RuntimeError(f"no free TCP port in {lo}-{hi - 1} on 127.0.0.1 (all reserved under {LOCK_DIR} or bound)")


def release_ports(ports: Optional[Iterable[int]] = None) -> None:
    """End this process's reservations of ``ports`` (default: all but the session ones)."""
    for port in list(_held if ports is None else ports):
        fd, session = _held.get(port, (None, False))
        if fd is None or (ports is None and session):
            continue
        del _held[port]
        os.close(fd)


def held_ports() -> Dict[int, bool]:
    """This process's reserved ports, each with whether it is kept for the session."""
    return {p: s for p, (_, s) in _held.items()}


def _make_lock_dir() -> None:
    if not os.path.isdir(LOCK_DIR):
        os.makedirs(LOCK_DIR, exist_ok=True)
        try:
            os.chmod(LOCK_DIR, 0o1777)  # other users' sessions share it (their files are theirs: sticky)
        except PermissionError:
            pass


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_taken(output: str, port: int) -> bool:
    """Whether ``output`` (a launcher's or a rank's) shows its rendezvous store failing to bind ``port`` because
    the port was in use: torch's ``TCPStore`` error, with this port and EADDRINUSE, which nothing else prints
    (the store's own listener, under torchrun's static and c10d rendezvous and ``init_process_group(env://)``)."""
    needle = f"The server socket has failed to listen on any local network address. port: {port},"
    return any(needle in line and "EADDRINUSE" in line for line in output.splitlines())


def wait_listening(pid: int, port: int, timeout: float) -> bool:
    """Wait until process ``pid`` or one of its descendants listens on TCP ``port`` (True), or ``pid`` exits or
    ``timeout`` seconds pass (False). Used to learn that a launcher's rendezvous store is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            root = psutil.Process(pid)
            if root.status() == psutil.STATUS_ZOMBIE:
                return False
            for p in [root, *root.children(recursive=True)]:
                try:
                    conns = getattr(p, "net_connections", None) or p.connections  # psutil < 6: connections
                    if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                           for c in conns(kind="tcp")):
                        return True
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.1)
    return False


class PortRetryWarning(UserWarning):
    """A launch was retried on a fresh port after :class:`RendezvousPortTaken` (shown in pytest's summary)."""


#: How many times a launch whose rendezvous port was taken is started again on a fresh port.
PORT_RETRIES = 2

T = TypeVar("T")


def retry_on_port_taken(what: str, launch: Callable[[], T],
                        before_retry: Optional[Callable[[T], None]] = None) -> T:
    """``launch()`` (which draws its own port), started again while it raises :class:`RendezvousPortTaken`, at
    most ``PORT_RETRIES`` times; each retry is said on stderr (a ``[ports]`` line) and as a
    :class:`PortRetryWarning` (pytest's summary) naming ``what``. ``before_retry(err.result)`` runs first
    (e.g. to kill what the failed launch left waiting on the port).

    Returns: ``launch()``'s result; after the last retry, the error's ``result`` where it carries one (the
    caller sees the failed launch as it is).

    Raises:
        RendezvousPortTaken: the last retry lost its port too, and the error carries no ``result``.
    """
    import sys
    import warnings

    for attempt in range(1, PORT_RETRIES + 2):
        try:
            return launch()
        except RendezvousPortTaken as err:
            if attempt > PORT_RETRIES:
                if err.result is None:
                    raise
                return err.result
            if before_retry is not None:
                before_retry(err.result)
            msg = (f"{what}: rendezvous port {err.port} was taken by another process (EADDRINUSE); launching "
                   f"again on a fresh port (retry {attempt} of {PORT_RETRIES})")
            print(f"[ports] {msg}", file=sys.stderr, flush=True)
            warnings.warn(msg, PortRetryWarning, stacklevel=3)  # at the launcher's caller
    raise AssertionError("unreachable")
