"""Shared helpers for the snapckpt benchmarks.

Units throughout: sizes in bytes, durations in seconds, unless a name says otherwise
(``*_gib`` = gibibytes, ``*_s`` = seconds).

Nothing here imports snapckpt, so the helpers (and the baseline methods that use them) work
while the core package is still being written.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

GiB = 1024**3
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Substring that identifies the snapckpt node persister in a process command line.
PERSISTER_MARKER = "snapckpt.persister"


# --------------------------------------------------------------------------------------------
# The state under test
# --------------------------------------------------------------------------------------------

def make_state(total_bytes: int, n_layers: int = 8, seed: int = 0) -> dict[str, Any]:
    """Build a model + AdamW-like state dict of about ``total_bytes`` bytes (fp32, CPU).

    Layout: ``n_layers`` layers of one large 2-D weight and one small bias, i.e. ``2 * n_layers``
    parameter tensors; the optimizer holds ``exp_avg`` and ``exp_avg_sq`` of the same shapes plus a
    0-d ``step`` tensor per parameter, and ``param_groups`` with the usual scalars; a few top-level
    scalars (``step``, ``epoch``, ``loss``) complete it. Params are therefore ~1/3 of the bytes.
    Every tensor is filled with random data so that no page is left untouched (zero pages would
    flatter copies) and nothing compresses.
    """
    gen = torch.Generator().manual_seed(seed)
    param_bytes = total_bytes // 3
    bias_numel = 4096
    cols = 1024
    weight_numel = max(cols, (param_bytes // 4 - n_layers * bias_numel) // n_layers)
    rows = max(1, weight_numel // cols)

    model: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        model[f"layers.{i}.weight"] = torch.rand(rows, cols, generator=gen)
        model[f"layers.{i}.bias"] = torch.rand(bias_numel, generator=gen)

    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, p in enumerate(model.values()):
        opt_state[idx] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.rand(p.shape, generator=gen),
            "exp_avg_sq": torch.rand(p.shape, generator=gen),
        }
    param_groups = [{
        "lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
        "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
        "fused": None, "params": list(range(len(model))),
    }]
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": param_groups},
        "step": 100,
        "epoch": 1,
        "loss": 2.345,
    }


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in a nested dict/list/tuple, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def copy_tensors(dst: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the tensor at the same place in ``dst`` (in place).

    Raises:
        ValueError: the two hold a different number of tensors (not the same state layout).
    """
    d, s = list(iter_tensors(dst)), list(iter_tensors(src))
    if len(d) != len(s):
        raise ValueError(f"restored object holds {len(s)} tensors, the live state {len(d)}")
    for a, b in zip(d, s):
        a.copy_(b)


def drop_page_cache(path: str | os.PathLike) -> None:
    """Evict the (clean) page-cache pages of a file, or of every file under a directory, with
    ``posix_fadvise(POSIX_FADV_DONTNEED)``, so that the next read comes from the disk. Needs no
    privilege; dirty pages are not dropped (fsync first). Errors are ignored (best effort)."""
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def state_nbytes(sd: Any) -> int:
    """Total tensor payload of ``sd`` in bytes."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(sd))


# --------------------------------------------------------------------------------------------
# Files and directories
# --------------------------------------------------------------------------------------------

def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scratch_root(explicit: str | None = None) -> tuple[Path, str]:
    """Choose a parent directory for checkpoint scratch dirs on the repo's disk.

    Returns ``(directory, reason)``. ``/tmp`` is used only when it lives on the same filesystem
    device as the repository and is not a tmpfs (a tmpfs would measure RAM, not the disk);
    otherwise ``<repo>/tmp`` (git-ignored) is used.
    """
    if explicit:
        p = Path(explicit)
        p.mkdir(parents=True, exist_ok=True)
        return p, "given by --scratch-dir"
    repo_dev = os.stat(REPO_ROOT).st_dev
    tmp = Path(tempfile.gettempdir())
    fstype = _fstype(tmp)
    if os.stat(tmp).st_dev == repo_dev and fstype not in ("tmpfs", "ramfs"):
        return tmp, f"{tmp} is {fstype} on the repo's device"
    p = REPO_ROOT / "tmp"
    p.mkdir(exist_ok=True)
    return p, f"{tmp} is {fstype} / another device; using the repo's git-ignored tmp/"


def _fstype(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (best match in /proc/mounts), or '?'."""
    path = path.resolve()
    best, best_type = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1]
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, best_type = mnt, parts[2]
    except OSError:
        pass
    return best_type


def rmtree_quiet(path: str | os.PathLike) -> None:
    """Remove a directory tree, ignoring errors (scratch cleanup)."""
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    """An unused TCP port on localhost (never rely on 29500)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Machine info
# --------------------------------------------------------------------------------------------

def git_commit() -> str:
    """HEAD commit of the repo (with ``+dirty`` when the work tree has changes), or a note."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "none (no commits yet)"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


def machine_info(scratch: Path) -> dict[str, Any]:
    """Facts that matter for reading the numbers (bytes, counts, strings)."""
    vm = psutil.virtual_memory()
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": vm.total,
        "ram_available_bytes_at_start": vm.available,
        "loadavg_at_start": os.getloadavg(),
        "git_commit": git_commit(),
        "scratch_dir": str(scratch),
        "scratch_fstype": _fstype(scratch),
        "dev_shm_bytes": shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None,
    }


# --------------------------------------------------------------------------------------------
# Peak RSS
# --------------------------------------------------------------------------------------------

def _read_hwm_bytes(pid: int | str = "self") -> int | None:
    """VmHWM (peak resident set size) of a process in bytes, or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _read_text(path: str) -> str:
    """Contents of a small text file, or '' when unreadable."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _arg_value(argv: list[str], flag: str) -> str | None:
    """Value of ``--flag VALUE`` or ``--flag=VALUE`` in an argv list, or None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _reset_hwm(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, ``echo 5 > /proc/PID/clear_refs``)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Track peak RSS (bytes) of this process and of helper processes during a ``with`` block.

    This process: VmHWM is reset on entry (``/proc/self/clear_refs``) and read on exit, which is
    exact and costs nothing while the block runs.

    Helpers are processes *born inside the block* (their pid was not alive on entry) that are
    descendants of this process, or snapckpt persisters (``snapckpt.persister`` in the command
    line) that serve an arena this process has mapped (the persister may be daemonized, so it need
    not be a descendant; other jobs' persisters on a shared machine are not ours). For each, the peak is the max of
    its VmHWM and RSS samples. ``helper_peak_bytes`` is the sum of the per-helper peaks (an upper
    bound when several helpers peak at different moments). Persister processes that were already
    alive on entry (e.g. a previous method's persister that has not exited yet, or a shared node
    persister) are tracked separately in ``preexisting`` (VmHWM reset when first seen) and not
    summed. (Process start times are not used: psutil derives them from the boot time, which can
    be off by a second or more in containers.)

    Processes are discovered every ``discover_s`` and sampled every ``interval_s``; both are kept
    coarse because on 2 shared cores a busy sampler would slow the thing it measures.
    """

    def __init__(self, interval_s: float = 0.02, discover_s: float = 0.25):
        self.interval_s = interval_s
        self.discover_s = discover_s
        self.self_start_bytes = 0
        self.self_peak_bytes = 0
        self.helpers: dict[int, dict[str, Any]] = {}
        self.preexisting: dict[int, dict[str, Any]] = {}
        self.hwm_reset_ok = False
        self._procs: dict[int, psutil.Process] = {}
        self._pids_at_enter: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me = psutil.Process()
        self._last_discover = 0.0

    @property
    def helper_peak_bytes(self) -> int:
        """Sum over helper processes born in the block of each one's peak RSS in bytes."""
        return sum(h["peak_rss_bytes"] for h in self.helpers.values())

    def __enter__(self) -> "PeakRSS":
        self._pids_at_enter = set(psutil.pids())
        self.hwm_reset_ok = _reset_hwm("self")
        self.self_start_bytes = self._me.memory_info().rss
        self.self_peak_bytes = self.self_start_bytes
        self._sample(discover=True)
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample(discover=True)
        hwm = _read_hwm_bytes("self")
        if hwm is not None and self.hwm_reset_ok:
            self.self_peak_bytes = max(self.self_peak_bytes, hwm)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            discover = now - self._last_discover >= self.discover_s
            if discover:
                self._last_discover = now
            self._sample(discover=discover)

    def _discover(self) -> None:
        found: dict[int, tuple[psutil.Process, bool]] = {}  # pid -> (process, is_persister)
        try:
            for p in self._me.children(recursive=True):
                found[p.pid] = (p, False)
        except psutil.Error:
            pass
        for pid, (p, _) in list(found.items()):
            try:
                found[pid] = (p, PERSISTER_MARKER in " ".join(p.cmdline()))
            except psutil.Error:
                found.pop(pid)
        # A persister that is not our descendant (daemonized, or started by another process of
        # the job) is ours only if it serves an arena that this process has mapped; other
        # tenants' persisters on the same machine are ignored.
        my_maps = _read_text("/proc/self/maps")
        for p in psutil.process_iter(["cmdline"]):
            if p.pid in found:
                continue
            try:
                argv = p.info["cmdline"] or []
                if PERSISTER_MARKER in " ".join(argv):
                    arena = _arg_value(argv, "--arena-dir")
                    if arena and arena.rstrip("/") + "/" in my_maps:
                        found[p.pid] = (p, True)
            except (psutil.Error, TypeError):
                continue
        found.pop(self._me.pid, None)
        for pid, (p, is_persister) in found.items():
            if pid in self._procs:
                continue
            born = pid not in self._pids_at_enter
            if not born and not is_persister:
                continue  # a leftover descendant of an earlier method: not charged
            try:
                info = {
                    "pid": pid,
                    "cmdline": " ".join(p.cmdline())[:200],
                    "born_in_block": born,
                    "hwm_valid": born or _reset_hwm(pid),
                    "peak_rss_bytes": 0,
                }
            except psutil.Error:
                continue
            self._procs[pid] = p
            (self.helpers if born else self.preexisting)[pid] = info

    def _sample(self, discover: bool = False) -> None:
        if discover:
            self._discover()
        for pid, p in list(self._procs.items()):
            info = self.helpers.get(pid) or self.preexisting[pid]
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue  # exited: keep the peak we saw
            info["peak_rss_bytes"] = max(info["peak_rss_bytes"], rss)
            if info["hwm_valid"]:
                hwm = _read_hwm_bytes(pid)
                if hwm:
                    info["peak_rss_bytes"] = max(info["peak_rss_bytes"], hwm)

    def wait_persisters_exit(self, timeout_s: float) -> dict[int, float | None]:
        """After the block: wait up to ``timeout_s`` for the persister processes born in it to
        exit. Returns pid -> seconds it took (None = still alive at the deadline)."""
        t0 = time.monotonic()
        out: dict[int, float | None] = {}
        for pid, info in self.helpers.items():
            if PERSISTER_MARKER not in info["cmdline"]:
                continue
            p = self._procs[pid]
            left = max(0.0, timeout_s - (time.monotonic() - t0))
            try:
                p.wait(timeout=left)
                out[pid] = time.monotonic() - t0
            except psutil.TimeoutExpired:
                out[pid] = None
            except psutil.Error:
                out[pid] = time.monotonic() - t0
        return out


# --------------------------------------------------------------------------------------------

def malloc_trim() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``), so that one method's freed
    buffers do not inflate the next method's RSS. No-op where unavailable."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def write_results(out: str | os.PathLike, result: dict[str, Any], md: str) -> None:
    """Write ``result`` as JSON to ``out``, ``md`` next to it (``.md``), and print ``md``. ``out`` without the
    ``.json`` suffix (the GPU scripts' ``--out`` stems) gets it."""
    out = Path(out)
    if out.suffix != ".json":
        out = out.with_name(out.name + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    out.with_suffix(".md").write_text(md)
    print(md)


def median(xs: list[float]) -> float | None:
    """Median of a list, or None if empty."""
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def dlrover_wait_tracker(ckpt_dir: Path, step: int, timeout: float) -> None:
    """Poll (every 5 ms) until DLRover's tracker file ``dlrover_latest.txt`` in ``ckpt_dir`` names ``step``
    (DLRover writes it once the step's files are saved). Raises ``TimeoutError`` after ``timeout`` seconds."""
    tracker = Path(ckpt_dir) / "dlrover_latest.txt"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if tracker.read_text().strip() == str(step):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"DLRover did not commit step {step} within {timeout} s")
        time.sleep(0.005)
