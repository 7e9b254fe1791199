"""Worker for tests/test_resources.py (cases D1, D2): one rank, started by ``_harness.launch``.

Modes (first argument), each printing ``RESULT {...json...}`` lines:

- ``tiny_shm CKPT SHM``: save a 32 MiB state with ``shm_dir=SHM`` (a 16 MiB tmpfs) and report the error,
  what the tmpfs and the checkpoint directory hold afterwards, then save, wait and load a 1 MiB state.
- ``one_slot CKPT SHM``: a 10 MiB state whose first slot fits the 16 MiB tmpfs but whose second does not
  (steps 1, 2), then a 4 MiB state (steps 3-5), then load; then the 10 MiB state again with a
  ``host_memory_budget_nbytes`` of 12 MiB (steps 8, 9; then a 14 MiB state that outgrows the budget, step
  10), loaded, with what the tmpfs holds.
- ``single_slot CKPT``: ``slots_per_rank=1``: step 1 DISK and at once step 2 MEMORY (it waits for step 1's
  write), then step 3 MEMORY (the test arms a SIGKILL halfway through its copy).
- ``single_slot_resume CKPT KILL``: ``slots_per_rank=1``: load and report; with ``KILL=1`` then snapshot
  step 4 in memory and SIGKILL itself, else close.
- ``churn CKPT``: 200 saves of a 64 MiB state (MEMORY, a DISK save every 20th, ``keep_last=2``) with the
  RSS and open-fd count of this process and of the persister sampled after every save; then ``close()``
  and the fd count and persister state after it.
- ``hold CKPT MARKER IDLE_SECS``: commit step 1, snapshot step 2 in memory, write ``MARKER`` (JSON with
  the persister pid) and sleep until killed.
- ``resume CKPT``: load, report step/tier, commit step 3, close, report.
- ``fewer_slots CKPT SHM SLOTS``: ``slots_per_rank=SLOTS``: save a 10 MiB state in memory (step 1) and report its
  error, or load it back and report; then exit without closing (as a crashed rank: the persister lives on).
- ``local_ranks CKPT SHM``: 2 ranks on one node, three Checkpointers one after the other, each saving in memory
  in turn (rank 0 steps 1-2, then rank 1 step 1(-2), then rank 0 step 3, rank 1 step 3): ``even`` (both 12 MiB,
  two slots), ``one`` (both 12 MiB, ``slots_per_rank=1``), ``uneven`` (rank 0 12 MiB, rank 1 2 MiB, two slots,
  then loaded); a result per rank and phase with each save's error and what the tmpfs held.
"""
from __future__ import annotations

import json
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the harness
from _harness import proc_status_bytes, tree, used_bytes  # noqa: E402
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import InsufficientSharedMemoryError

MiB = 1 << 20
QUICK = dict(commit_timeout_secs=60, request_timeout_secs=30, coordination_timeout_secs=30,
             persister_startup_timeout_secs=60)


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def state_of(nbytes: int, fill: float = 1.0) -> dict:
    return {"model": {"w": torch.full((nbytes // 4,), fill, dtype=torch.float32)}, "note": "x"}


def persister_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not persister_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_tiny_shm(ckpt: str, shm: str) -> None:
    ck = Checkpointer(ckpt, shm_dir=shm, keep_last=2, **QUICK)
    used0 = used_bytes(shm)
    err = None
    try:
        ck.save(state_of(32 * MiB), 1, StorageType.DISK)
    except InsufficientSharedMemoryError as e:
        err = {"type": type(e).__name__, "message": str(e)}
    result(phase="big", error=err, shm_used_before=used0, shm_used_after=used_bytes(shm),
           ckpt_tree=tree(ckpt), last_stats=None if ck.last_stats is None else ck.last_stats.step)
    small = state_of(1 * MiB, fill=7.0)
    ck.save(small, 2, StorageType.DISK).wait()
    out = ck.load()
    result(phase="small", step=ck.last_load.step, equal=bool(torch.equal(out["model"]["w"], small["model"]["w"])),
           ckpt_tree=tree(ckpt))
    pid = ck.persister_pid
    ck.close()
    result(phase="closed", persister_gone=wait_gone(pid))


def run_one_slot(ckpt: str, shm: str) -> None:
    ck = Checkpointer(ckpt, shm_dir=shm, **QUICK)
    errors = []
    for step in (1, 2):
        try:
            ck.save(state_of(10 * MiB, fill=float(step)), step, StorageType.MEMORY)
            errors.append(None)
        except InsufficientSharedMemoryError as e:
            errors.append(str(e))
    for step in (3, 4, 5):  # 5 MiB slots: two of them fit
        ck.save(state_of(4 * MiB, fill=float(step)), step, StorageType.MEMORY)
    out = ck.load()
    result(errors=errors, loaded_step=ck.last_load.step, loaded_fill=float(out["model"]["w"][0]))
    pid = ck.persister_pid
    ck.close()
    result(phase="closed", persister_gone=wait_gone(pid))
    for opts, steps in (({"host_memory_budget_nbytes": 12 * MiB}, (8, 9)),):
        ck = Checkpointer(ckpt, shm_dir=shm, **opts, **QUICK)
        for step in steps:  # the second snapshot overwrites the first in the only slot
            ck.save(state_of(10 * MiB, fill=float(step)), step, StorageType.MEMORY)
        used = used_bytes(shm)
        out = ck.load()
        outgrown = None
        if "host_memory_budget_nbytes" in opts:
            try:
                ck.save(state_of(14 * MiB, fill=10.0), 10, StorageType.MEMORY)
            except InsufficientSharedMemoryError as e:
                outgrown = str(e)
        result(phase="limited", opts=opts, shm_used=used, loaded_step=ck.last_load.step,
               loaded_fill=float(out["model"]["w"][0]), outgrown=outgrown,
               last_stats=ck.last_stats.step)
        pid = ck.persister_pid
        ck.close()
        wait_gone(pid)


def run_single_slot(ckpt: str) -> None:
    ck = Checkpointer(ckpt, slots_per_rank=1, **QUICK)
    events = []
    ck.add_listener(events.append)
    first = ck.save(state_of(4 * MiB, fill=1.0), 1, StorageType.DISK)  # no wait: its write holds the slot
    ck.save(state_of(4 * MiB, fill=2.0), 2, StorageType.MEMORY)
    first.wait()
    result(phase="saved", waited=[e.step for e in events if e.kind == "slot_wait"], persister_pid=ck.persister_pid,
           committed=[e.step for e in events if e.kind == "committed"])
    ck.save(state_of(4 * MiB, fill=3.0), 3, StorageType.MEMORY)  # SIGKILLed halfway through its copy
    result(phase="step 3 taken")


def run_single_slot_resume(ckpt: str, kill: str) -> None:
    ck = Checkpointer(ckpt, slots_per_rank=1, **QUICK)
    out = ck.load()
    result(phase="loaded", step=ck.last_load.step, tier=ck.last_load.tier.value, fill=float(out["model"]["w"][0]),
           persister_pid=ck.persister_pid, on_disk=sorted(n for n in os.listdir(ckpt) if n.startswith("step_")))
    if kill == "1":
        ck.save(state_of(4 * MiB, fill=4.0), 4, StorageType.MEMORY)
        result(phase="step 4 taken")
        os.kill(os.getpid(), 9)
    pid = ck.persister_pid
    ck.close()
    result(phase="closed", persister_gone=wait_gone(pid))


def run_churn(ckpt: str) -> None:
    me = psutil.Process()
    fds0 = me.num_fds()
    ck = Checkpointer(ckpt, keep_last=2, persister_idle_timeout_secs=60, fsync=False, **QUICK)
    pid = ck.persister_pid
    pp = psutil.Process(pid)
    state = {"model": {f"t{i}": torch.randn(MiB) for i in range(16)}}  # 16 x 4 MiB = 64 MiB
    samples = []
    pids = set()
    for i in range(200):
        state["model"]["t0"][0] = float(i)
        tier = StorageType.DISK if i % 20 == 19 else StorageType.MEMORY
        h = ck.save({"model": state["model"], "step": i}, i, tier)
        if tier == StorageType.DISK:
            h.wait()
        pids.add(ck.persister_pid)
        samples.append({"rss": me.memory_info().rss, "anon": proc_status_bytes(me.pid, "RssAnon"),
                        "fds": me.num_fds(), "p_rss": pp.memory_info().rss,
                        "p_anon": proc_status_bytes(pid, "RssAnon"), "p_fds": pp.num_fds()})
    on_disk = sorted(n for n in os.listdir(ckpt) if n.startswith("step_"))
    ck.close()
    gone = wait_gone(pid)
    result(samples=samples, persister_pids=sorted(pids), fds_before=fds0, fds_after_close=me.num_fds(),
           persister_gone=gone, on_disk=on_disk)


def run_hold(ckpt: str, marker: str, idle: float) -> None:
    ck = Checkpointer(ckpt, persister_idle_timeout_secs=idle, **QUICK)
    ck.save(state_of(4 * MiB, fill=1.0), 1, StorageType.DISK).wait()
    ck.save(state_of(4 * MiB, fill=2.0), 2, StorageType.MEMORY)
    with open(marker + ".tmp", "w") as f:
        json.dump({"persister_pid": ck.persister_pid}, f)
    os.replace(marker + ".tmp", marker)
    time.sleep(600)  # killed by the test


def run_resume(ckpt: str) -> None:
    me = psutil.Process()
    fds0 = me.num_fds()
    ck = Checkpointer(ckpt, **QUICK)
    pid = ck.persister_pid
    out = ck.load()
    result(phase="loaded", step=ck.last_load.step, tier=ck.last_load.tier.value,
           fill=float(out["model"]["w"][0]), persister_pid=pid)
    ck.save(state_of(4 * MiB, fill=3.0), 3, StorageType.DISK).wait()
    ck.close()
    result(phase="closed", persister_gone=wait_gone(pid), fds_before=fds0, fds_after_close=me.num_fds())


def run_fewer_slots(ckpt: str, shm: str, slots: str) -> None:
    ck = Checkpointer(ckpt, shm_dir=shm, slots_per_rank=int(slots), **QUICK)
    err, loaded = None, None
    try:
        ck.save(state_of(10 * MiB, fill=3.0), 1, StorageType.MEMORY).wait()
        out = ck.load()
        loaded = [ck.last_load.step, ck.last_load.tier.name, float(out["model"]["w"][0])]
    except InsufficientSharedMemoryError as e:
        err = str(e)
    result(error=err, loaded=loaded, persister_pid=ck.persister_pid, shm_used=used_bytes(shm))
    sys.stdout.flush()
    os._exit(0)  # no close(): the persister outlives this rank, as after a crash


def run_local_ranks(ckpt: str, shm: str) -> None:
    rank = dist.get_rank()
    for phase, slots, mib in (("even", 2, (12, 12)), ("one", 1, (12, 12)), ("uneven", 2, (12, 2))):
        ck = Checkpointer(ckpt, shm_dir=shm, slots_per_rank=slots, **QUICK)
        errors = {}

        def save(step: int) -> None:
            try:
                ck.save(state_of(mib[rank] * MiB, fill=float(step)), step, StorageType.MEMORY)
                errors[step] = None
            except InsufficientSharedMemoryError as e:
                errors[step] = str(e)

        # a Checkpointer's first save is collective (the directory claim): settled here, so that the saves below
        # come in the order set by the barriers
        ck._saver._claim_dir(1, StorageType.MEMORY)
        if rank == 0:  # its second save takes its second slot, when it may have one
            save(1)
            save(2)
        dist.barrier()
        if rank == 1:
            save(1)
            if errors[1] is None:
                save(2)
        dist.barrier()
        save(3)
        dist.barrier()
        loaded = None
        if phase == "uneven":
            out = ck.load()
            loaded = [ck.last_load.step, ck.last_load.tier.name, float(out["model"]["w"][0])]
        result(phase=phase, rank=rank, errors=errors, shm_used=used_bytes(shm), loaded=loaded)
        pid = ck.persister_pid
        ck.close()
        wait_gone(pid)
        dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "tiny_shm":
        run_tiny_shm(*args)
    elif mode == "one_slot":
        run_one_slot(*args)
    elif mode == "churn":
        run_churn(*args)
    elif mode == "hold":
        run_hold(args[0], args[1], float(args[2]))
    elif mode == "resume":
        run_resume(*args)
    elif mode == "single_slot":
        run_single_slot(*args)
    elif mode == "single_slot_resume":
        run_single_slot_resume(*args)
    elif mode == "fewer_slots":
        run_fewer_slots(*args)
    elif mode == "local_ranks":
        run_local_ranks(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.destroy_process_group()
