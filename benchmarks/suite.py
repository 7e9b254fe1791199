"""Benchmark suite: every checkpoint method side by side, with restore times, the raw floors,
DLRover's flash checkpoint, a training-loop mode and the "Performance" page (docs/performance.md).

Three jobs, one script (run from the repo root):

* stall suite (default): per state size (default 0.5, 1, 2, 4 GiB; a size that does not fit in
  the free RAM or /dev/shm is skipped and the reason written to the output) and per method, the
  blocking time, time until durable, persist GB/s, restore time per tier and peak RSS, by the
  machinery of ``stall.py`` (same state, same process tree, medians after a warm-up). Outputs
  ``benchmarks/results/suite.{json,md,png}``: absolute table, ratios against the floors, ratios of
  snapckpt against each peer, and the performance issue's targets with their measured ratios.
* ``--loop``: a training-like loop (about 0.3 s of matmuls plus an in-place update of every state
  tensor per step) that checkpoints every step (memory tiers, DCP ``async_save``) or every 10 steps
  (disk tiers, ``torch.save``, ``dcp.save``, DCP process mode); reports the extra seconds per
  checkpoint against the same loop without checkpoints. Outputs ``benchmarks/results/loop.{json,md}``.
* ``--readme``: rewrite the README's section between ``<!-- perf:begin -->`` and
  ``<!-- perf:end -->`` from the latest ``suite.json`` (and ``loop.json`` and ``headline.md`` of
  ``headline.py`` when present next to it).

Methods added here to ``stall.py``'s (``--methods``; default all):

* ``floor_odirect``: the fastest write + fsync of the state's bytes on this machine: the state copied
  (untimed, in setup) into one page-aligned anonymous buffer, then written every way of
  ``WRITE_VARIANTS`` (``O_DIRECT`` with 16 MiB-1 GiB writes from 1-4 ``os.pwritev`` threads, 1 or 4 iovecs
  per call, buffered from 4 threads), ``fsync`` file + directory each, in turn in every repeat; the way
  with the lowest median over the repeats is the floor, its samples the samples (the file is the state
  rounded up to 4 KiB).
* ``dlrover_memory`` / ``dlrover_disk``: DLRover's ``DdpCheckpointer`` (``dlrover==0.6.1``,
  ``pip install dlrover==0.6.1 grpcio``) without its launcher: it forks its own saver process.
  Memory: ``save_checkpoint(MEMORY)``; disk: ``save_checkpoint(DISK)``, committed when its tracker
  file names the step; DLRover does not fsync the shard file, so durable = committed + our fsync
  of the files (both are in the JSON). When it cannot be imported, the record says why.
* ``snapckpt_memory`` / ``snapckpt_disk`` with ``overlap=False`` and ``snapckpt_memory_overlap`` /
  ``snapckpt_disk_overlap`` with ``overlap=True`` (``save_return_s``: what ``save()`` alone blocks).

DeepSpeed's ``engine.save_checkpoint`` needs an engine around the bytes, so it is measured by
``deepspeed_stall.py`` (and ``headline.py``), not here.

Timing on shared cores varies about 2x between runs; read the ratios within one run. Record the
load average (it is in the JSON and the markdown header).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import stall  # noqa: E402  (script-relative import)
from _common import (  # noqa: E402
    dlrover_wait_tracker,
    GiB,
    REPO_ROOT,
    copy_tensors,
    drop_page_cache,
    fsync_path,
    iter_tensors,
    machine_info,
    make_state,
    median,
    ratio,
    rmtree_quiet,
    scratch_root,
    state_nbytes,
)

RESULTS = REPO_ROOT / "benchmarks" / "results"
ALIGN = 4096
CHUNK = 64 * 1024 * 1024
PERF_BEGIN, PERF_END = "<!-- perf:begin -->", "<!-- perf:end -->"

SUITE_METHODS = [
    "floor_copy", "floor_write", "floor_odirect", "torch_save", "dcp_save", "dcp_async_save",
    "dcp_async_save_process", "dlrover_memory", "dlrover_disk", "snapckpt_memory",
    "snapckpt_memory_overlap", "snapckpt_disk", "snapckpt_disk_overlap",
]
PEERS = ["torch_save", "dcp_save", "dcp_async_save", "dcp_async_save_process", "dlrover_memory",
         "dlrover_disk"]
SNAP = ["snapckpt_memory", "snapckpt_memory_overlap", "snapckpt_disk", "snapckpt_disk_overlap"]


# --------------------------------------------------------------------------------------------
# Extra methods
# --------------------------------------------------------------------------------------------

#: Ways to write the state's bytes and fsync them, tried by ``floor_odirect``:
#: ``(name, O_DIRECT?, bytes per write call, writer threads, iovecs per call)``. Writers take interleaved chunks
#: with ``os.pwritev`` (a call of ``n`` iovecs writes ``n`` consecutive pieces of the chunk).
WRITE_VARIANTS = [
    ("odirect_64M_1w", True, 64 << 20, 1, 1),
    ("odirect_256M_1w", True, 256 << 20, 1, 1),
    ("odirect_1G_1w", True, 1 << 30, 1, 1),
    ("odirect_64M_4iov_1w", True, 64 << 20, 1, 4),
    ("odirect_16M_4w", True, 16 << 20, 4, 1),
    ("odirect_64M_2w", True, 64 << 20, 2, 1),
    ("odirect_256M_2w", True, 256 << 20, 2, 1),
    ("odirect_64M_4w", True, 64 << 20, 4, 1),
    ("buffered_64M_4w", False, 64 << 20, 4, 1),
]


class FloorODirect(stall.Method):
    """The fastest write + fsync of the state's bytes on this machine: every repeat writes them once per way
    in :data:`WRITE_VARIANTS` (``O_DIRECT`` from one page-aligned buffer with 16 MiB-1 GiB writes, 1-4 writer
    threads, 1 or 4 iovecs per ``os.pwritev``, and buffered writes from 4 threads), each file fsynced with its
    directory, the ways in turn within a repeat. The floor is the way with the lowest median over the repeats
    and its samples (:func:`pick_floor_variant`), timed as every other method is: one write per repeat. (The
    fastest way of each repeat, the lowest of nine noisy samples, is kept in the JSON as ``min_of_ways_s``:
    on a disk shared with other tenants it undercuts what any single writer gets.) ``io_uring`` is not tried
    (no binding in the standard library)."""

    def setup(self) -> None:
        nbytes = state_nbytes(self.state)
        self.size = -(-nbytes // ALIGN) * ALIGN
        self.buf = mmap.mmap(-1, self.size)  # anonymous, page-aligned
        view = memoryview(self.buf)
        off = 0
        for t in iter_tensors(self.state):
            b = memoryview(t.contiguous().numpy()).cast("B")
            view[off:off + len(b)] = b
            off += len(b)
        del view

    def path(self, i: int, name: str = "") -> Path:
        return self.workdir / f"odirect_{i}{name}.bin"

    def _write(self, path: Path, direct: bool, chunk: int, writers: int, iov: int = 1) -> float:
        import concurrent.futures as cf

        t0 = time.perf_counter()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            view = memoryview(self.buf)
            starts = list(range(0, self.size, chunk))

            def work(k: int) -> None:
                for lo in starts[k::writers]:
                    part = view[lo:min(self.size, lo + chunk)]
                    piece = -(-len(part) // iov // ALIGN) * ALIGN
                    done = 0
                    while done < len(part):
                        rest = part[done:]
                        n = os.pwritev(fd, [rest[j:j + piece] for j in range(0, len(rest), piece)], lo + done)
                        if n <= 0:
                            raise OSError(f"pwritev returned {n}")
                        done += n

            if writers == 1:
                work(0)
            else:
                with cf.ThreadPoolExecutor(writers) as ex:
                    list(ex.map(work, range(writers)))
            del view
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(self.workdir)
        return time.perf_counter() - t0

    def once(self, i: int) -> stall.Sample:
        times = {}
        for name, direct, chunk, writers, iov in WRITE_VARIANTS:
            p = self.path(i, name)
            os.sync()  # no other write-back inside this one's time
            try:
                times[name] = self._write(p, direct, chunk, writers, iov)
            finally:
                p.unlink(missing_ok=True)
        best = min(times, key=times.get)
        # min of the ways for now: pick_floor_variant replaces it with one way's samples once every repeat ran
        return times[best], times[best], {"variants_s": times, "best_variant": best}

    def close(self) -> None:
        buf = getattr(self, "buf", None)
        if buf is not None:
            self.buf = None
            buf.close()


def merge_rounds(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of a method from its records of ``--rounds`` interleaved rounds (each its own setup, warm-up
    and repeats): the samples of every round joined and their medians, the first round's warm-up, the last
    round's restore, the highest peak RSS, each round's load average (``loadavg_at_start_rounds``) and the
    first error. One round: a copy of that record."""
    rec = dict(recs[-1])
    if len(recs) == 1:
        return rec
    ok = [r for r in recs if not r.get("error")]
    rec["error"] = next((r["error"] for r in recs if r.get("error")), None)
    rec["traceback"] = next((r["traceback"] for r in recs if r.get("traceback")), None)
    for key in ("blocking_samples_s", "durable_samples_s", "extra_samples", "first_use_samples_s",
                "paired_floor_ways_s", "first_use_paired_ratios"):
        rec[key] = [x for r in ok for x in r.get(key) or []]
    rec["blocking_s"] = median(rec["blocking_samples_s"])
    rec["durable_s"] = median(rec["durable_samples_s"]) if rec["durable_samples_s"] else None
    rec["warmup"] = recs[0].get("warmup")
    rec["loadavg_at_start"] = recs[0].get("loadavg_at_start")
    rec["loadavg_at_start_rounds"] = [r.get("loadavg_at_start") for r in recs]
    helper = [r["helper_peak_rss_bytes"] for r in recs if r.get("helper_peak_rss_bytes") is not None]
    rec["helper_peak_rss_bytes"] = max(helper) if helper else None
    grown = [r for r in recs if r.get("self_peak_rss_bytes") and r.get("self_rss_start_bytes")]
    if grown:  # the round whose RSS grew most: the host-memory target reads peak - start
        top = max(grown, key=lambda r: r["self_peak_rss_bytes"] - r["self_rss_start_bytes"])
        rec["self_peak_rss_bytes"] = top["self_peak_rss_bytes"]
        rec["self_rss_start_bytes"] = top["self_rss_start_bytes"]
    rec["rounds"] = len(recs)
    return rec


def pick_floor_variant(rec: dict[str, Any]) -> None:
    """Make ``floor_odirect``'s record that of its fastest way: the way of :data:`WRITE_VARIANTS` with the lowest
    median over the timed repeats gives ``blocking_s``/``durable_s`` and their samples (``floor_variant``
    names it; ``variant_medians_s`` has every way's median; ``min_of_ways_s`` the median of each repeat's
    fastest way, the figure reported before). A record without samples (an error) is left as it is."""
    per = [e.get("variants_s") or {} for e in rec.get("extra_samples") or []]
    names = [n for n in per[0] if all(n in p for p in per)] if per else []
    if not names:
        return
    medians = {n: median([p[n] for p in per]) for n in names}
    best = min(medians, key=medians.get)
    samples = [p[best] for p in per]
    rec.update({"min_of_ways_s": median([min(p.values()) for p in per]), "floor_variant": best,
                "variant_medians_s": medians,
                "blocking_s": medians[best], "durable_s": medians[best], "blocking_samples_s": samples,
                "durable_samples_s": samples})


def dlrover_import() -> Any:
    """Import DLRover's DDP flash checkpointer; raise ``RuntimeError`` naming the fix if absent."""
    try:
        from dlrover.trainer.torch.flash_checkpoint import ddp
    except Exception as e:  # noqa: BLE001 -- any import failure means "cannot run here"
        raise RuntimeError(f"DLRover flash checkpoint cannot be imported ({type(e).__name__}: {e}); "
                           "install it with `pip install dlrover==0.6.1 grpcio` (its comm module needs "
                           "grpc, which dlrover lists only under its k8s extra)") from e
    return ddp


class Dlrover:
    """One DLRover ``DdpCheckpointer`` without the launcher, and its clean-up.

    DLRover's engine forks a saver process (``start_saver_process``) and talks to it through
    sockets in ``/tmp/ckpt_sock`` and the shared memory ``/dev/shm/ckpt_shm_<n>`` (fixed names:
    one DLRover job per machine). ``close`` terminates the saver and removes the sockets and
    shared-memory files that were not there before (and the socket directory when empty).
    """

    SOCK_DIR = Path("/tmp/ckpt_sock")

    def __init__(self, ckpt_dir: Path):
        # DLRover forks its saver with the default start method; a fork of this multi-threaded
        # process (RSS sampler, torch and DCP threads) hung once in its start-up here, so the
        # saver is spawned instead (set once for this process; the other methods choose their own).
        import multiprocessing

        if multiprocessing.get_start_method(allow_none=True) != "spawn":
            multiprocessing.set_start_method("spawn", force=True)
        self.ddp = dlrover_import()
        self.shm_before = set(os.listdir("/dev/shm"))
        self.socks_before = set(os.listdir(self.SOCK_DIR)) if self.SOCK_DIR.is_dir() else set()
        self.dir = ckpt_dir
        self.ck = self.ddp.DdpCheckpointer(str(ckpt_dir))
        self.ST = self.ddp.StorageType

    def save(self, step: int, state: dict[str, Any], disk: bool) -> bool:
        """Blocking part of a save; True when DLRover took it (it skips a memory save while its
        saver is busy persisting)."""
        eng = self.ck._engine
        before = eng._cached_step
        self.ck.save_checkpoint(step, state, storage_type=self.ST.DISK if disk else self.ST.MEMORY)
        return eng._cached_step == step and eng._cached_step != before

    def wait_committed(self, step: int, timeout: float) -> None:
        """Poll (every 5 ms) until DLRover's tracker file names ``step``."""
        dlrover_wait_tracker(self.dir, step, timeout)

    def fsync_step(self, step: int) -> None:
        """fsync the files of one step directory and the directory (DLRover does not)."""
        d = self.dir / str(step)
        for f in d.iterdir():
            fsync_path(f)
        fsync_path(d)
        fsync_path(self.dir)

    def load_memory(self) -> dict[str, Any]:
        """DLRover's load: from its shared memory when it holds a step (> 0)."""
        return self.ck._engine.get_state_dict_from_memory()[1]

    def load_disk(self, step: int) -> Any:
        """DLRover's storage read of one step's file (``torch.load`` of ``<dir>/<step>/rank_0.pt``)."""
        return self.ck._engine._load_from_storage(str(self.dir / str(step) / "rank_0.pt"))

    def close(self) -> None:
        eng = getattr(getattr(self, "ck", None), "_engine", None)
        if eng is None:
            return
        proc = getattr(eng, "saver_proc", None)
        try:
            eng.close()
        except Exception:  # noqa: BLE001 -- best-effort clean-up
            traceback.print_exc()
        if proc is not None:
            proc.terminate()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for name in set(os.listdir("/dev/shm")) - self.shm_before:
            if name.startswith("ckpt_"):
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
        if self.SOCK_DIR.is_dir():
            for name in set(os.listdir(self.SOCK_DIR)) - self.socks_before:
                try:
                    os.unlink(self.SOCK_DIR / name)
                except OSError:
                    pass
            try:
                self.SOCK_DIR.rmdir()  # only when empty
            except OSError:
                pass
        self.ck = None


def _unwrap(obj: Any) -> Any:
    """DLRover wraps the user's state as ``{"model_states": state}``; strip that if present."""
    if isinstance(obj, dict) and set(obj) == {"model_states"}:
        return obj["model_states"]
    return obj


class DlroverMemory(stall.Method):
    """DLRover ``save_checkpoint(storage_type=MEMORY)``; durable n/a. Steps start at 1 (DLRover
    ignores a memory snapshot of step 0). Restore: DLRover's load from its shared memory, then a
    copy into the live tensors."""

    durable = False
    restore_tier = "memory"
    disk = False

    def setup(self) -> None:
        self.d = Dlrover(self.workdir / "ckpt")

    def once(self, i: int) -> stall.Sample:
        t0 = time.perf_counter()
        taken = self.d.save(i + 1, self.state, self.disk)
        blocking = time.perf_counter() - t0
        if not taken:
            raise RuntimeError(f"DLRover skipped the save of step {i + 1} (its saver was busy)")
        if not self.disk:
            return blocking, None, {}
        self.d.wait_committed(i + 1, self.args.method_timeout)
        committed = time.perf_counter() - t0
        self.d.fsync_step(i + 1)
        return blocking, time.perf_counter() - t0, {"dlrover_committed_s": committed}

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        loaded = self.d.load_memory()
        t_load = time.perf_counter() - t0
        if not loaded:
            raise RuntimeError("DLRover's shared memory held no state to load")
        copy_tensors(self.state, _unwrap(loaded))
        return time.perf_counter() - t0, {"dlrover_load_s": t_load}

    def cleanup_after(self, i: int) -> None:
        rmtree_quiet(self.workdir / "ckpt" / str(i + 1))

    def close(self) -> None:
        d = getattr(self, "d", None)
        if d is not None:
            self.d = None
            d.close()


class DlroverDisk(DlroverMemory):
    """DLRover ``save_checkpoint(storage_type=DISK)``: blocking = the call (its copy into shared
    memory), committed = its tracker names the step, durable = committed + fsync of the files.
    Restore: DLRover's storage read (``torch.load``) from a cold page cache, then a copy."""

    durable = True
    restore_tier = "disk"
    disk = True

    def restore(self, i: int) -> tuple[float, dict[str, Any]]:
        drop_page_cache(self.workdir / "ckpt" / str(i + 1))
        t0 = time.perf_counter()
        loaded = self.d.load_disk(i + 1)
        t_load = time.perf_counter() - t0
        copy_tensors(self.state, _unwrap(loaded))
        return time.perf_counter() - t0, {"dlrover_load_s": t_load}


class SnapckptMemorySync(stall.SnapckptMemory):
    """snapckpt MEMORY tier with ``overlap=False``."""

    overlap = False


class SnapckptMemoryOverlap(stall.SnapckptMemory):
    """snapckpt MEMORY tier with ``overlap=True``."""

    overlap = True


class SnapckptDiskSync(stall.SnapckptDisk):
    """snapckpt DISK tier with ``overlap=False``."""

    overlap = False


class SnapckptDiskOverlap(stall.SnapckptDisk):
    """snapckpt DISK tier with ``overlap=True``."""

    overlap = True


stall.METHOD_CLASSES.update({
    "floor_odirect": FloorODirect,
    "dlrover_memory": DlroverMemory,
    "dlrover_disk": DlroverDisk,
    "snapckpt_memory": SnapckptMemorySync,
    "snapckpt_memory_overlap": SnapckptMemoryOverlap,
    "snapckpt_disk": SnapckptDiskSync,
    "snapckpt_disk_overlap": SnapckptDiskOverlap,
})


# --------------------------------------------------------------------------------------------
# Memory check
# --------------------------------------------------------------------------------------------

def fits(state_bytes: int, methods: list[str]) -> str | None:
    """None when a state of ``state_bytes`` fits this machine now, else the reason.

    Peak need (bytes): the state, plus the largest method's extra: snapckpt's arena (2 slots x
    1.05 headroom, in /dev/shm, so RAM too), a restore's temporary copy (``torch.load``, DCP's
    staging) and 1 GiB of slack for the interpreter and the other processes' growth.
    """
    vm = psutil.virtual_memory()
    need = int(state_bytes * (1 + 2.5 + 1)) + GiB
    if vm.available < need:
        return (f"needs about {need / GiB:.1f} GiB of RAM (state + 2.5x arena + a restore copy + 1 GiB), "
                f"{vm.available / GiB:.1f} GiB available")
    if any(m.startswith(("snapckpt", "dlrover")) for m in methods):
        shm_free = shutil.disk_usage("/dev/shm").free
        if shm_free < 2.5 * state_bytes:
            return f"needs {2.5 * state_bytes / GiB:.1f} GiB free in /dev/shm, {shm_free / GiB:.1f} GiB free"
    return None


# --------------------------------------------------------------------------------------------
# Ratios and markdown
# --------------------------------------------------------------------------------------------

def add_suite_ratios(records: list[dict[str, Any]]) -> None:
    """Add the suite's ratio fields (floors, restore floors) to each record of one size."""
    stall.add_ratios(records)
    by = {r["method"]: r for r in records}
    od = by.get("floor_odirect", {})
    restore_floor = {"memory": by.get("floor_copy", {}).get("restore_s"),
                     "disk": by.get("floor_write", {}).get("restore_s")}
    for r in records:
        q = r["ratios"]
        q["durable_vs_floor_odirect"] = ratio(r.get("durable_s"), od.get("durable_s"))
        q["restore_vs_floor"] = ratio(r.get("restore_s"), restore_floor.get(r.get("restore_tier")))


def save_return(r: dict[str, Any]) -> float | None:
    """Median seconds ``save()`` alone blocked (snapckpt records), else None."""
    xs = [e["save_return_s"] for e in r.get("extra_samples") or [] if "save_return_s" in e]
    return median(xs)


def paired_floor(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A method's repeats against the copy floor taken right before each (``paired_floor_ways_s``): each floor
    sample is the fastest of its ways (as ``floor_copy`` reports its own). Returns ``floor_s`` (one per repeat,
    seconds), ``ratios`` (repeat / its floor) and ``ratio`` (their median); None without pairs."""
    ways, blocking = rec.get("paired_floor_ways_s") or [], rec.get("blocking_samples_s") or []
    if not ways or len(ways) != len(blocking):
        return None
    floor_s = [min(x.values()) for x in ways]
    ratios = [b / f for b, f in zip(blocking, floor_s)]
    return {"floor_s": floor_s, "ratios": ratios, "ratio": median(ratios)}


def targets(recs: list[dict[str, Any]], state_bytes: int) -> list[tuple[str, str, str, str]]:
    """The performance issue's stall-suite targets: (target, limit, measured, verdict)."""
    by = {r["method"]: r for r in recs}
    g = lambda m, k: by.get(m, {}).get(k)  # noqa: E731
    rows = []

    def row(name: str, limit: float, value: float | None, lower_is_better: bool = True) -> None:
        if value is None:
            rows.append((name, f"{'<=' if lower_is_better else '>='} {limit:g}", "n/a", "not measured"))
            return
        ok = value <= limit if lower_is_better else value >= limit
        rows.append((name, f"{'<=' if lower_is_better else '>='} {limit:g}", f"{value:.2f}",
                     "met" if ok else "missed"))

    # Each memory save against the copy floor taken right before it (stall.PairedFloor), else the run's floor_copy.
    pairs = paired_floor(by.get("snapckpt_memory", {}))
    floor = median(pairs["floor_s"]) if pairs else g("floor_copy", "blocking_s")
    row("overlap off: blocking / floor_copy taken right before each save (median of the pairs' ratios)", 1.05,
        pairs["ratio"] if pairs else None)
    row("overlap off: blocking / floor_copy measured first in the run", 1.05,
        ratio(g("snapckpt_memory", "blocking_s"), g("floor_copy", "blocking_s")))
    # each round's first save into the second slot, over the floor taken right before it
    first_use = g("snapckpt_memory", "first_use_paired_ratios") or [
        x / floor for x in g("snapckpt_memory", "first_use_samples_s") or []]
    row("overlap off: first save into each slot after the warm-up and its settle pause (slowest) / floor_copy "
        "taken right before it", 1.05, max(first_use) if first_use else None)
    row("overlap on: save() returns / floor_copy", 0.05,
        ratio(save_return(by.get("snapckpt_memory_overlap", {})), g("floor_copy", "blocking_s")))
    best = min((x for x in (g("snapckpt_disk", "durable_s"), g("snapckpt_disk_overlap", "durable_s")) if x),
               default=None)
    fastest = min((x for x in (g("floor_odirect", "durable_s"), g("floor_write", "durable_s")) if x), default=None)
    row("durable / fastest write + fsync of the bytes (best snapckpt disk)", 1.2, ratio(best, fastest))
    row("disk-save blocking / memory-tier blocking (overlap off)", 1.2,
        ratio(g("snapckpt_disk", "blocking_s"), g("snapckpt_memory", "blocking_s")))
    row("restore: disk / memory (snapckpt)", 5.0,
        ratio(g("snapckpt_disk", "restore_s"), g("snapckpt_memory", "restore_s")), lower_is_better=False)
    # Host memory beyond the state: the trainer's RSS growth includes the arena pages it maps and
    # writes (the persister's RSS shares those pages, so it is not added). 2 = slots_per_rank default.
    r = by.get("snapckpt_memory", {})
    over = (r["self_peak_rss_bytes"] - r["self_rss_start_bytes"]
            if r.get("self_peak_rss_bytes") and r.get("self_rss_start_bytes") else None)
    # The restore runs inside the same RSS window: a load that materializes the checkpoint before
    # copying it into the live tensors adds one state to this figure.
    row("host memory: trainer RSS growth over saves + restore (arena + any load copy) / (2 slots x state)",
        1.05, ratio(over, 2 * state_bytes))
    return rows


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def ratio_tables(size: dict[str, Any]) -> list[str]:
    """Markdown lines: ratios vs the floors, snapckpt vs each peer, and the issue's targets."""
    recs = size["methods"]
    by = {r["method"]: r for r in recs}
    lines = [
        "| method | blocking s | durable s | restore s (tier) | blocking / floor_copy | durable / floor_write "
        "| durable / floor_odirect | restore / floor (same tier) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        q = r.get("ratios", {})
        rest = "n/a" if r.get("restore_s") is None else f"{r['restore_s']:.3f} ({r['restore_tier']})"
        err = " (error)" if r.get("error") else ""
        lines.append(f"| {r['method']}{err} | {_s(r.get('blocking_s'))} | {_s(r.get('durable_s'))} | {rest} "
                     f"| {_x(q.get('blocking_vs_floor_copy'))} | {_x(q.get('durable_vs_floor_write'))} "
                     f"| {_x(q.get('durable_vs_floor_odirect'))} | {_x(q.get('restore_vs_floor'))} |")
    peers = [p for p in PEERS if p in by and not by[p].get("error")]
    snaps = [s for s in SNAP if s in by and not by[s].get("error")]
    if peers and snaps:
        lines += ["", "snapckpt / peer (blocking ratio; durable ratio; restore ratio of the same tier; "
                  "below 1 = snapckpt faster):", "",
                  "| snapckpt method | " + " | ".join(peers) + " |",
                  "|---|" + "---:|" * len(peers)]
        for s in snaps:
            cells = []
            for p in peers:
                b = ratio(by[s].get("blocking_s"), by[p].get("blocking_s"))
                d = ratio(by[s].get("durable_s"), by[p].get("durable_s"))
                rr = (ratio(by[s].get("restore_s"), by[p].get("restore_s"))
                      if by[s].get("restore_tier") == by[p].get("restore_tier") else None)
                cells.append(f"{_x(b)}; {_x(d)}; {_x(rr)}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Targets of the performance issue (this size):", "",
              "| target | limit | measured | |", "|---|---|---:|---|"]
    for t in targets(recs, size["state_bytes"]):
        lines.append("| " + " | ".join(t) + " |")
    return lines


def suite_markdown(result: dict[str, Any]) -> str:
    """stall.py's tables plus the suite's ratio tables and skipped sizes."""
    md = stall.markdown(result).replace("# snapckpt stall benchmark", "# snapckpt benchmark suite", 1)
    parts = md.split("\n## State ")
    out = [parts[0].rstrip("\n")]
    if result.get("skipped_sizes"):
        out += [""] + [f"- size {s['size_gib']:g} GiB skipped: {s['reason']}" for s in result["skipped_sizes"]]
    out.append(f"- uptime at start: {result['machine'].get('uptime', 'n/a')}")
    for size, text in zip(result["sizes"], parts[1:]):
        out += ["", "## State " + text.rstrip("\n"), "", "### Ratios", "", *ratio_tables(size)]
        restore_rows = [r for r in size["methods"] if r.get("restore_s") is not None]
        if restore_rows:
            out += ["", "Restore = until the live tensors hold the checkpoint (disk tiers from a cold page "
                    "cache: posix_fadvise DONTNEED on the files first)."]
    return "\n".join(out) + "\n"


def uptime() -> str:
    """Output of ``uptime`` (load averages), or the load averages alone."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------------------------
# Stall suite
# --------------------------------------------------------------------------------------------

def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """Run every size and method; write JSON after each method, markdown + PNG at the end."""
    out = Path(args.out)
    scratch_parent, why = scratch_root(args.scratch_dir)
    scratch = Path(tempfile.mkdtemp(prefix="snapckpt-suite-", dir=scratch_parent))
    result: dict[str, Any] = {
        "benchmark": "suite",
        "machine": {**machine_info(scratch), "scratch_choice": why, "uptime": uptime()},
        "config": {"sizes_gib": args.sizes, "repeats": args.repeats, "rounds": args.rounds,
                   "restore_repeats": args.restore_repeats,
                   "methods": args.methods, "method_timeout_s": args.method_timeout,
                   "persister_exit_wait_s": args.persister_exit_wait, "settle_s_per_gib": args.settle_s_per_gib,
                   "out": str(out), "plot": args.plot, "argv": sys.argv},
        "sizes": [],
        "skipped_sizes": [],
    }
    print(f"scratch: {scratch} ({why}); {result['machine']['uptime']}", file=sys.stderr)
    try:
        for size_gib in args.sizes:
            why_not = fits(int(size_gib * GiB), args.methods)
            if why_not:
                print(f"[{size_gib:g} GiB] skipped: {why_not}", file=sys.stderr, flush=True)
                result["skipped_sizes"].append({"size_gib": size_gib, "reason": why_not})
                continue
            state = make_state(int(size_gib * GiB))
            size_rec = {"size_gib": size_gib, "state_bytes": state_nbytes(state),
                        "n_tensors": sum(1 for _ in iter_tensors(state)), "methods": [],
                        "uptime_at_start": uptime()}
            result["sizes"].append(size_rec)
            size_dir = scratch / f"size_{size_gib:g}"
            rounds: dict[str, list[dict[str, Any]]] = {}
            for r in range(args.rounds):
                for name in args.methods:
                    print(f"[{size_gib:g} GiB] {name} (round {r + 1} of {args.rounds}) ...", file=sys.stderr,
                          flush=True)
                    rounds.setdefault(name, []).append(stall.run_method(name, state, size_dir, args))
                    size_rec["methods"] = [merge_rounds(rounds[m]) for m in rounds]
                    for m in size_rec["methods"]:
                        if m["method"] == "floor_odirect":
                            pick_floor_variant(m)
                    rec = size_rec["methods"][list(rounds).index(name)]
                    add_suite_ratios(size_rec["methods"])
                    write(result, out, final=False)
                    print(f"[{size_gib:g} GiB] {name}: blocking {_s(rec['blocking_s'])} s, durable "
                          f"{_s(rec['durable_s'])} s, restore {_s(rec.get('restore_s'))} s"
                          + (f", ERROR {rec['error']}" if rec["error"] else ""), file=sys.stderr, flush=True)
            rmtree_quiet(size_dir)
            del state
            gc.collect()
    finally:
        rmtree_quiet(scratch)
    result["machine"]["uptime_at_end"] = uptime()
    write(result, out, final=True)
    return result


def write(result: dict[str, Any], out: Path, final: bool) -> None:
    """JSON always; markdown and PNG (blocking, durable, restore) when ``final``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, out)
    if final:
        md = suite_markdown(result)
        out.with_suffix(".md").write_text(md)
        if result["sizes"] and result["config"]["plot"]:
            stall.plot(result, Path(result["config"]["plot"]),
                       panels=stall.PANELS + (("restore_s", "restore (live tensors hold it)"),))
        print(md)


# --------------------------------------------------------------------------------------------
# Loop mode
# --------------------------------------------------------------------------------------------

class LoopCkpt:
    """One checkpointing method inside the training loop: ``call(step)`` is the blocking part (at the
    top of a checkpoint step), ``fence()`` runs before the in-place update, ``drain()`` after the
    loop waits for what is still in flight (reported, not charged)."""

    def __init__(self, name: str, state: dict[str, Any], workdir: Path, timeout: float):
        self.name, self.state, self.workdir, self.timeout = name, state, workdir, timeout
        self.pending: Any = None
        self.skipped = 0
        self.last_disk_step: int | None = None
        if name == "floor_copy":  # the copy floor in the loop: copy_ into buffers allocated (and touched) once
            self.pairs = [(t, t.clone()) for t in iter_tensors(state)]
        elif name.startswith("snapckpt"):
            import snapckpt

            self.st = snapckpt.StorageType.DISK if "disk" in name else snapckpt.StorageType.MEMORY
            self.ck = snapckpt.Checkpointer(str(workdir / "ckpt"), keep_last=2, overlap="overlap" in name)
        elif name.startswith("dlrover"):
            self.d = Dlrover(workdir / "ckpt")
        elif name.startswith("dcp"):
            import torch.distributed.checkpoint as dcp

            self.dcp = dcp
            if name == "dcp_async_save_process":
                self.pm = stall.DcpAsyncSaveProcess(state, workdir, argparse.Namespace())
                self.pm.setup()  # the gloo group of world size 1

    def call(self, step: int) -> None:
        n = self.name
        if n == "floor_copy":
            with torch.no_grad():
                for src, dst in self.pairs:
                    dst.copy_(src)
        elif n.startswith("snapckpt"):
            self.pending = self.ck.save(self.state, step, storage_type=self.st)
        elif n.startswith("dlrover"):
            disk = n == "dlrover_disk"
            if not self.d.save(step + 1, self.state, disk):
                self.skipped += 1
            elif disk:
                self.last_disk_step = step + 1
        elif n == "torch_save":
            p = self.workdir / f"ckpt_{step}.pt"
            with open(p, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(self.workdir)
            self._rotate(p)
        elif n == "dcp_save":
            p = self.workdir / f"step_{step}"
            self.dcp.save(self.state, storage_writer=self.dcp.FileSystemWriter(str(p)), no_dist=True)
            self._rotate(p)
        elif n.startswith("dcp_async"):
            if self.pending is not None:  # DCP: wait for the previous async save before the next
                getattr(self.pending, "upload_completion", self.pending).result(timeout=self.timeout)
            p = self.workdir / f"step_{step}"
            proc = n == "dcp_async_save_process"
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            self.pending = self.dcp.async_save(
                self.state, storage_writer=self.dcp.FileSystemWriter(str(p)),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if proc else AsyncCheckpointerType.THREAD,
                no_dist=not proc)
            self._rotate(p, keep=2)

    def _rotate(self, newest: Path, keep: int = 1) -> None:
        """Keep the newest ``keep`` checkpoints of a native method (disk space)."""
        olds = sorted((p for p in self.workdir.iterdir() if p.name.startswith(("ckpt_", "step_"))),
                      key=lambda p: p.stat().st_mtime)
        for p in olds[:-keep]:
            if p != newest:
                (rmtree_quiet(p) if p.is_dir() else p.unlink(missing_ok=True))

    def fence(self) -> None:
        if self.name.startswith("snapckpt"):
            self.ck.fence()

    def drain(self) -> None:
        if self.name.startswith("snapckpt"):
            self.ck.wait(timeout=self.timeout)
        elif self.name == "dlrover_disk" and self.last_disk_step is not None:
            self.d.wait_committed(self.last_disk_step, self.timeout)
        elif self.name.startswith("dcp_async") and self.pending is not None:
            getattr(self.pending, "upload_completion", self.pending).result(timeout=self.timeout)

    def close(self) -> None:
        if hasattr(self, "ck"):
            self.ck.close()
        if hasattr(self, "d"):
            self.d.close()
        if hasattr(self, "pm"):
            self.pm.close()


class Trainer:
    """A training-like step on the state: ``k`` matmuls of two ``n x n`` fp32 matrices (the
    compute), then an in-place update of every state tensor (``add_``, like an optimizer step)."""

    def __init__(self, state: dict[str, Any], step_s: float, n: int = 1024):
        self.tensors = list(iter_tensors(state))
        self.a = torch.randn(n, n)
        self.b = torch.randn(n, n)
        self.update()  # warm
        t0 = time.perf_counter()
        for _ in range(3):
            self.update()
        self.update_s = (time.perf_counter() - t0) / 3
        t0 = time.perf_counter()
        for _ in range(10):
            self.a @ self.b
        mm = (time.perf_counter() - t0) / 10
        self.k = max(0, round((step_s - self.update_s) / mm))
        self.matmul_s = mm

    def compute(self) -> None:
        for _ in range(self.k):
            self.a @ self.b

    def update(self) -> None:
        with torch.no_grad():
            for t in self.tensors:
                t.add_(1e-7)


class GcWatch:
    """The cyclic garbage collector's work while a loop runs: ``gc`` = ``{"collections": [gen0, gen1, gen2],
    "seconds": ..., "count_at_start": gc.get_count()}``. A full collection in a process holding torch (~170k
    objects) takes 0.1-0.4 s on the 2-core machine: one inside a 3-checkpoint window adds 30-130 ms to every
    checkpoint of the method that happened to trigger it."""

    def __init__(self) -> None:
        self.collections, self.seconds, self._t0 = [0, 0, 0], 0.0, 0.0
        self.count_at_start = gc.get_count()

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)

    def record(self) -> dict[str, Any]:
        return {"collections": self.collections, "seconds": self.seconds, "count_at_start": list(self.count_at_start)}


def loop_once(trainer: Trainer, steps: int, every: int, ck: LoopCkpt | None) -> dict[str, Any]:
    """Run ``steps`` steps, checkpointing at steps ``0, every, 2*every, ...``; returns the loop's
    wall time (drain excluded), per-step times, blocked seconds per checkpoint, the drain and the garbage
    collector's work during the steps (:class:`GcWatch`)."""
    step_times, blocked = [], []
    watch = GcWatch().__enter__()
    t_start = time.perf_counter()
    for s in range(steps):
        t0 = time.perf_counter()
        b = 0.0
        due = ck is not None and s % every == 0
        if due:
            tb = time.perf_counter()
            ck.call(s)
            b += time.perf_counter() - tb
        trainer.compute()
        if ck is not None:
            tb = time.perf_counter()
            ck.fence()
            b += time.perf_counter() - tb
        trainer.update()
        step_times.append(time.perf_counter() - t0)
        if due:
            blocked.append(b)
    total = time.perf_counter() - t_start
    watch.__exit__()
    td = time.perf_counter()
    if ck is not None:
        ck.drain()
    return {"total_s": total, "step_s": step_times, "blocked_s": blocked,
            "n_ckpt": len(blocked), "drain_s": time.perf_counter() - td, "gc": watch.record()}


def timed_round(trainer: Trainer, steps: int, every: int, ck: LoopCkpt) -> dict[str, Any]:
    """One paired measurement: the loop without checkpoints (``max(steps, 10)`` steps), then ``steps`` steps
    with them; each starts right after a full garbage collection (untimed), so that neither window pays for
    the collections the process owed before it (a method that allocates would otherwise be the one to trigger
    them: see :class:`GcWatch`). ``extra_per_ckpt_s`` = (loop time - paired baseline step x steps) / checkpoints."""
    gc.collect()
    pb = loop_once(trainer, max(steps, 10), 1, None)
    gc.collect()
    r = loop_once(trainer, steps, every, ck)
    base = pb["total_s"] / len(pb["step_s"])
    r["paired_baseline_step_s"] = base
    r["baseline_gc"] = pb["gc"]
    r["extra_per_ckpt_s"] = (r["total_s"] - base * len(r["step_s"])) / r["n_ckpt"]
    r["uptime"] = uptime()
    return r


LOOP_PLAN = [  # (method, checkpoint every N steps)
    ("floor_copy", 1), ("snapckpt_memory", 1), ("snapckpt_memory_overlap", 1), ("dlrover_memory", 1),
    ("dcp_async_save", 1),
    ("snapckpt_disk", 10), ("snapckpt_disk_overlap", 10), ("dlrover_disk", 10), ("torch_save", 10),
    ("dcp_save", 10), ("dcp_async_save_process", 10),
]


def merge_loop_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A method's record from its timed rounds (:func:`timed_round`): ``extra_per_ckpt_s`` and
    ``paired_baseline_step_s`` are the medians over the rounds; steps, blocked seconds, checkpoints, loop time,
    drain and skipped collections are the rounds' together; ``rounds`` keeps each round's own numbers."""
    gc_all = [sum(r["gc"]["collections"][g] for r in rounds) for g in range(3)]
    return {
        "extra_per_ckpt_s": statistics.median(r["extra_per_ckpt_s"] for r in rounds),
        "paired_baseline_step_s": statistics.median(r["paired_baseline_step_s"] for r in rounds),
        "total_s": sum(r["total_s"] for r in rounds),
        "step_s": [x for r in rounds for x in r["step_s"]],
        "blocked_s": [x for r in rounds for x in r["blocked_s"]],
        "n_ckpt": sum(r["n_ckpt"] for r in rounds),
        "drain_s": sum(r["drain_s"] for r in rounds),
        "gc": {"collections": gc_all, "seconds": sum(r["gc"]["seconds"] for r in rounds)},
        "rounds": [{k: r[k] for k in ("extra_per_ckpt_s", "paired_baseline_step_s", "total_s", "n_ckpt",
                                      "drain_s", "gc", "baseline_gc", "uptime")} for r in rounds],
    }


def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The loop benchmark; writes ``loop.json`` / ``loop.md`` next to ``--out``."""
    out = Path(args.out).with_name("loop.json")
    scratch_parent, why = scratch_root(args.scratch_dir)
    scratch = Path(tempfile.mkdtemp(prefix="snapckpt-loop-", dir=scratch_parent))
    size_gib = args.loop_size_gib
    state = make_state(int(size_gib * GiB))
    trainer = Trainer(state, args.step_s)
    plan = [(m, e) for m, e in LOOP_PLAN if m in args.loop_methods]
    result: dict[str, Any] = {
        "benchmark": "loop", "machine": {**machine_info(scratch), "uptime": uptime()},
        "config": {"size_gib": size_gib, "state_bytes": state_nbytes(state), "target_step_s": args.step_s,
                   "matmuls_per_step": trainer.k, "matmul_s": trainer.matmul_s, "update_s": trainer.update_s,
                   "ckpts_per_method": args.loop_ckpts, "rounds_every_step": args.loop_rounds, "warmup_ckpts": 1,
                   "argv": sys.argv},
        "baseline": [], "methods": [],
    }
    print(f"loop: {size_gib:g} GiB state, {trainer.k} matmuls + update ({trainer.update_s:.3f} s) per step; "
          f"{result['machine']['uptime']}", file=sys.stderr, flush=True)

    def baseline() -> None:
        r = loop_once(trainer, args.loop_baseline_steps, 1, None)
        result["baseline"].append({"mean_step_s": r["total_s"] / args.loop_baseline_steps,
                                   "median_step_s": statistics.median(r["step_s"]), "uptime": uptime()})
        print(f"baseline: {result['baseline'][-1]['mean_step_s']:.3f} s/step", file=sys.stderr, flush=True)

    try:
        baseline()
        for name, every in plan:
            rec: dict[str, Any] = {"method": name, "every": every, "error": None, "uptime_at_start": uptime()}
            wd = scratch / name
            wd.mkdir(parents=True)
            ck = None
            os.sync()
            try:
                ck = LoopCkpt(name, state, wd, args.method_timeout)
                loop_once(trainer, every, every, ck)  # warm-up: one checkpoint (first touch, start-up)
                ck.drain()
                steps = every * args.loop_ckpts
                # A paired baseline right before each timed round: the load of this shared machine drifts
                # over minutes, so each round is compared with the loop it just ran without checkpoints; the
                # methods that checkpoint every step get --loop-rounds rounds and report the median round
                # (a load spike or a collection in one round moves one sample, not the result).
                rounds = [timed_round(trainer, steps, every, ck)
                          for _ in range(args.loop_rounds if every == 1 else 1)]
                rec.update(merge_loop_rounds(rounds))
                rec["skipped"] = ck.skipped
            except Exception as e:  # noqa: BLE001 -- record and go on
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc()
                print(f"  {name}: ERROR {rec['error']}", file=sys.stderr, flush=True)
            finally:
                if ck is not None:
                    try:
                        ck.close()
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()
                rmtree_quiet(wd)
            result["methods"].append(rec)
            if not rec["error"]:
                print(f"{name}: {rec['total_s'] / len(rec['step_s']):.3f} s/step, blocked "
                      f"{statistics.median(rec['blocked_s']):.3f} s per checkpoint", file=sys.stderr, flush=True)
        baseline()
    finally:
        rmtree_quiet(scratch)
    base = statistics.mean(b["mean_step_s"] for b in result["baseline"])
    result["base_step_s"] = base
    for rec in result["methods"]:
        if rec["error"]:
            continue
        n = len(rec["step_s"])
        rec["extra_per_ckpt_vs_global_baseline_s"] = (rec["total_s"] - base * n) / rec["n_ckpt"]
        rec["median_blocked_s"] = statistics.median(rec["blocked_s"])
    result["machine"]["uptime_at_end"] = uptime()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    md = loop_markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
    return result


def loop_markdown(result: dict[str, Any]) -> str:
    """The loop table: extra seconds per checkpoint, and the issue's loop targets."""
    c, m = result["config"], result["machine"]
    by = {r["method"]: r for r in result["methods"]}
    lines = [
        "# Training-loop cost of checkpointing",
        "",
        f"- date: {m['date']}; git: {m['git_commit']}; {m['cpu_count']} cpus; torch {m['torch']}",
        f"- uptime at start: {m['uptime']}; at end: {m.get('uptime_at_end', 'n/a')}",
        f"- state {c['state_bytes'] / GiB:.2f} GiB; step = {c['matmuls_per_step']} matmuls 1024x1024 + in-place "
        f"update of every tensor ({c['update_s']:.3f} s); baseline step {result['base_step_s']:.3f} s "
        f"(mean of the no-checkpoint loop before and after: "
        + ", ".join(f"{b['mean_step_s']:.3f}" for b in result["baseline"]) + ")",
        f"- {c['ckpts_per_method']} checkpoints per round after 1 warm-up; {c.get('rounds_every_step', 1)} rounds for "
        "the methods that checkpoint every step, 1 for the others; extra s per checkpoint = (loop time - paired "
        "baseline step x steps) / checkpoints of the median round, the paired baseline being the same loop without "
        "checkpoints run right before the round; both start right after a full garbage collection (untimed); "
        "what is still in flight after the last step (drain) is not charged; skipped = saves DLRover declined "
        "(its saver busy); GC = collections (gen0/gen1/gen2) and their seconds inside the timed rounds",
        "",
        "| method | every | extra s per checkpoint | rounds' extra s (min to max) | paired baseline step s "
        "| median blocked s | drain s | skipped | GC in timed rounds | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["methods"]:
        if r["error"]:
            lines.append(f"| {r['method']} | {r['every']} | n/a | n/a | n/a | n/a | n/a | | | {r['error'][:120]} |")
            continue
        ex = [x["extra_per_ckpt_s"] for x in r.get("rounds") or [r]]
        g = r.get("gc") or {"collections": [0, 0, 0], "seconds": 0.0}
        lines.append(f"| {r['method']} | {r['every']} | {r['extra_per_ckpt_s']:.3f} | {min(ex):.3f} to {max(ex):.3f} "
                     f"| {r['paired_baseline_step_s']:.3f} | {r['median_blocked_s']:.3f} "
                     f"| {r['drain_s']:.3f} | {r.get('skipped', 0)} "
                     f"| {'/'.join(map(str, g['collections']))}, {g['seconds']:.3f} s | |")
    g = lambda k: (by.get(k) or {}).get("extra_per_ckpt_s")  # noqa: E731
    mem = min((x for x in (g("snapckpt_memory"), g("snapckpt_memory_overlap")) if x is not None), default=None)
    disk = min((x for x in (g("snapckpt_disk"), g("snapckpt_disk_overlap")) if x is not None), default=None)
    # A peer that declined some of its saves (DLRover while its saver is busy) did less work than the
    # others: it is not the "best peer" for the disk target; its skips are named under the table.
    skipped = {k: r.get("skipped", 0) for k, r in by.items() if r.get("skipped")}
    peers = {k: g(k) for k in ("dlrover_disk", "torch_save", "dcp_save", "dcp_async_save_process")
             if g(k) is not None and not skipped.get(k)}
    best_peer = min(peers.items(), key=lambda kv: kv[1]) if peers else None
    lines += ["", "| target | limit | measured | |", "|---|---|---:|---|"]

    def row(name: str, a: float | None, b: float | None, limit: float | None = 0.5) -> None:
        q = ratio(a, b) if (b or 0) > 0 else None
        verdict = "" if limit is None or q is None else ("met" if q <= limit else "missed")
        if q is not None and q < 0:  # a round faster than its paired baseline: the load moved, not a result
            verdict = "invalid (extra time below 0: the baseline step moved; rerun on a quieter machine)"
        lines.append(f"| {name} | {'' if limit is None else f'<= {limit:g}'} | {_x(q)} | "
                     f"{'n/a' if q is None else verdict} |")

    # The loop target (2-core CPU: the copy shares the cores with training): extra time per memory
    # checkpoint <= 1.1x the copy floor's own extra time per checkpoint in the same loop.
    for name, label, limit in (("snapckpt_memory", "snapckpt memory, overlap off", 1.1),
                               ("snapckpt_memory_overlap", "snapckpt memory, overlap on", 1.1),
                               ("dlrover_memory", "peer: DLRover memory", None),
                               ("dcp_async_save", "peer: DCP async_save (thread)", None)):
        row(f"extra s per memory checkpoint / copy floor's ({label})", g(name), g("floor_copy"), limit)
    row("memory tier cost / DLRover memory cost (best snapckpt overlap mode)", mem, g("dlrover_memory"))
    row(f"disk tier cost / best peer disk cost ({best_peer[0] if best_peer else 'n/a'})", disk,
        best_peer[1] if best_peer else None)
    if skipped:
        lines += ["", "Saves declined (DLRover skips a save while its saver is persisting, so its cost covers fewer "
                  "checkpoints than it was asked for; such a peer is left out of the best-peer disk target): "
                  + ", ".join(f"{k} {v} of {by[k]['n_ckpt']}" for k, v in skipped.items()) + "."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# README section
# --------------------------------------------------------------------------------------------

def readme_section(suite: dict[str, Any], loop: dict[str, Any] | None, size_gib: float | None,
                   headline: str | None = None) -> str:
    """The text between the README's perf markers: machine, date, commit, ratio tables, and the loop
    table and the headline markdown (``headline.md`` of ``headline.py``) when given."""
    m = suite["machine"]
    lines = [
        PERF_BEGIN,
        "<!-- generated by `benchmarks/suite.py --readme` from benchmarks/results/suite.json"
        + (" and loop.json" if loop else "") + (" and headline.md" if headline else "")
        + "; do not edit by hand -->",
        "",
        f"Measured {m['date'][:16].replace('T', ' ')} at commit `{str(m['git_commit'])[:12]}` on "
        f"{m['cpu_count']} CPUs, {m['ram_bytes'] / GiB:.1f} GiB RAM, {m['scratch_fstype']} scratch, torch "
        f"{m['torch']}; `{m.get('uptime', '')}` at the start. Medians of {suite['config']['repeats']} after a "
        "warm-up; timings on shared cores vary about 2x between runs, so read the ratios within the run.",
    ]
    sizes = [s for s in suite["sizes"] if size_gib is None or abs(s["size_gib"] - size_gib) < 1e-9]
    for size in sizes:
        lines += ["", f"**State {size['state_bytes'] / GiB:.2f} GiB** ({size['n_tensors']} tensors):", "",
                  *ratio_tables(size)]
    others = [f"{s['size_gib']:g}" for s in suite["sizes"] if s not in sizes]
    if others:
        lines += ["", f"The same tables for {', '.join(others)} GiB from this run are in `benchmarks/results/suite.md` "
                  "(git-ignored; regenerated by the suite)."]
    if suite.get("skipped_sizes"):
        lines += [""] + [f"- {s['size_gib']:g} GiB skipped: {s['reason']}" for s in suite["skipped_sizes"]]
    if loop:
        body = loop_markdown(loop).split("\n", 2)[2]  # drop the title
        lines += ["", "**Training loop** (extra seconds per checkpoint):", "", body.strip()]
    if headline:
        body = headline.split("\n", 2)[2]  # drop the title
        lines += ["", "**Headline: DeepSpeed and Megatron** (`benchmarks/headline.py`):", "", body.strip()]
    lines += ["", PERF_END]
    return "\n".join(lines)


def update_readme(readme: Path, suite_json: Path, size_gib: float | None) -> None:
    """Rewrite the section between the perf markers of ``readme``.

    Raises:
        FileNotFoundError: ``suite_json`` does not exist (run the suite first).
        ValueError: the README lacks the markers (add ``<!-- perf:begin -->`` and
            ``<!-- perf:end -->`` where the section goes).
    """
    if not suite_json.exists():
        raise FileNotFoundError(f"{suite_json} not found: run `benchmarks/suite.py` first")
    suite = json.loads(suite_json.read_text())
    loop_path = suite_json.with_name("loop.json")
    loop = json.loads(loop_path.read_text()) if loop_path.exists() else None
    head_path = suite_json.with_name("headline.md")
    headline = head_path.read_text() if head_path.exists() else None
    text = readme.read_text()
    pat = re.compile(re.escape(PERF_BEGIN) + ".*?" + re.escape(PERF_END), re.S)
    if not pat.search(text):
        raise ValueError(f"{readme} has no {PERF_BEGIN} ... {PERF_END} markers: add them where the "
                         "Performance section's generated part goes")
    section = readme_section(suite, loop, size_gib, headline)
    readme.write_text(pat.sub(lambda _: section, text, count=1))
    print(f"rewrote the perf section of {readme} from {suite_json}" + (" and loop.json" if loop else "")
          + (" and headline.md" if headline else ""))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gib", default="0.5,1,2,4", help="comma-separated state sizes in GiB")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method (median reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the method list this many times in turn (each method's setup, warm-up and "
                        "repeats per round) and report the medians of all rounds' samples: on a machine "
                        "whose load drifts, every method then sees the same spread of load")
    p.add_argument("--restore-repeats", type=int, default=1, help="timed restores per method (0: none)")
    p.add_argument("--methods", default=",".join(SUITE_METHODS),
                   help=f"comma-separated subset of: {','.join(SUITE_METHODS)}")
    p.add_argument("--out", default=str(RESULTS / "suite.json"), help="JSON path; .md and .png next to it")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--scratch-dir", default=None, help="parent for checkpoint dirs (default: see _common)")
    p.add_argument("--method-timeout", type=float, default=600.0,
                   help="seconds one checkpoint may take before the run is declared hung")
    p.add_argument("--persister-exit-wait", type=float, default=15.0)
    p.add_argument("--settle-s-per-gib", type=float, default=stall.SETTLE_S_PER_GIB,
                   help="untimed seconds per GiB of state between a method's warm-up and its first timed repeat "
                        "(stall.py's module docstring)")
    p.add_argument("--loop", action="store_true", help="run the training-loop benchmark instead")
    p.add_argument("--loop-size-gib", type=float, default=0.5, help="state of the loop (0.5: ~4 min idle 2-core)")
    p.add_argument("--step-s", type=float, default=0.3, help="target seconds of one training step")
    p.add_argument("--loop-ckpts", type=int, default=3, help="timed checkpoints per method (per round) in the loop")
    p.add_argument("--loop-rounds", type=int, default=5,
                   help="timed rounds (each with its paired baseline) of the methods that checkpoint every step; "
                        "their extra s per checkpoint is the median round's")
    p.add_argument("--loop-baseline-steps", type=int, default=20)
    p.add_argument("--loop-methods", default=",".join(m for m, _ in LOOP_PLAN))
    p.add_argument("--readme", action="store_true",
                   help="rewrite the perf section of --readme-path (docs/performance.md) from --out (and loop.json next to it)")
    p.add_argument("--render", action="store_true",
                   help="only re-render the markdown and PNG of an existing --out JSON (no measuring)")
    p.add_argument("--readme-path", default=str(REPO_ROOT / "docs" / "performance.md"),
                   help="the page holding the perf markers (default: docs/performance.md)")
    p.add_argument("--readme-size-gib", type=float, default=None,
                   help="only this size in the README (default: every size in the JSON)")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes_gib.split(",") if s.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.loop_methods = [m.strip() for m in args.loop_methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in stall.METHOD_CLASSES]
    unknown += [m for m in args.loop_methods if m not in dict(LOOP_PLAN)]
    if unknown:
        p.error(f"unknown methods: {unknown}")
    if args.plot is None:
        args.plot = str(Path(args.out).with_suffix(".png"))
    args.paired_floor_for = ("snapckpt_memory",)  # its rows 3 and 4: each repeat against a floor taken right before it
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme:
        update_readme(Path(args.readme_path), Path(args.out), args.readme_size_gib)
        return 0
    if args.render:
        result = json.loads(Path(args.out).read_text())
        for size in result["sizes"]:
            add_suite_ratios(size["methods"])
        write(result, Path(args.out), final=True)
        return 0
    if args.loop:
        run_loop(args)
        return 0
    if args.no_plot:
        args.plot = None
    res = run_suite(args)
    return 0 if res["sizes"] or res["skipped_sizes"] else 1


if __name__ == "__main__":
    sys.exit(main())
