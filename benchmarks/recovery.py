"""Recovery time: what a user loses when a job dies is the restart, not the stall.

For a killed job, the time from the new process's start to its first resumed training step, split into
phases, for snapckpt's memory tier (the persister survived the kill and holds the snapshot) and disk tier
(the persister died too: a lost node; the page cache is dropped), against the floors and the peers, all in
one run, each in a fresh process:

- ``floor_shm_copy``: the state's raw bytes in a ``/dev/shm`` file, mapped and copied into the live tensors
  (the memory-tier floor: a copy out of shared memory);
- ``floor_cold_read``: the raw bytes in one file, page cache dropped, read straight into the live tensors by a
  fresh process after it built its state, as a restart reads (the disk-tier floor); several ways (one sequential
  reader, several threads with ``os.preadv``, with and without ``POSIX_FADV_WILLNEED``), each in processes of its
  own, and the way with the lowest median counts (see "Page cache" for why one process per read);
- ``torch_load``: ``torch.load(weights_only=True)`` of a ``torch.save`` file, then a copy into the live
  tensors (``torch_load_mmap``: ``mmap=True``);
- ``dcp_load``: ``torch.distributed.checkpoint.load`` in place from a ``FileSystemWriter`` directory;
- ``snapckpt_memory`` / ``snapckpt_disk``: a job saves a DISK checkpoint and is killed with ``SIGKILL``; the
  new process runs ``Checkpointer(dir)`` (persister attach: a running persister, or a new one for the disk
  tier), ``load(state)`` (agreement; read and copy-in, from ``LoadInfo``);
- ``dlrover_memory`` / ``dlrover_disk`` (``dlrover==0.6.1``; skipped with the import error when absent): DLRover's
  own restart path without its launcher. What is the same as a ``dlrover-run`` restart: an agent process (this
  benchmark's ``dlrover_agent`` child) runs DLRover's saver factory exactly as the launcher's agent does
  (``AsyncCheckpointSaver.start_async_saving_ckpt()``); the trainer runs with ``ROLE_NAME=dlrover-trainer`` so its
  engine uses that saver instead of forking its own; the job saves step 1 with ``save_checkpoint(DISK)``, waits for
  DLRover's tracker file to name it and is killed with ``SIGKILL``; the agent calls ``AsyncCheckpointSaver.reset()``
  as the launcher does before it restarts workers; the new trainer runs ``DdpCheckpointer(dir)`` (attach) and
  ``load_checkpoint()`` (DLRover's shared memory when it holds a step, else ``torch.load`` of its latest file),
  then copies into the live tensors. Memory tier: the agent survived, its shared memory holds step 1. Disk tier: the
  agent is killed too (a lost node), DLRover's shared memory and sockets are removed, the page cache of its files is
  dropped and a fresh agent is started, untimed (the launcher starts before its trainer). What is not the same: no
  elastic launcher, master, rendezvous or process group (one trainer, ``dist`` not initialised), so the launcher's
  own restart latency (failure detection, rendezvous) is in neither DLRover's nor snapckpt's figure.

Each process reports wall-clock marks from the parent's ``Popen`` (``start``): interpreter and imports, the
model's state built (fresh random tensors, as a model's initialisation), the phases of the restore, and the
first step (one small in-place update). The restore ratios compare the restore phases (from after the state
is built to the state in hand), which is what a checkpoint method controls; the start-to-first-step totals
are in the table too.

Imports: each process imports torch and its method's library (``from snapckpt import Checkpointer``, DLRover's
``DdpCheckpointer``, ``torch.distributed.checkpoint``) before building its state, as a training script imports
them at its top; their import time is in "imports" (snapckpt's engine: about 0.015 s), not in the restore.

Garbage collection: each process runs one full collection after building its state, before the restore (counted
in "build state"). The interpreter's and torch's start leave a full collection owed (about 170,000 objects: 50-150
ms on a 2-core VM); without this it fell into whichever restore allocated the last few thousand objects that
trigger it (snapckpt's memory restore: about 0.055 s of its 0.074 s attach at 3bf4e8c), a matter of chance, not
of the method. A collection a method's own allocations cause still counts in its restore.

Page cache: ``posix_fadvise(DONTNEED)`` on every file of the checkpoint (the interpreter and libraries stay
cached, as on a node that restarts a job); ``--drop-all`` drops the whole page cache through
``/proc/sys/vm/drop_caches`` where that is writable (then every import is cold too). The JSON's ``drop`` says
which. What a cold buffered read costs depends on the pages the kernel fills: on a VM whose balloon reports
free pages to the host (``virtio_balloon`` free page reporting, as on the 2-core VM these figures come from),
memory freed a few seconds ago has been handed back, and every page-cache page a read then allocates costs a
fault in the host (measured there, 0.5 GiB at load 2-3: 0.59-0.95 s and 0.5-0.75 s of CPU, against 0.18-0.25 s
when the same read reuses pages a drop freed a moment before; ``O_DIRECT``, which fills no page cache, 0.39-0.42 s
either way). A restart always reads seconds after the drop (its imports and state come first), so each floor read
is the first read of a fresh process too; the floor used to take the fastest of five reads in one process, four
of which followed a drop at once and reused its pages. Each floor child reads once more right after a drop,
reported as ``recycled_s`` (not the floor).

Run from the repo root: ``.venv/bin/python benchmarks/recovery.py --size-gib 1``; outputs
``benchmarks/results/recovery.{json,md}`` (git-ignored). No test asserts these times.
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import (write_results, GiB, dlrover_wait_tracker, REPO_ROOT, drop_page_cache, fsync_path,  # noqa: E402
                     iter_tensors, machine_info, make_state, ratio, rmtree_quiet, scratch_root)

RESULTS = REPO_ROOT / "benchmarks" / "results"
METHODS = ["floor_shm_copy", "floor_cold_read", "torch_load", "torch_load_mmap", "dcp_load", "snapckpt_memory",
           "snapckpt_disk", "dlrover_memory", "dlrover_disk"]
DLROVER_ENV = {"ROLE_NAME": "dlrover-trainer", "LOCAL_RANK": "0"}  # a trainer under an agent: no own saver
DLROVER_SOCK_DIR = Path("/tmp/ckpt_sock")  # DLRover's fixed names: one DLRover job per machine


def drop_cache(path: Path, everything: bool = False) -> str:
    """Evict ``path``'s pages from the page cache (``posix_fadvise(DONTNEED)`` per file: the checkpoint's bytes
    only, so that the interpreter and torch still import from a warm cache, as on a node that restarts a job);
    with ``everything``, the whole page cache when ``/proc/sys/vm/drop_caches`` is writable. Returns how."""
    if everything:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return "drop_caches (whole page cache)"
        except OSError:
            pass
    drop_page_cache(path)
    return "posix_fadvise(DONTNEED) per file"


# --------------------------------------------------------------------------------------------
# Children: one fresh process per restart
# --------------------------------------------------------------------------------------------

def _now(marks: dict, name: str) -> None:
    marks[name] = time.time()


def _fresh_state(size: int) -> dict:
    """The restarted job's model: the same layout, other values (seed 1), every page touched."""
    return make_state(size, seed=1)


def _checksum(sd: Any) -> float:
    import torch

    return float(sum(t.double().sum().item() for t in iter_tensors(sd)))


def _views(sd: Any, buf) -> list:
    """(live tensor, source tensor over ``buf`` at the same offset) for every tensor, in order."""
    import torch

    out, off = [], 0
    for t in iter_tensors(sd):
        n = t.numel() * t.element_size()
        out.append((t, torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape) if n else t))
        off += n
    return out


# name -> (reader threads, advice): "willneed" on the whole file first; "bg_willneed" from a second thread in 8 MiB
# pieces ahead of the reader (what snapckpt's restart does while its persister starts); "odirect": O_DIRECT reads
# of 8 MiB into page-aligned buffers, copied into the tensors (no page cache filled)
FLOOR_VARIANTS = {"1thr": (1, "sequential"), "4thr": (4, "sequential"), "1thr_willneed": (1, "willneed"),
                  "4thr_willneed": (4, "willneed"), "1thr_bg_willneed": (1, "bg_willneed"),
                  "4thr_odirect": (4, "odirect")}


def _read_variant(sd: Any, path: str, variant: str) -> tuple:
    """A cold read of the raw file straight into the live tensors, the way ``variant`` names
    (:data:`FLOOR_VARIANTS`); then the same again right after a drop (pages freed a moment ago). Seconds of each."""
    import concurrent.futures as cf

    import torch

    tensors = list(iter_tensors(sd))
    spans, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            spans.append((memoryview(t.view(-1).view(torch.uint8).numpy()), off))
        off += n
    chunk = 64 << 20
    pieces = [(mv[i:i + chunk], o + i) for mv, o in spans for i in range(0, len(mv), chunk)]

    import numpy as np

    flat = [(np.frombuffer(mv, np.uint8), o) for mv, o in spans]
    size = os.path.getsize(path)

    def odirect(threads: int) -> None:
        step = 8 << 20
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        bufs = [mmap.mmap(-1, step) for _ in range(threads)]
        for b in bufs:
            b.write(b"\0" * step)  # touched outside the reads' pages: as a reused buffer would be
        offs = iter(range(0, size, step))
        lock = threading.Lock()

        def worker(k: int) -> None:
            buf = np.frombuffer(bufs[k], np.uint8)
            while True:
                with lock:
                    lo = next(offs, None)
                if lo is None:
                    return
                n = os.preadv(fd, [bufs[k]], lo)
                for arr, o in flat:  # the tensors' bytes in [lo, lo + n)
                    a, b = max(lo, o), min(lo + n, o + len(arr))
                    if a < b:
                        np.copyto(arr[a - o:b - o], buf[a - lo:b - lo])

        try:
            with cf.ThreadPoolExecutor(threads) as ex:
                list(ex.map(worker, range(threads)))
        finally:
            os.close(fd)

    def run(threads: int, advice: str) -> float:
        drop_page_cache(path)
        t0 = time.perf_counter()
        if advice == "odirect":
            odirect(threads)
            return time.perf_counter() - t0
        fd = os.open(path, os.O_RDONLY)
        ahead = None
        try:
            if advice == "willneed":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if advice == "bg_willneed":
                ahead = threading.Thread(target=lambda: [os.posix_fadvise(fd, lo, 8 << 20, os.POSIX_FADV_WILLNEED)
                                                         for lo in range(0, size, 8 << 20)])
                ahead.start()

            def one(item):
                view, o = item
                got = 0
                while got < len(view):
                    got += os.preadv(fd, [view[got:]], o + got)

            if threads == 1:
                for p in pieces:
                    one(p)
            else:
                with cf.ThreadPoolExecutor(threads) as ex:
                    list(ex.map(one, pieces))
        finally:
            if ahead is not None:
                ahead.join()
            os.close(fd)
        return time.perf_counter() - t0

    first = run(*FLOOR_VARIANTS[variant])  # drop_page_cache ran in the parent before this process started
    return first, run(*FLOOR_VARIANTS[variant])


def dlrover_agent() -> None:
    """DLRover's agent side: its saver factory, as ``dlrover-run``'s agent starts it; then, per stdin line,
    ``reset`` (what the agent does before it restarts workers) or ``exit``."""
    from dlrover.python.elastic_agent.torch.ckpt_saver import AsyncCheckpointSaver

    AsyncCheckpointSaver.start_async_saving_ckpt()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "reset":
            AsyncCheckpointSaver.reset()
            print("ok", flush=True)
        else:
            break
    os._exit(0)


def _import_library(role: str) -> None:
    """Import the library of ``role``'s method with torch, as a training script does at its top (``from snapckpt
    import Checkpointer``, README): its import time counts in "imports" and the restart, not in the restore; the
    imports in the branches of :func:`child` are then look-ups."""
    if role == "snap_restore":
        from snapckpt import Checkpointer  # noqa: F401  (snapckpt's public names are imported on first use)
    elif role == "dlrover_restore":
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer  # noqa: F401
    elif role == "dcp_load":
        import torch.distributed.checkpoint  # noqa: F401


def child(role: str, a: argparse.Namespace) -> None:
    if role == "dlrover_agent":
        dlrover_agent()
    marks: dict = {"start": float(os.environ["RECOVERY_T0"])}
    import torch

    _import_library(role)
    _now(marks, "imported")
    info: dict = {}
    size = int(a.size_gib * GiB)
    d = Path(a.dir)
    if role == "snap_job":  # the job that is killed: save a DISK checkpoint, then SIGKILL itself
        import snapckpt

        sd = make_state(size, seed=0)
        ck = snapckpt.Checkpointer(str(d / "snap"), keep_last=2)
        ck.save(sd, 1, snapckpt.StorageType.DISK).wait()
        print(json.dumps({"persister_pid": ck.persister_pid}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if role == "dlrover_job":  # DLRover's job: save step 1 to disk through the agent's saver, then SIGKILL itself
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        sd = make_state(size, seed=0)
        ck = DdpCheckpointer(str(d / "dlrover"))
        ck.save_checkpoint(1, sd, storage_type=StorageType.DISK)
        dlrover_wait_tracker(d / "dlrover", 1, 600.0)
        print(json.dumps({"committed": 1}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sd = _fresh_state(size)
    gc.collect()  # the full collection owed to the start, before the restore in every method (module docstring)
    _now(marks, "state_built")
    if role == "floor_shm_copy":
        import mmap

        fd = os.open(a.shm_file, os.O_RDONLY)
        mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)
        _now(marks, "attached")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer of a read-only map: only read here
            pairs = _views(sd, mm)
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        _now(marks, "read")
        del pairs
    elif role == "floor_cold_read":
        first, recycled = _read_variant(sd, str(d / "raw.bin"), a.variant)
        info.update(variant=a.variant, recycled_s=recycled)
        marks["attached"] = marks["state_built"]
        marks["read"] = marks["state_built"] + first
    elif role in ("torch_load", "torch_load_mmap"):
        obj = torch.load(d / "state.pt", weights_only=True, mmap=role == "torch_load_mmap")
        _now(marks, "read")
        with torch.no_grad():
            for dst, src in zip(iter_tensors(sd), iter_tensors(obj)):
                dst.copy_(src)
        _now(marks, "copied")
        del obj
    elif role == "dcp_load":
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(d / "dcp")), no_dist=True)
        _now(marks, "read")
    elif role == "snap_restore":
        import snapckpt

        ck = snapckpt.Checkpointer(str(d / "snap"), keep_last=2)
        _now(marks, "attached")
        ck.load(sd)
        _now(marks, "copied")
        li = ck.last_load
        info.update(tier=li.tier.value, step=li.step, agree_s=li.agree_secs, read_s=li.read_secs,
                    copy_s=li.copy_secs, load_s=li.seconds)
    elif role == "dlrover_restore":
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        ck = DdpCheckpointer(str(d / "dlrover"))
        _now(marks, "attached")
        obj = ck.load_checkpoint()
        _now(marks, "read")
        if isinstance(obj, dict) and set(obj) == {"model_states"}:
            obj = obj["model_states"]
        with torch.no_grad():
            for dst, src in zip(iter_tensors(sd), iter_tensors(obj)):
                dst.copy_(src)
        _now(marks, "copied")
        from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointConfig

        # after the timed part: the step DLRover's shared memory names (0: none, so it read its file)
        info["tier"] = "memory" if ck._engine._shm_handler.get_checkpoint_config(CheckpointConfig()).step else "disk"
        del obj
    with torch.no_grad():  # the first resumed step: a small in-place update
        next(iter_tensors(sd)).add_(0.0)
    _now(marks, "first_step")
    info["checksum"] = _checksum(sd)
    print(json.dumps({"marks": marks, "info": info}), flush=True)
    if role == "snap_restore":
        if a.close:
            ck.close()
        else:
            os._exit(0)  # leave like a crashed rank: the persister keeps the arena (the disk run kills it)


def run_child(role: str, a: argparse.Namespace, env: dict, extra: list | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", role, "--dir", a.dir, "--size-gib", str(a.size_gib),
           "--shm-file", a.shm_file] + (extra or [])
    t0 = time.time()
    p = subprocess.run(cmd, env={**env, "RECOVERY_T0": repr(t0)}, capture_output=True, text=True,
                       timeout=a.child_timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if role.endswith("_job"):
        if p.returncode != -signal.SIGKILL or not lines:
            raise RuntimeError(f"{role} ended {p.returncode}: {p.stderr[-2000:]}")
        return json.loads(lines[-1])
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{role} exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(lines[-1])


def phases(rec: dict) -> dict:
    """Seconds per phase from the wall-clock marks (absent phases are 0)."""
    m = rec["marks"]
    built = m["state_built"]
    attached = m.get("attached", built)
    read = m.get("read", m.get("copied"))
    done = m.get("copied", read)
    out = {"start_to_imported_s": m["imported"] - m["start"], "build_state_s": built - m["imported"],
           "attach_s": attached - built, "restore_s": done - built, "to_first_step_s": m["first_step"] - m["start"]}
    info = rec["info"]
    if "recycled_s" in info:  # the cold-read floor read once more after its timed read: not in its restart
        out["to_first_step_s"] = built - m["start"] + out["restore_s"]
    if "agree_s" in info:  # snapckpt: the load's own split
        out.update(agree_s=info["agree_s"], read_s=info["read_s"], copy_s=info["copy_s"])
    else:
        out.update(agree_s=0.0, read_s=read - attached, copy_s=done - read)
    return out


def prepare(a: argparse.Namespace, env: dict) -> tuple[float, str]:
    """Write the floors' and peers' files of the state (seed 0); return its checksum and how caches drop."""
    import torch
    import torch.distributed.checkpoint as dcp

    d = Path(a.dir)
    sd = make_state(int(a.size_gib * GiB), seed=0)
    with open(d / "raw.bin", "wb", buffering=0) as f:
        for t in iter_tensors(sd):
            f.write(memoryview(t.contiguous().view(-1).numpy()).cast("B"))
        os.fsync(f.fileno())
    with open(a.shm_file, "wb") as f:
        for t in iter_tensors(sd):
            f.write(memoryview(t.contiguous().view(-1).numpy()).cast("B"))
    with open(d / "state.pt", "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d / "dcp")), no_dist=True)
    fsync_path(d)
    return _checksum(sd), ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="restarts per method (the median is reported)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=str(RESULTS / "recovery.json"))
    p.add_argument("--scratch-dir", default=None)
    p.add_argument("--drop-all", action="store_true", help="drop the whole page cache (root), not just the files")
    p.add_argument("--child-timeout", type=float, default=900.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shm-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--close", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="1thr", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a)
        return 0
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    root, why = scratch_root(a.scratch_dir)
    tag = f"recovery-{os.getpid()}"
    a.dir = str(root / tag)
    os.makedirs(a.dir)
    a.shm_file = f"/dev/shm/{tag}.bin"
    shm_root = f"/dev/shm/{tag}-arena"
    runtime = f"/tmp/{tag}-rt"
    os.makedirs(shm_root, mode=0o700)
    os.makedirs(runtime, mode=0o700)
    env = {**os.environ, "SNAPCKPT_SHM_DIR": shm_root, "SNAPCKPT_RUNTIME_DIR": runtime,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result: dict[str, Any] = {"machine": machine_info(root), "config": {"size_gib": a.size_gib,
                              "repeats": a.repeats, "scratch": why, "argv": sys.argv}, "methods": {}}
    result["machine"]["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    try:
        expected, _ = prepare(a, env)
        result["expected_checksum"] = expected
        for m in methods:
            if m.startswith(("snapckpt", "dlrover")):  # restarts after a killed job: below
                continue
            if m == "floor_cold_read":
                result["methods"][m] = _floor_cold_read(a, env, expected, result)
                print(f"{m}: {result['methods'][m]['phases']} ({result['methods'][m]['variant']})", file=sys.stderr,
                      flush=True)
                continue
            recs = []
            for _ in range(a.repeats):
                for f in ("raw.bin", "state.pt", "dcp"):
                    result["drop"] = drop_cache(Path(a.dir) / f, a.drop_all)
                recs.append(run_child(m, a, env))
            result["methods"][m] = _summarise(recs, expected)
            print(f"{m}: {result['methods'][m]['phases']}", file=sys.stderr, flush=True)
        if any(m.startswith("snapckpt") for m in methods):
            mem, disk = [], []
            for _ in range(a.repeats):
                job = run_child("snap_job", a, env)  # saves step 1, then SIGKILL
                if "snapckpt_memory" in methods:
                    mem.append(run_child("snap_restore", a, env))  # the persister survived: memory tier
                if job.get("persister_pid"):  # a lost node: the persister dies too, the page cache is cold
                    try:
                        os.kill(job["persister_pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    _wait_gone(job["persister_pid"])
                result["drop"] = drop_cache(Path(a.dir) / "snap", a.drop_all)
                if "snapckpt_disk" in methods:
                    disk.append(run_child("snap_restore", a, env, ["--close"]))
                else:
                    run_child("snap_restore", a, env, ["--close"])  # untimed: ends the job cleanly
            for name, recs in (("snapckpt_memory", mem), ("snapckpt_disk", disk)):
                if recs:
                    result["methods"][name] = _summarise(recs, expected)
                    print(f"{name}: {result['methods'][name]['phases']} tier {recs[0]['info'].get('tier')}",
                          file=sys.stderr, flush=True)
        if any(m.startswith("dlrover") for m in methods):
            try:
                run_dlrover(a, env, methods, result, expected)
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run here is recorded, the page goes on
                result["dlrover_error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"dlrover: {result['dlrover_error']}", file=sys.stderr, flush=True)
    finally:
        rmtree_quiet(a.dir)
        rmtree_quiet(shm_root)
        rmtree_quiet(runtime)
        try:
            os.unlink(a.shm_file)
        except OSError:
            pass
    add_ratios(result)
    write_results(a.out, result, markdown(result))
    return 0


def _floor_cold_read(a: argparse.Namespace, env: dict, expected: float, result: dict) -> dict:
    """The cold-read floor: every way of :data:`FLOOR_VARIANTS` ``a.repeats`` times, each read in a fresh process
    (the ways in turn, so that each sees the same drift of the load); the way with the lowest median counts, with
    its samples. Also records each way's samples and the reads that reused a drop's pages (``recycled_s``)."""
    by: dict = {v: [] for v in FLOOR_VARIANTS}
    for _ in range(a.repeats):
        for v in FLOOR_VARIANTS:
            result["drop"] = drop_cache(Path(a.dir) / "raw.bin", a.drop_all)
            by[v].append(run_child("floor_cold_read", a, env, ["--variant", v]))
    med = {v: statistics.median(phases(r)["restore_s"] for r in recs) for v, recs in by.items()}
    best = min(med, key=med.get)
    out = _summarise(by[best], expected)
    out.update(variant=best, variants_s=med,
               variant_samples_s={v: [phases(r)["restore_s"] for r in recs] for v, recs in by.items()},
               recycled_s={v: [r["info"]["recycled_s"] for r in recs] for v, recs in by.items()},
               restored_ok=all(_summarise(recs, expected)["restored_ok"] for recs in by.values()))
    return out


class _DlroverAgent:
    """One ``dlrover_agent`` child (DLRover's saver factory, as its launcher's agent runs it)."""

    def __init__(self, a: argparse.Namespace, env: dict):
        self.log = open(Path(a.dir) / "dlrover_agent.log", "a")
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", "dlrover_agent",
                                   "--dir", a.dir, "--size-gib", str(a.size_gib), "--shm-file", a.shm_file],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        line = self.p.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"DLRover agent said {line!r}, not {word!r} (log: dlrover_agent.log)")

    def reset(self) -> None:
        """``AsyncCheckpointSaver.reset()``, as the launcher's agent calls it before restarting workers."""
        self.p.stdin.write("reset\n")
        self.p.stdin.flush()
        self._expect("ok")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)
        self.log.close()


def _dlrover_remove_shared(shm_before: set, socks_before: set) -> None:
    """Remove DLRover's shared memory and sockets created since ``*_before`` (what a lost node loses)."""
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if name.startswith("ckpt_"):
            try:
                os.unlink(f"/dev/shm/{name}")
            except OSError:
                pass
    if DLROVER_SOCK_DIR.is_dir():
        for name in set(os.listdir(DLROVER_SOCK_DIR)) - socks_before:
            try:
                os.unlink(DLROVER_SOCK_DIR / name)
            except OSError:
                pass
        try:
            DLROVER_SOCK_DIR.rmdir()  # only when empty
        except OSError:
            pass


def run_dlrover(a: argparse.Namespace, env: dict, methods: list[str], result: dict, expected: float) -> None:
    """DLRover's restarts (module docstring): a job saves step 1 through the agent's saver and is killed; the
    memory restart finds the agent alive; the disk restart follows the agent's death and a cold page cache."""
    import importlib.util

    if importlib.util.find_spec("dlrover") is None:
        raise RuntimeError("DLRover is not installed: `pip install dlrover==0.6.1 grpcio`")
    denv = {**env, **DLROVER_ENV}
    shm_before = set(os.listdir("/dev/shm"))
    socks_before = set(os.listdir(DLROVER_SOCK_DIR)) if DLROVER_SOCK_DIR.is_dir() else set()
    mem, disk = [], []
    agent = None
    try:
        for _ in range(a.repeats):
            rmtree_quiet(Path(a.dir) / "dlrover")
            agent = _DlroverAgent(a, denv)
            run_child("dlrover_job", a, denv)  # saves step 1 (DISK), waits for the tracker, then SIGKILL
            agent.reset()
            if "dlrover_memory" in methods:
                mem.append(run_child("dlrover_restore", a, denv))  # the agent holds the shared memory
            agent.kill()  # a lost node: the agent and its memory go too
            _dlrover_remove_shared(shm_before, socks_before)
            result["drop"] = drop_cache(Path(a.dir) / "dlrover", a.drop_all)
            agent = _DlroverAgent(a, denv)  # the new node's agent, up before its trainer (untimed)
            if "dlrover_disk" in methods:
                disk.append(run_child("dlrover_restore", a, denv))
            agent.kill()
            agent = None
            _dlrover_remove_shared(shm_before, socks_before)
    finally:
        if agent is not None:
            agent.kill()
        _dlrover_remove_shared(shm_before, socks_before)
    for name, recs in (("dlrover_memory", mem), ("dlrover_disk", disk)):
        if recs:
            result["methods"][name] = _summarise(recs, expected)
            print(f"{name}: {result['methods'][name]['phases']} tier {recs[0]['info'].get('tier')}",
                  file=sys.stderr, flush=True)


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _summarise(recs: list[dict], expected: float) -> dict:
    ph = [phases(r) for r in recs]
    med = {k: statistics.median(p[k] for p in ph) for k in ph[0]}
    return {"phases": med, "samples": ph, "info": [r["info"] for r in recs],
            "restored_ok": all(abs(r["info"]["checksum"] - expected) <= 1e-6 * max(1.0, abs(expected)) for r in recs)}


def add_ratios(result: dict) -> None:
    """The issue's recovery targets: snapckpt memory / shm copy, snapckpt disk / cold read (restore phases),
    and each disk method against torch.load and DCP load."""
    ms = result["methods"]
    r = lambda a, b: ratio((ms.get(a) or {}).get("phases", {}).get("restore_s"),  # noqa: E731
                           (ms.get(b) or {}).get("phases", {}).get("restore_s"))
    result["ratios"] = {
        "snapckpt_memory / floor_shm_copy": r("snapckpt_memory", "floor_shm_copy"),
        "snapckpt_disk / floor_cold_read": r("snapckpt_disk", "floor_cold_read"),
        "snapckpt_disk / torch_load": r("snapckpt_disk", "torch_load"),
        "snapckpt_disk / dcp_load": r("snapckpt_disk", "dcp_load"),
        "torch_load / floor_cold_read": r("torch_load", "floor_cold_read"),
        "dcp_load / floor_cold_read": r("dcp_load", "floor_cold_read"),
        "snapckpt_memory / dlrover_memory": r("snapckpt_memory", "dlrover_memory"),
        "snapckpt_disk / dlrover_disk": r("snapckpt_disk", "dlrover_disk"),
        "dlrover_memory / floor_shm_copy": r("dlrover_memory", "floor_shm_copy"),
        "dlrover_disk / floor_cold_read": r("dlrover_disk", "floor_cold_read"),
    }


def markdown(result: dict) -> str:
    m, c = result["machine"], result["config"]
    lines = [
        "# Recovery time after a kill",
        "",
        f"- date: {m['date']}; git: {m['git_commit']}; {m['cpu_count']} cpus; torch {m['torch']}; "
        f"state {c['size_gib']:g} GiB; medians of {c['repeats']}; page cache dropped by {result.get('drop', 'n/a')}",
        f"- uptime at start: {m.get('uptime', '')}",
        "- every method in a fresh process started by the benchmark; restore = from the model's state built to "
        "the state in hand (what the method controls); start to first step = the whole restart; one full garbage "
        "collection after the state is built, in build state (the one the start owes, not a method's); each "
        "method's library imported with torch, in imports",
        "",
        "| method | start to first step s | imports s | build state s | restore s | attach s | agree s | read s "
        "| copy-in s | restored |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in METHODS:
        rec = result["methods"].get(name)
        if not rec:
            continue
        p = rec["phases"]
        lines.append(f"| {name} | {p['to_first_step_s']:.3f} | {p['start_to_imported_s']:.3f} | {p['build_state_s']:.3f} "
                     f"| {p['restore_s']:.3f} | {p['attach_s']:.3f} | {p['agree_s']:.3f} | {p['read_s']:.3f} "
                     f"| {p['copy_s']:.3f} | {'yes' if rec['restored_ok'] else 'NO'} |")
    cold = result["methods"].get("floor_cold_read") or {}
    if cold.get("variants_s"):
        lines += ["", "Cold-read floor ways (median seconds, each read the first of a fresh process; the floor is the "
                  "fastest): " + ", ".join(f"{k} {v:.3f}" for k, v in cold["variants_s"].items())
                  + "; the same ways right after a drop in the same process (pages freed a moment before, which no "
                  "restart reuses; not the floor): "
                  + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in cold["recycled_s"].items())]
    lines += ["", "| ratio (restore phases) | measured | target |", "|---|---:|---|"]
    targets = {"snapckpt_memory / floor_shm_copy": "<= 1.2", "snapckpt_disk / floor_cold_read": "<= 1.2"}
    for k, v in result["ratios"].items():
        lines.append(f"| {k} | {'n/a' if v is None else f'{v:.2f}x'} | {targets.get(k, '')} |")
    dl = [n for n in ("dlrover_memory", "dlrover_disk") if n in result["methods"]]
    if dl:
        tiers = ", ".join(f"{n} from {result['methods'][n]['info'][0].get('tier')}" for n in dl)
        lines += ["", f"DLRover (0.6.1) restarts through its own saver without its launcher ({tiers}): an agent "
                  "process runs DLRover's saver factory as `dlrover-run`'s agent does, the trainer "
                  "(`ROLE_NAME=dlrover-trainer`) saves step 1 to disk and is killed with SIGKILL, the agent "
                  "resets as before a worker restart, and the new trainer runs `DdpCheckpointer(dir)` + "
                  "`load_checkpoint()` + a copy into the live tensors; for the disk tier the agent was killed, "
                  "DLRover's shared memory removed, the page cache of its files dropped and a new agent started "
                  "(untimed). Not included: the launcher's failure detection and rendezvous (no launcher, master "
                  "or process group here, for snapckpt neither)."]
    elif result.get("dlrover_error"):
        lines += ["", f"DLRover's restart was not measured: {result['dlrover_error']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
