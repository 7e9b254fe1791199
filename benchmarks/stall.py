"""Checkpoint stall benchmark: how long does a checkpoint block training, and when is it durable?

One run, one process tree, the same model + AdamW-like state for every method (see
``_common.make_state``). For each state size and each method this measures, as the median over
``--repeats`` runs after one warm-up:

* ``blocking_s`` -- seconds the calling (training) thread is blocked by the call, i.e. until it may
  mutate the state again;
* ``durable_s`` -- seconds from the start of the call until the bytes are fsynced on disk
  (``None`` for methods that never reach disk);
* peak RSS in bytes of this process and of helper processes (the snapckpt persister, DCP's
  background process) over warm-up + repeats;
* ``minflt`` (in each sample's extras) -- minor page faults of this process (all its threads) during
  the call: a save into buffers whose pages are not mapped yet takes about one per 4 KiB page.

Between the warm-up and the first timed repeat every method gets ``--settle-s-per-gib`` seconds per GiB
of state (untimed, a training step's worth): background work that the warm-up started (snapckpt maps its
other arena slot, a copy of 0.2-0.4 s per 0.5 GiB on 2 cores) ends there, as it would during the steps of
a training loop, instead of leaking into the first timed save. A save taken right after the first one,
back to back, is ``first_save.py``'s "second save" column.

Methods (``--methods``, comma separated; default all):

* ``floor_copy``      a copy of every tensor into pre-allocated, pre-faulted buffers, the fastest of
                       torch's ``copy_`` (intra-op threads, or one), and chunked ``memmove`` on
                       as many threads (:class:`FloorCopy`); the memory floor for any snapshot.
* ``floor_write``     the raw tensor bytes written sequentially to one file, then fsync; the disk
                       floor.
* ``torch_save``      ``torch.save`` to a file, then fsync (file and directory).
* ``dcp_save``        ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter`` (it fsyncs),
                       single process, no process group.
* ``dcp_async_save``  ``dcp.async_save`` with the default thread executor; blocking = until it
                       returns, durable = until its future resolves.
* ``dcp_async_save_process``  same with ``AsyncCheckpointerType.PROCESS`` (needs a process group:
                       a gloo group of world size 1 on a free port is created and destroyed around it).
* ``snapckpt_memory`` ``Checkpointer.save(..., StorageType.MEMORY)`` + ``fence()``; durable n/a.
* ``snapckpt_disk``   ``Checkpointer.save(..., StorageType.DISK)`` + ``fence()``; durable = until
                       ``handle.wait()`` returns.

A method that fails records its error text (and traceback) in the JSON and the table; the run goes
on. Results are written after every method, so a killed run keeps what it measured.

Usage (from the repo root)::

    .venv/bin/python benchmarks/stall.py --sizes-gib 1,2 --repeats 3

Timing on shared cores varies about 2x between runs; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

# benchmarks/ for _common; the repo root so that an uninstalled snapckpt checkout imports too.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import (  # noqa: E402  (script-relative import)
    GiB,
    REPO_ROOT,
    copy_tensors,
    drop_page_cache,
    PeakRSS,
    free_port,
    fsync_path,
    iter_tensors,
    machine_info,
    make_state,
    malloc_trim,
    median,
    ratio,
    rmtree_quiet,
    scratch_root,
    state_nbytes,
)

ALL_METHODS = [
    "floor_copy",
    "floor_write",
    "torch_save",
    "dcp_save",
    "dcp_async_save",
    "dcp_async_save_process",
    "snapckpt_memory",
    "snapckpt_disk",
]

#: seconds per GiB of state between the warm-up and the first timed repeat (see the module docstring)
SETTLE_S_PER_GIB = 1.0

# Result of one timed call: (blocking seconds, durable seconds or None, extra facts).
Sample = tuple[float, "float | None", dict[str, Any]]


# --------------------------------------------------------------------------------------------
# Methods. Each is a class with setup() (untimed), once(i) -> Sample (one checkpoint; index 0 is
# the warm-up), and close() (untimed, idempotent, always called).
# --------------------------------------------------------------------------------------------

class Method:
    """Base class: ``state`` is the shared state dict, ``workdir`` a fresh scratch directory."""

    durable = True  # False: the method never reaches disk (durable_s is None)

    def __init__(self, state: dict[str, Any], workdir: Path, args: argparse.Namespace):
        self.state = state
        self.workdir = workdir
        self.args = args

    def setup(self) -> None:
        """Untimed preparation (allocate buffers, start services)."""

    def once(self, i: int) -> Sample:
        """Take checkpoint number ``i`` (0 = warm-up) and return its timings."""
        raise NotImplementedError

    #: Buffers the method takes turns in (snapckpt: arena slots per rank); the first use of each is a sample.
    slots = 1

    #: Tier a restore reads from (``"memory"``, ``"disk"``), or None: the method has no restore.
    restore_tier: str | None = None

    def cleanup_after(self, i: int) -> None:
        """Untimed: drop the files of checkpoint ``i`` so that the disk does not fill up."""

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """Restore checkpoint ``i`` (just taken, files kept) into ``self.state`` in place; return
        (seconds until the live tensors hold it, extra facts). Disk restores start from a cold page
        cache (``drop_page_cache``). Only called when ``restore_tier`` is set."""
        raise NotImplementedError

    def close(self) -> None:
        """Untimed teardown; must be safe to call twice and after a failed setup."""


class FloorCopy(Method):
    """Copy every tensor into a pre-allocated buffer. Warm-up faults the pages in; each repeat then times every
    way this machine has to copy the bytes and keeps the fastest (the floor must be the fastest way, and which
    one is depends on the host: on quiet cores torch's copy on its intra-op threads, on shared cores a copy whose
    threads do not wait for each other per tensor):

    * ``torch``: ``torch.Tensor.copy_`` per tensor (one OpenMP region each, on the intra-op threads);
    * ``torch_1thread``: the same with one intra-op thread;
    * ``memmove_chunks``: libc ``memmove`` in 8 MiB chunks that the caller and ``torch.get_num_threads() - 1``
      helper threads take in turn (:mod:`snapckpt.engine.mover`, used as a plain copy engine here, none of
      snapckpt's save path around it).

    Each sample's extras name the fastest way and hold every way's seconds."""

    durable = False

    def setup(self) -> None:
        from snapckpt.engine import mover

        self.src = list(iter_tensors(self.state))
        self.bufs = [torch.empty_like(t) for t in self.src]
        self._chunks = mover.chunks_of([b.data_ptr() for b in self.bufs], self.src)
        self._back = mover.chunks_of([t.data_ptr() for t in self.src], self.bufs)
        self._copy_chunks = mover.copy_chunks

    def _ways(self, dst: list, src: list, chunks: list) -> tuple[float, dict[str, Any]]:
        def torch_copy() -> None:
            for b, t in zip(dst, src):
                b.copy_(t)

        def one_thread() -> None:
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                torch_copy()
            finally:
                torch.set_num_threads(n)

        ways = {}
        for name, fn in (("torch", torch_copy), ("torch_1thread", one_thread),
                         ("memmove_chunks", lambda: self._copy_chunks(chunks))):
            t0 = time.perf_counter()
            fn()
            ways[name] = time.perf_counter() - t0
        best = min(ways, key=ways.get)
        return ways[best], {"fastest_way": best, "ways_s": ways}

    def once(self, i: int) -> Sample:
        secs, extra = self._ways(self.bufs, self.src, self._chunks)
        return secs, None, extra

    restore_tier = "memory"

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """The memory restore floor: copy the buffers back into the live tensors (the fastest way, as above)."""
        return self._ways(self.src, self.bufs, self._back)

    def close(self) -> None:
        self.bufs = []


class FloorWrite(Method):
    """Write the raw tensor bytes (no serialization) sequentially into one file, then fsync.
    Blocking and durable are the same: the call is synchronous."""

    def path(self, i: int) -> Path:
        return self.workdir / f"raw_{i}.bin"

    def once(self, i: int) -> Sample:
        t0 = time.perf_counter()
        with open(self.path(i), "wb", buffering=0) as f:
            for t in iter_tensors(self.state):
                view = memoryview(t.contiguous().numpy()).cast("B")
                while view:
                    n = f.write(view)
                    view = view[n:]
            os.fsync(f.fileno())
        fsync_path(self.workdir)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    restore_tier = "disk"

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """The disk restore floor: ``readinto`` the raw bytes straight into the live tensors."""
        drop_page_cache(self.path(i))
        t0 = time.perf_counter()
        with open(self.path(i), "rb", buffering=0) as f:
            for t in iter_tensors(self.state):
                view = memoryview(t.numpy()).cast("B")
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{self.path(i)} is shorter than the state")
                    view = view[n:]
        return time.perf_counter() - t0, {}

    def cleanup_after(self, i: int) -> None:
        self.path(i).unlink(missing_ok=True)


class TorchSave(Method):
    """``torch.save`` into an open file, flush, fsync file and directory."""

    def path(self, i: int) -> Path:
        return self.workdir / f"ckpt_{i}.pt"

    def once(self, i: int) -> Sample:
        t0 = time.perf_counter()
        with open(self.path(i), "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.workdir)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    restore_tier = "disk"

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """``torch.load(weights_only=True)`` then a copy into the live tensors."""
        drop_page_cache(self.path(i))
        t0 = time.perf_counter()
        loaded = torch.load(self.path(i), weights_only=True)
        t_load = time.perf_counter() - t0
        copy_tensors(self.state, loaded)
        return time.perf_counter() - t0, {"torch_load_s": t_load}

    def cleanup_after(self, i: int) -> None:
        self.path(i).unlink(missing_ok=True)


class DcpSave(Method):
    """Synchronous ``dcp.save`` with a ``FileSystemWriter`` (``sync_files=True`` fsyncs the data
    files), single process, ``no_dist=True``."""

    def setup(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp

    def path(self, i: int) -> Path:
        return self.workdir / f"step_{i}"

    def once(self, i: int) -> Sample:
        t0 = time.perf_counter()
        self.dcp.save(self.state, storage_writer=self.dcp.FileSystemWriter(str(self.path(i))),
                      no_dist=True)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    restore_tier = "disk"

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """``dcp.load`` in place into the live state (``FileSystemReader``, ``no_dist=True``)."""
        drop_page_cache(self.path(i))
        t0 = time.perf_counter()
        self.dcp.load(self.state, storage_reader=self.dcp.FileSystemReader(str(self.path(i))),
                      no_dist=True)
        return time.perf_counter() - t0, {}

    def cleanup_after(self, i: int) -> None:
        rmtree_quiet(self.path(i))


class DcpAsyncSave(DcpSave):
    """``dcp.async_save`` with the default thread executor and default stager (a fresh CPU copy
    of the state is staged inside the call). Blocking = until the call returns; durable = until
    the returned future resolves."""

    process_mode = False

    def setup(self) -> None:
        super().setup()
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.kind = AsyncCheckpointerType.PROCESS if self.process_mode else AsyncCheckpointerType.THREAD

    def _call(self, i: int) -> Any:
        return self.dcp.async_save(
            self.state,
            storage_writer=self.dcp.FileSystemWriter(str(self.path(i))),
            async_checkpointer_type=self.kind,
            no_dist=not self.process_mode,
        )

    def once(self, i: int) -> Sample:
        t0 = time.perf_counter()
        fut = self._call(i)
        blocking = time.perf_counter() - t0
        # AsyncSaveResponse (only with an async stager) carries the upload future separately.
        upload = getattr(fut, "upload_completion", fut)
        upload.result(timeout=self.args.method_timeout)
        return blocking, time.perf_counter() - t0, {}


class DcpAsyncSaveProcess(DcpAsyncSave):
    """``dcp.async_save(..., async_checkpointer_type=PROCESS)``: a spawned background process does
    the writing; it needs a process group, so a gloo group of world size 1 on a free port is
    created in setup() and destroyed (with the background process) in close()."""

    process_mode = True

    def setup(self) -> None:
        import torch.distributed as dist

        super().setup()
        self.dist = dist
        self.own_pg = False
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
            self.own_pg = True

    def close(self) -> None:
        # Stop DCP's module-level background process (private API; best effort).
        try:
            import torch.distributed.checkpoint._async_process_executor as ape

            proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
            if proc is not None:
                ape._CHECKPOINT_PROCESS = None
                try:
                    proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
                    proc._save_process.join(timeout=10)
                finally:
                    if proc._save_process.is_alive():
                        proc._save_process.terminate()
                        proc._save_process.join(timeout=5)
        except Exception:  # noqa: BLE001 -- cleanup must not mask the measurement
            traceback.print_exc()
        if getattr(self, "own_pg", False) and self.dist.is_initialized():
            self.dist.destroy_process_group()
            self.own_pg = False


class SnapckptBase(Method):
    """Shared setup for the snapckpt methods: one ``Checkpointer`` per method on a fresh dir.

    Blocking = ``save()`` plus ``fence()`` (the point after which the training thread may run
    ``optimizer.step()``); ``save_return_s`` (just ``save()``) is kept in the extras. The warm-up
    includes starting the persister process.
    """

    storage = "MEMORY"
    restore_tier = "memory"
    #: ``Checkpointer(overlap=...)``; None keeps the library's default.
    overlap: bool | None = None

    def _open(self) -> Any:
        opts: dict[str, Any] = {"keep_last": 2}
        if self.overlap is not None:
            opts["overlap"] = self.overlap
        return self.snapckpt.Checkpointer(str(self.workdir / "ckpt"), **opts)

    def setup(self) -> None:
        import snapckpt

        self.snapckpt = snapckpt
        self.st = getattr(snapckpt.StorageType, self.storage)
        self.ckpt = self._open()
        self.slots = self.ckpt.options.slots_per_rank  # the warm-up uses one; the first repeats the others

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        """``ckpt.load(state)``: in place into the live tensors, from the newest tier (memory)."""
        t0 = time.perf_counter()
        self.ckpt.load(self.state)
        dt = time.perf_counter() - t0
        tier = str(self.ckpt.last_load.tier.name).lower()
        if tier != self.restore_tier:
            raise RuntimeError(f"restore read the {tier} tier, expected {self.restore_tier}")
        return dt, {"tier": tier, "step": self.ckpt.last_load.step}

    def once(self, i: int) -> Sample:
        t0 = time.perf_counter()
        h = self.ckpt.save(self.state, i, storage_type=self.st)
        t_ret = time.perf_counter() - t0
        self.ckpt.fence()
        blocking = time.perf_counter() - t0
        h.wait(timeout=self.args.method_timeout)
        done = time.perf_counter() - t0
        extra = {"save_return_s": t_ret, "snapshot_taken": bool(getattr(h, "snapshot_taken", False))}
        if self.durable:
            return blocking, done, extra
        extra["memory_ready_s"] = done  # until h.wait() returned (held in memory); not durable
        return blocking, None, extra

    def close(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            self.ckpt = None
            ckpt.close()


class SnapckptMemory(SnapckptBase):
    """``ckpt.save(sd, step, storage_type=StorageType.MEMORY)``; durable is n/a."""

    storage = "MEMORY"
    durable = False


class SnapckptDisk(SnapckptBase):
    """``ckpt.save(sd, step, storage_type=StorageType.DISK)``; durable = ``h.wait()``.

    Restore reads the disk tier: the Checkpointer is closed, its persister (which holds the memory
    snapshots) waited for, a fresh Checkpointer opened on the same directory (persister start-up
    untimed), the page cache of the files dropped, then ``ckpt.load(state)`` timed."""

    storage = "DISK"
    restore_tier = "disk"

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        if not getattr(self, "_reopened", False):
            pid = self.ckpt.persister_pid
            self.ckpt.close()
            self.ckpt = None
            if pid:
                try:
                    psutil.Process(pid).wait(timeout=self.args.persister_exit_wait)
                except psutil.Error:
                    pass
            self.ckpt = self._open()
            self.ckpt.latest_step()  # untimed: persister start-up, candidates
            self._reopened = True
        drop_page_cache(self.workdir / "ckpt")
        return super().restore(i)


METHOD_CLASSES: dict[str, Callable[..., Method]] = {
    "floor_copy": FloorCopy,
    "floor_write": FloorWrite,
    "torch_save": TorchSave,
    "dcp_save": DcpSave,
    "dcp_async_save": DcpAsyncSave,
    "dcp_async_save_process": DcpAsyncSaveProcess,
    "snapckpt_memory": SnapckptMemory,
    "snapckpt_disk": SnapckptDisk,
}


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

class PairedFloor:
    """:class:`FloorCopy` samples taken each right before one timed repeat of a method (outside the repeat and
    outside its RSS window: the buffers are faulted in before the method's setup), every way's seconds kept.

    The copy floor moves with the host: on this VM the same copy into faulted buffers took 0.023 s in one round
    and 0.034 s in the next, so a method's median against a floor taken before it (or first in the run) mixes
    two states of the machine. Each repeat is compared with the floor taken just before it instead
    (``suite.paired_floor``)."""

    def __init__(self, state: dict[str, Any], workdir: Path, args: argparse.Namespace):
        self.fc = FloorCopy(state, workdir, args)
        self.fc.setup()
        self.fc.once(0)  # faults the buffers in
        self.ways: list[dict[str, float]] = []

    def sample(self, i: int) -> None:
        """One floor sample (every way, seconds) for repeat ``i``."""
        self.ways.append(self.fc.once(i)[2]["ways_s"])

    def close(self) -> None:
        self.fc.close()
        del self.fc
        gc.collect()
        malloc_trim()


def run_method(name: str, state: dict[str, Any], size_dir: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """Run one method (setup, warm-up, repeats, close) and return its JSON record."""
    workdir = size_dir / name
    workdir.mkdir(parents=True, exist_ok=True)
    # Load average (1/5/15 min) at the method's start: on a shared machine, other tenants' load
    # is the main source of noise, so it is kept next to the numbers it may have spoiled.
    rec: dict[str, Any] = {"method": name, "error": None, "loadavg_at_start": os.getloadavg()}
    paired = PairedFloor(state, workdir, args) if name in getattr(args, "paired_floor_for", ()) else None
    method = METHOD_CLASSES[name](state, workdir, args)
    samples: list[Sample] = []
    gc.collect()
    malloc_trim()
    os.sync()  # start from a clean page cache (no other method's dirty pages to write back)
    # A hang (e.g. a save that never returns) dumps all stacks and ends the process; the JSON
    # written so far survives.
    faulthandler.dump_traceback_later(args.method_timeout * (args.repeats + 2), exit=True)
    mon = PeakRSS()
    try:
        with mon:
            try:
                method.setup()
                warm = method.once(0)
                rec["warmup"] = {"blocking_s": warm[0], "durable_s": warm[1], **warm[2]}
                method.cleanup_after(0)
                time.sleep(settle_secs(args, state))  # the warm-up's background work ends (module docstring)
                for i in range(1, args.repeats + 1):
                    os.sync()
                    if paired is not None:
                        paired.sample(i)
                    samples.append(_counting_faults(method, i))
                    method.cleanup_after(i)
                n_restore = getattr(args, "restore_repeats", 0)
                if n_restore and method.restore_tier:
                    # One more checkpoint (untimed), then its restores into the live state.
                    i = args.repeats + 1
                    os.sync()
                    method.once(i)
                    rs = [method.restore(i) for _ in range(n_restore)]
                    method.cleanup_after(i)
                    rec["restore_tier"] = method.restore_tier
                    rec["restore_s"] = median([r[0] for r in rs])
                    rec["restore_samples_s"] = [r[0] for r in rs]
                    rec["restore_extra"] = [r[1] for r in rs]
            finally:
                method.close()
    except BaseException as e:  # noqa: BLE001 -- record and go on (KeyboardInterrupt re-raised)
        if isinstance(e, KeyboardInterrupt):
            raise
        rec["error"] = f"{type(e).__name__}: {e}".strip()
        rec["traceback"] = traceback.format_exc()
        print(f"  {name}: ERROR {rec['error']}", file=sys.stderr)
    finally:
        faulthandler.cancel_dump_traceback_later()
        paired_ways = paired.ways if paired is not None else []
        if paired is not None:
            rec["paired_floor_ways_s"] = paired_ways
            paired.close()
        # A persister should exit on clean close; wait for it (untimed) so that it does not
        # compete with the next method, and record how long that took.
        exits = mon.wait_persisters_exit(args.persister_exit_wait)
        if exits:
            rec["persister_exit_after_close_s"] = {str(k): v for k, v in exits.items()}
        rmtree_quiet(workdir)
        gc.collect()
        malloc_trim()

    blocking = [s[0] for s in samples]
    durable = [s[1] for s in samples if s[1] is not None]
    rec.update({
        # the saves after the warm-up that were the first into one of the method's buffers (snapckpt: the
        # arena's other slots); kept among the samples too
        "first_use_samples_s": blocking[:max(0, getattr(method, "slots", 1) - 1)],
        # the same saves each over the copy floor taken right before it (PairedFloor)
        "first_use_paired_ratios": [b / min(w.values()) for b, w in
                                    zip(blocking[:max(0, getattr(method, "slots", 1) - 1)], paired_ways)],
        "blocking_s": median(blocking),
        "durable_s": median(durable) if method.durable else None,
        "blocking_samples_s": blocking,
        "durable_samples_s": durable,
        "extra_samples": [s[2] for s in samples],
        "self_rss_start_bytes": mon.self_start_bytes,
        "self_peak_rss_bytes": mon.self_peak_bytes,
        "self_rss_end_bytes": psutil.Process().memory_info().rss,
        "helper_peak_rss_bytes": mon.helper_peak_bytes,
        "helpers": list(mon.helpers.values()),
        "preexisting_persisters": list(mon.preexisting.values()),
    })
    return rec


def settle_secs(args: argparse.Namespace, state: dict[str, Any]) -> float:
    """Seconds between the warm-up and the first timed repeat: ``--settle-s-per-gib`` per GiB of ``state``."""
    return getattr(args, "settle_s_per_gib", 0.0) * state_nbytes(state) / GiB


def _counting_faults(method: Method, i: int) -> Sample:
    """``method.once(i)`` with the minor page faults of this process during it in the extras (``minflt``)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocking, durable, extra = method.once(i)
    return blocking, durable, {**extra, "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Add ratio fields to each record of one size (in place)."""
    by = {r["method"]: r for r in records}
    fc, fw, ts = by.get("floor_copy", {}), by.get("floor_write", {}), by.get("torch_save", {})
    for r in records:
        r["ratios"] = {
            "blocking_vs_floor_copy": ratio(r.get("blocking_s"), fc.get("blocking_s")),
            "durable_vs_floor_write": ratio(r.get("durable_s"), fw.get("durable_s")),
            "blocking_vs_torch_save": ratio(r.get("blocking_s"), ts.get("blocking_s")),
            "durable_vs_torch_save": ratio(r.get("durable_s"), ts.get("durable_s")),
        }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _gib(x: int | None) -> str:
    return "n/a" if not x else f"{x / GiB:.2f}"


def _loads(result: dict[str, Any]) -> str:
    """min-max of the 1-minute load average seen at the methods' starts, as text."""
    xs = [r["loadavg_at_start"][0] for size in result["sizes"] for r in size["methods"]
          if r.get("loadavg_at_start")]
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "n/a"


def markdown(result: dict[str, Any]) -> str:
    """Render the result as markdown: a header with machine info, then per size an absolute table
    and a ratio table."""
    m = result["machine"]
    lines = [
        "# snapckpt stall benchmark",
        "",
        f"- date: {m['date']}; git: {m['git_commit']}",
        f"- cpus: {m['cpu_count']} (affinity {m['cpu_affinity']}, torch threads {m['torch_num_threads']}); "
        f"RAM: {m['ram_bytes'] / GiB:.1f} GiB; torch {m['torch']}; python {m['python']}",
        f"- load average (1 min) at each method's start: {_loads(result)} on {m['cpu_count']} cpus "
        "(above the cpu count, other tenants were competing)",
        f"- scratch: {m['scratch_dir']} ({m['scratch_fstype']}); repeats: {result['config']['repeats']} "
        f"(median shown) after 1 warm-up and {result['config'].get('settle_s_per_gib', 0):g} s per GiB of state "
        "(untimed: the warm-up's background work ends)",
        "- blocking = training thread blocked; durable = until fsynced on disk; peak RSS in GiB "
        "(process = this process incl. the state itself; helpers = persister / DCP background process)",
        "",
    ]
    for size in result["sizes"]:
        recs = size["methods"]
        lines += [
            f"## State {size['state_bytes'] / GiB:.2f} GiB ({size['state_bytes']} bytes, "
            f"{size['n_tensors']} tensors)",
            "",
            "| method | blocking s | durable s | warm-up blocking s | persist GB/s | peak RSS process GiB "
            "| (+ over start) | peak RSS helpers GiB | error |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in recs:
            gbps = (size["state_bytes"] / r["durable_s"] / 1e9) if r.get("durable_s") else None
            over = (r["self_peak_rss_bytes"] - r["self_rss_start_bytes"]
                    if r.get("self_peak_rss_bytes") and r.get("self_rss_start_bytes") else None)
            err = (r.get("error") or "").replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(
                f"| {r['method']} | {_s(r.get('blocking_s'))} | {_s(r.get('durable_s'))} "
                f"| {_s((r.get('warmup') or {}).get('blocking_s'))} "
                f"| {'n/a' if gbps is None else f'{gbps:.2f}'} "
                f"| {_gib(r.get('self_peak_rss_bytes'))} | +{_gib(over) if over else '0.00'} "
                f"| {_gib(r.get('helper_peak_rss_bytes'))} | {err} |")
        lines += [
            "",
            "| method | blocking / floor_copy | durable / floor_write | blocking / torch_save "
            "| durable / torch_save |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in recs:
            q = r.get("ratios", {})
            lines.append(
                f"| {r['method']} | {_x(q.get('blocking_vs_floor_copy'))} "
                f"| {_x(q.get('durable_vs_floor_write'))} | {_x(q.get('blocking_vs_torch_save'))} "
                f"| {_x(q.get('durable_vs_torch_save'))} |")
        notes = []
        for r in recs:
            for pid, dt in (r.get("persister_exit_after_close_s") or {}).items():
                notes.append(f"- {r['method']}: persister pid {pid} "
                             + (f"exited {dt:.2f} s after close()" if dt is not None else
                                f"still alive {result['config']['persister_exit_wait_s']:g} s after close()"))
            for h in r.get("preexisting_persisters") or []:
                notes.append(f"- {r['method']}: a persister already running at its start (pid {h['pid']}, "
                             f"peak RSS {h['peak_rss_bytes'] / GiB:.2f} GiB) is not in its helper column")
        if notes:
            lines += ["", *notes]
        lines.append("")
    return "\n".join(lines)


PANELS = (("blocking_s", "blocking (training stall)"), ("durable_s", "until durable (fsynced)"))


def plot(result: dict[str, Any], path: Path, panels: tuple[tuple[str, str], ...] = PANELS) -> None:
    """Grouped bar plot (log scale): one panel per ``(record key, title)`` of ``panels`` (default:
    blocking and durable seconds), one bar per method and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    methods = result["config"]["methods"]
    sizes = result["sizes"]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), sharey=False, squeeze=False)
    width = 0.8 / max(1, len(sizes))
    for ax, (key, title) in zip(axes[0], panels):
        all_ys: list[float] = []
        missing: list[tuple[float, str]] = []
        for j, size in enumerate(sizes):
            by = {r["method"]: r for r in size["methods"]}
            xs, ys = [], []
            for k, name in enumerate(methods):
                x = k + (j - (len(sizes) - 1) / 2) * width
                r = by.get(name, {})
                v = r.get(key)
                if v:
                    xs.append(x)
                    ys.append(v)
                    all_ys.append(v)
                else:
                    missing.append((x, "error" if r.get("error") else "n/a"))
            bars = ax.bar(xs, ys, width=width, label=f"{size['state_bytes'] / GiB:.2f} GiB")
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, rotation=90, padding=2)
        if all_ys:
            ax.set_ylim(min(all_ys) / 2, max(all_ys) * 3)  # head-room for the labels (log scale)
        for x, text in missing:
            ax.annotate(text, (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                        textcoords="offset points", rotation=90, fontsize=7, ha="center",
                        va="bottom", color="grey")
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=8)
        if all_ys:  # a panel with nothing measured (durable of memory-only methods) stays linear and empty
            ax.set_yscale("log")
        ax.set_xlim(-0.6, len(methods) - 0.4)
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("seconds (median, log scale)")
        ax.set_title(title)
        ax.legend(title="state size", fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    m = result["machine"]
    fig.suptitle(f"snapckpt stall benchmark - {m['cpu_count']} CPUs, {m['ram_bytes'] / GiB:.0f} GiB RAM, "
                 f"torch {m['torch']}, {m['date'][:10]} (grey text = n/a or error)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, final: bool) -> None:
    """Write JSON (always), and markdown + PNG next to it (when ``final``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out)
    if final:
        md = markdown(result)
        out.with_suffix(".md").write_text(md)
        plot(result, Path(result["config"]["plot"]))
        print(md)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gib", default="1,2",
                   help="comma-separated state sizes in GiB (fractions allowed, e.g. 0.25)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method (median reported)")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help=f"comma-separated subset of: {','.join(ALL_METHODS)}")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks/results/stall.json"),
                   help="JSON output path; the markdown table goes next to it as .md")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --out, stall.png)")
    p.add_argument("--scratch-dir", default=None,
                   help="parent for checkpoint dirs (default: /tmp if on the repo's disk and not tmpfs)")
    p.add_argument("--method-timeout", type=float, default=600.0,
                   help="seconds one checkpoint may take before the run is declared hung")
    p.add_argument("--persister-exit-wait", type=float, default=15.0,
                   help="seconds to wait (untimed) after close() for a persister to exit")
    p.add_argument("--restore-repeats", type=int, default=1,
                   help="timed restores per method (0: none); see Method.restore")
    p.add_argument("--settle-s-per-gib", type=float, default=SETTLE_S_PER_GIB,
                   help="untimed seconds per GiB of state between the warm-up and the first timed repeat")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes_gib.split(",") if s.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHOD_CLASSES]
    if unknown:
        p.error(f"unknown methods: {unknown}")
    if args.plot is None:
        args.plot = str(Path(args.out).with_name(Path(args.out).stem + ".png"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    scratch_parent, why = scratch_root(args.scratch_dir)
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="snapckpt-stall-", dir=scratch_parent))
    result: dict[str, Any] = {
        "benchmark": "stall",
        "machine": {**machine_info(scratch), "scratch_choice": why},
        "config": {"sizes_gib": args.sizes, "repeats": args.repeats, "methods": args.methods,
                   "method_timeout_s": args.method_timeout, "settle_s_per_gib": args.settle_s_per_gib,
                   "persister_exit_wait_s": args.persister_exit_wait, "out": str(out), "plot": args.plot,
                   "argv": sys.argv},
        "sizes": [],
    }
    print(f"scratch: {scratch} ({why})", file=sys.stderr)
    try:
        for size_gib in args.sizes:
            state = make_state(int(size_gib * GiB))
            nbytes = state_nbytes(state)
            size_rec = {"size_gib": size_gib, "state_bytes": nbytes,
                        "n_tensors": sum(1 for _ in iter_tensors(state)), "methods": []}
            result["sizes"].append(size_rec)
            size_dir = scratch / f"size_{size_gib:g}"
            for name in args.methods:
                print(f"[{size_gib:g} GiB] {name} ...", file=sys.stderr, flush=True)
                rec = run_method(name, state, size_dir, args)
                size_rec["methods"].append(rec)
                add_ratios(size_rec["methods"])
                write_outputs(result, out, final=False)
                print(f"[{size_gib:g} GiB] {name}: blocking {_s(rec['blocking_s'])} s, "
                      f"durable {_s(rec['durable_s'])} s"
                      + (f", ERROR {rec['error']}" if rec["error"] else ""),
                      file=sys.stderr, flush=True)
            rmtree_quiet(size_dir)
            del state
            gc.collect()
    finally:
        rmtree_quiet(scratch)
    write_outputs(result, out, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
