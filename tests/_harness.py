"""Test harness: isolated snapckpt environments, multi-process launches under gloo, persister lookup.

Every test gets its own runtime directory (short, for AF_UNIX paths) and shared-memory directory through
the ``SNAPCKPT_RUNTIME_DIR`` / ``SNAPCKPT_SHM_DIR`` knobs, so tests never collide and leaks are visible.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import psutil
import torch

from _ports import (RendezvousPortTaken, free_port, port_taken, release_ports,  # noqa: F401
                    retry_on_port_taken, wait_listening)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def persisters(runtime_root: str) -> List[psutil.Process]:
    """Live persister processes whose runtime directory is under ``runtime_root``.

    Reads ``/proc/<pid>/cmdline`` directly and asks psutil about the matches only: tests poll this every
    20 ms while they wait, and ``psutil.process_iter`` over every process cost about 6x the CPU."""
    needle, root = b"snapckpt.persister", os.fsencode(runtime_root)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # gone meanwhile
            continue
        if root not in cmd or needle not in cmd.split(b"\0"):
            continue
        try:
            p = psutil.Process(int(name))
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def gone(pid: int) -> bool:
    """Whether process ``pid`` exited and its files are closed (a zombie of the process that started it, whose
    other threads are gone too, counts)."""
    try:
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE and p.num_threads() <= 1
    except psutil.NoSuchProcess:
        return True


def wait_until(pred, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``pred()`` until true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


@dataclass
class SnapEnv:
    """One test's isolated snapckpt environment."""

    runtime_root: str
    shm_root: str
    ckpt_dir: str
    tmp: str
    env: Dict[str, str] = field(default_factory=dict)

    def persisters(self) -> List[psutil.Process]:
        return persisters(self.runtime_root)

    def shm_files(self) -> List[str]:
        out = []
        for root, _, files in os.walk(self.shm_root):
            out += [os.path.join(root, f) for f in files]
        return out

    def kill_persisters(self, sig: int = signal.SIGKILL) -> None:
        for p in self.persisters():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


@contextlib.contextmanager
def isolated_snap_env(tmp: str) -> Iterator[SnapEnv]:
    """A fresh :class:`SnapEnv` under ``tmp`` (its own runtime and shared-memory directories, given to child
    processes through ``env``; this process's environment is left alone).

    On exit, unless ``leftover_ok`` was set: its persisters must have exited and its shared memory must be
    empty (contract 10). Then whatever is left is killed and the directories are removed. The ``snap_env``
    fixture (tests/conftest.py) is this per test; a module-scoped fixture that runs one job for several tests
    uses it directly."""
    key = uuid.uuid4().hex[:8]
    runtime_root = f"/tmp/sr-{key}"
    shm_root = f"/dev/shm/snapckpt-test-{key}"
    os.makedirs(runtime_root, mode=0o700)
    os.makedirs(shm_root, mode=0o700)
    env = {"SNAPCKPT_RUNTIME_DIR": runtime_root, "SNAPCKPT_SHM_DIR": shm_root}
    se = SnapEnv(runtime_root, shm_root, os.path.join(tmp, "ckpt"), tmp, env)
    se.leftover_ok = False
    ok = False
    try:
        yield se
        ok = True
    finally:
        try:
            if ok and not se.leftover_ok:
                gone = wait_until(lambda: not se.persisters(), timeout=15)
                assert gone, f"persister processes outlived the test: {[p.pid for p in se.persisters()]}"
                assert wait_until(lambda: not se.shm_files(), timeout=5), \
                    f"shared-memory files outlived the test: {se.shm_files()}"
        finally:
            se.kill_persisters(signal.SIGKILL)
            wait_until(lambda: not se.persisters(), timeout=5)
            shutil.rmtree(runtime_root, ignore_errors=True)
            shutil.rmtree(shm_root, ignore_errors=True)


def launch(script: str, nprocs: int, args: Sequence[str], env: Dict[str, str],
           port: Optional[int] = None) -> List[subprocess.Popen]:
    """Start ``nprocs`` ranks of ``tests/workers/<script>`` with a gloo rendezvous on a free port (reserved:
    :func:`free_port`); each process's ``rendezvous_port`` attribute is that port.

    RANK/WORLD_SIZE/MASTER_* are only the rendezvous of ``init_process_group(env://)``; snapckpt itself
    derives placement from torch.distributed.
    """
    port = port or free_port()
    procs = []
    for rank in range(nprocs):
        e = dict(os.environ)
        e.update(env)
        e.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        e.pop("LOCAL_RANK", None)
        e.pop("LOCAL_WORLD_SIZE", None)
        p = subprocess.Popen([sys.executable, os.path.join(WORKERS, script), *args], env=e,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        p.rendezvous_port = port
        procs.append(p)
    return procs


def finish(procs: List[subprocess.Popen], timeout: float = 120) -> List[str]:
    """Wait for every process; return their outputs; kill all and raise if any hangs past ``timeout``.

    Raises:
        RendezvousPortTaken: a rank of a :func:`launch` failed to bind its rendezvous port (taken by a process
            outside the reservation); the others, which would wait on that port, are killed at once.
        AssertionError: a rank hung past ``timeout`` seconds.
    """
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank hung past {timeout} s; output so far: "
                                 f"{[q.communicate()[0] for q in procs]}")
        outs.append(out)
        port = getattr(p, "rendezvous_port", None)
        if port is not None and p.returncode != 0 and port_taken(out, port):
            for q in procs[len(outs):]:  # waiting on the port: no use waiting for them
                q.kill()
                q.communicate()
            raise RendezvousPortTaken(port, out)
    return outs


def finish_ok(procs: List[subprocess.Popen], timeout: float = 120) -> List[str]:
    """:func:`finish`, then assert every rank exited 0. With :func:`launch`, runs a job beside another one
    (an independent reference run while the run under test goes on) and collects it later."""
    outs = finish(procs, timeout)
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{o}"
    return outs


def run_ranks(script: str, nprocs: int, args: Sequence[str], env: Dict[str, str], timeout: float = 120,
              check: bool = True) -> List[str]:
    """Launch, wait, and (with ``check``) assert every rank exited 0.

    A launch whose rank 0 could not bind its rendezvous port (:class:`RendezvousPortTaken`: that exact error,
    nothing else) is launched again on a fresh port, at most ``PORT_RETRIES`` times, each retry noted
    (:func:`retry_on_port_taken`), then raised; no rank got past ``init_process_group`` in the launch that
    failed so."""
    def once() -> List[str]:
        procs = launch(script, nprocs, args, env)
        return finish_ok(procs, timeout) if check else finish(procs, timeout)
    return retry_on_port_taken(f"run_ranks({script})", once)


def run_torchrun(argv: Callable[[int], Sequence[str]], **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(argv(port), capture_output=True, text=True, **kw)`` for a torchrun (or any launcher
    whose rendezvous store binds ``port``) on a reserved port; a run that failed because its store could not
    bind the port (:func:`port_taken` in its output, that exact error) is run again on a fresh port, at most
    ``PORT_RETRIES`` times, each retry noted. A c10d rendezvous must pass ``--rdzv_conf is_host=1``: without
    it a taken port makes torchrun connect to whatever holds the port and wait, instead of failing."""
    def once() -> subprocess.CompletedProcess:
        port = free_port()
        cp = subprocess.run(list(argv(port)), capture_output=True, text=True, **kw)
        out = (cp.stdout or "") + (cp.stderr or "")
        if cp.returncode != 0 and port_taken(out, port):
            raise RendezvousPortTaken(port, out, result=cp)
        return cp
    return retry_on_port_taken(_what("run_torchrun", argv), once)


def _what(fn: str, argv: Callable[[int], Sequence[str]]) -> str:
    """``fn(<the script>)``: the first ``.py`` argument (whatever the port), for a retry's note."""
    a = list(argv(0))
    return f"{fn}({next((os.path.basename(x) for x in a if x.endswith('.py')), a[0])})"


class _Launcher(subprocess.Popen):
    """A ``Popen`` whose output, once :func:`start_torchrun` read it (``read_out``), its ``communicate`` returns."""

    read_out: Optional[str] = None

    def communicate(self, input=None, timeout=None):
        if self.read_out is not None:
            self.wait()
            return self.read_out, None
        return super().communicate(input, timeout)


def start_torchrun(argv: Callable[[int], Sequence[str]], store_timeout: float = 120,
                   **kw) -> subprocess.Popen:
    """``subprocess.Popen(argv(port), stdout=PIPE, stderr=STDOUT, text=True, **kw)`` for a torchrun agent that
    hosts its rendezvous store on a reserved ``port``, returned once the agent listens on the port (or has
    exited, or ``store_timeout`` seconds passed: then the caller sees whatever happened). An agent that exited
    because the port was taken (:func:`port_taken`, that exact error) is started again on a fresh port, at
    most ``PORT_RETRIES`` times, each retry noted; its workers had not been started."""
    def once() -> subprocess.Popen:
        port = free_port()
        proc = _Launcher(list(argv(port)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        if wait_listening(proc.pid, port, store_timeout) or proc.poll() is None:
            return proc
        proc.read_out = proc.communicate()[0]  # exited: the caller's communicate() gets this output again
        if port_taken(proc.read_out, port):
            raise RendezvousPortTaken(port, proc.read_out, result=proc)
        return proc
    return retry_on_port_taken(_what("start_torchrun", argv), once)


def result_lines(out: str, tag: str = "RESULT") -> List[str]:
    """What follows each ``tag`` in a worker's output, one entry per tag (the tag removed). Several ranks share
    one stream under torchrun and an unbuffered ``print`` writes its text and its newline separately, so two
    ranks' records can land on one line (``RESULT {...}RESULT {...}``): each is split off."""
    return [part.strip() for l in out.splitlines() if tag in l for part in l.split(tag)[1:]]


def used_bytes(path: str) -> int:
    """Bytes in use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def proc_status_bytes(pid: int, key: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``RssAnon``, ``VmRSS``...) in bytes; -1 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def tree(path: str) -> list:
    """Every file and directory below ``path``, relative, sorted."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


def assert_equal_state(x, y, where: str = "", strict: bool = False) -> None:
    """Assert two loaded checkpoint objects are equal: tensors by dtype and value, containers recursively,
    numpy arrays elementwise, anything else by ``==``; ``where`` names the first difference.

    ``strict`` also requires the same container types, dict key order, and tensor shape, stride and
    ``requires_grad`` (what a restore must reproduce exactly)."""
    if strict:
        assert type(x) is type(y), f"{where}: {type(x).__name__} != {type(y).__name__}"
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
        if strict:
            assert (x.shape, x.stride(), x.requires_grad) == (y.shape, y.stride(), y.requires_grad), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        if strict:
            assert list(x) == list(y), f"{where}: key order"
        for k in x:
            assert_equal_state(x[k], y[k], f"{where}.{k}", strict)
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y)):
            assert_equal_state(a, b, f"{where}[{i}]", strict)
    elif type(x).__module__ == "numpy":
        assert (x == y).all(), where
    else:
        assert x == y, where


def assert_same_state(a, b, path: str = "state", strides: bool = False) -> None:
    """Equal values of equal types through dicts (keys and their types, an ``OrderedDict``'s attributes), lists
    and tuples; floats bit for bit (NaN payloads, -0.0); tensors by type, dtype, shape, ``requires_grad`` and
    values, and by stride with ``strides``."""
    import collections
    import struct

    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert not strides or a.stride() == b.stride(), path
        assert torch.equal(a.detach(), b.detach()), path
    elif isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}[{k!r}]", strides)
        if type(a) is collections.OrderedDict:
            assert_same_state(vars(a), vars(b), f"{path}.__dict__", strides)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]", strides)
    elif type(a) is float:
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


class SlotOnFile:
    """A slot file of ``nbytes`` bytes filled with garbage (a reused slot's old bytes), mapped as the saver maps it
    (``m``: a :class:`~snapckpt.engine.slot_maps.MappedSlot`), and the saves into it that the Saver makes."""

    def __init__(self, path, nbytes: int) -> None:
        from snapckpt.engine.slot_maps import MappedSlot

        with open(path, "wb") as f:
            f.write(bytes(range(256)) * (nbytes // 256))
        self.m = MappedSlot(str(path), nbytes)

    def save(self, st, state, step: int, by_file: bool = True, name: str = "rank_00000.pt"):
        """Prepare ``state`` as file ``name`` with the Stager ``st`` and copy it into the slot (``by_file``: with the
        slot file, so small tensors go by ``pwritev``); returns the ``Prepared``."""
        p = st.prepare({name: state}, step)
        p.views = self.m.views
        if by_file:
            p.slot_file = self.m.file
        type(st).copy_into(p, self.m.tensor, self.m.buf)
        return p
