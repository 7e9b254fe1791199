"""Worker ranks for tests/test_coordination.py (cases C1, C2, C4-C9 and contract 6).

Usage: ``coord_worker.py SCENARIO CHECKPOINT_DIR [ARGS...]``, launched by ``_harness.launch`` (gloo,
env:// rendezvous). Every scenario prints one ``RESULT {json}`` line per rank; an unexpected exception
prints ``RESULT {"error_type": ..., "error": ...}`` and exits 1.

Environment read here (test plumbing only, never by snapckpt):
- ``COORD_FAKE_LAUNCHER=1``: set wrong launcher variables (``LOCAL_WORLD_SIZE=1``, ``LOCAL_RANK=0`` and
  other launchers' equivalents) on every rank before snapckpt is imported (case C6).
"""
import json
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta

if os.environ.get("COORD_FAKE_LAUNCHER") == "1":
    os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "SLURM_LOCALID": "0",
                       "SLURM_NTASKS_PER_NODE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                       "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MPI_LOCALRANKID": "0", "GROUP_WORLD_SIZE": "1"})

import torch
import torch.distributed as dist

from snapckpt import Checkpointer, StorageType

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30, persister_startup_timeout_secs=60, fsync=False)


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def values(tag: str, step: int, rank: int) -> torch.Tensor:
    """A tensor that names who wrote it: job tag, step and rank are all recoverable from it."""
    base = sum(ord(c) for c in tag) * 1000 + step * 10 + rank
    return torch.arange(256, dtype=torch.float32) + float(base)


def state(tag: str, step: int, rank: int) -> dict:
    return {"w": values(tag, step, rank), "tag": tag, "step": step, "rank": rank}


def check_state(out: dict, tag: str, step: int, rank: int) -> bool:
    return (out["tag"], out["step"], out["rank"]) == (tag, step, rank) and torch.equal(out["w"], values(tag, step, rank))


# ------------------------------------------------------------------------------------------ scenarios
def construct(ckpt: str, rank: int, world: int) -> None:
    """C4/C6/C7: every rank constructs at the same moment; then a save/load round trip on all ranks."""
    import psutil

    dist.barrier()
    ck = Checkpointer(ckpt, **OPTS)
    runtime_root = os.environ["SNAPCKPT_RUNTIME_DIR"]
    ck.save(state("c", 1, rank), 1, StorageType.DISK).wait()
    out = ck.load()
    dist.barrier()  # every rank is connected before anyone counts persisters
    n = sum(1 for p in psutil.process_iter(["cmdline"])
            if "snapckpt.persister" in (p.info["cmdline"] or []) and any(runtime_root in c for c in p.info["cmdline"]))
    result(rank=rank, pid=ck.persister_pid, local_ranks=list(ck.topology.local_ranks),
           local_rank=ck.topology.local_rank, num_nodes=ck.topology.num_nodes, persisters=n,
           loaded_step=ck.last_load.step, loaded_ok=check_state(out, "c", 1, rank),
           env_local_world_size=os.environ.get("LOCAL_WORLD_SIZE"))
    dist.barrier()
    ck.close()


def misuse(ckpt: str, rank: int, world: int) -> None:
    """C5: only rank 0 calls the collective save, latest_step and load; rank 1 waits in a barrier."""
    ck = Checkpointer(ckpt, **{**OPTS, "commit_timeout_secs": 2, "coordination_timeout_secs": 2})
    # Both ranks save once (memory): the first save settles the directory's writer claim, itself a
    # collective step (a first save by rank 0 alone fails there with RankTimeoutError naming rank 1).
    ck.save(state("m", 0, rank), 0, StorageType.MEMORY)
    if rank == 0:
        out = {}
        h = ck.save(state("m", 1, rank), 1, StorageType.DISK)
        for name, call in (("save", h.wait), ("latest_step", ck.latest_step), ("load", ck.load)):
            try:
                call()
                out[name] = {"type": None, "message": ""}
            except Exception as e:
                out[name] = {"type": type(e).__name__, "message": str(e)}
        result(rank=rank, **out, committed=sorted(os.listdir(ckpt)))
    dist.barrier()
    ck.close()
    if rank != 0:
        result(rank=rank)


class CollectiveSpy:
    """Records every torch.distributed collective call: (function name, calling thread name)."""

    NAMES = ("barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_object",
             "all_gather_into_tensor", "broadcast", "broadcast_object_list", "gather", "gather_object",
             "scatter", "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
             "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "new_group")

    def __init__(self) -> None:
        self.calls = []
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return spy


def busy_group(ckpt: str, rank: int, world: int) -> None:
    """C1 / contract 6: collectives on the training group between DISK saves committing in the background."""
    spy = CollectiveSpy()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(ckpt, keep_last=3, **OPTS)
    calls_before = len(spy.calls)
    mine = 0
    pending_at_collective = 0
    sums = []
    for it in range(20):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        h = ck.save({"model": model.state_dict(), "opt": opt.state_dict(), "it": it}, it, StorageType.DISK)
        if not h.done():
            pending_at_collective += 1
        t = torch.tensor([float(rank + 1 + it)])
        dist.all_reduce(t)
        dist.barrier()
        mine += 2
        sums.append(t.item())
    ck.wait()
    latest = ck.latest_step()
    snap_calls = spy.calls[calls_before:]
    result(rank=rank, latest=latest, sums=sums,
           expected=[float(sum(r + 1 + it for r in range(world))) for it in range(20)],
           pending_at_collective=pending_at_collective, collectives=len(snap_calls), mine=mine,
           threads=sorted({t for _, t in spy.calls}), main=threading.main_thread().name)
    dist.barrier()
    ck.close()


def disagree(ckpt: str, rank: int, world: int) -> None:
    """C2: rank 1 sees an empty checkpoint directory (lagging shared filesystem) and holds a newer memory
    step than rank 0; every rank must still make rank 0's decision."""
    from snapckpt.storage.posix import PosixStorage

    ck = Checkpointer(ckpt, **OPTS)
    ck.save(state("d", 10, rank), 10, StorageType.DISK).wait()
    ck.save(state("d", 20, rank), 20, StorageType.MEMORY)
    if rank == 1:
        ck.save(state("d", 30, rank), 30, StorageType.MEMORY)
        real_listdir = PosixStorage.listdir

        def lagging(self, path):  # this rank's view of the shared directory lags: it sees nothing yet
            return [] if os.path.realpath(path) == os.path.realpath(ckpt) else real_listdir(self, path)

        PosixStorage.listdir = lagging
        real_exists = os.path.exists
        os.path.exists = lambda p: False if os.path.realpath(str(p)).startswith(os.path.realpath(ckpt)) \
            else real_exists(p)
    latest = ck.latest_step()
    out = ck.load()
    first = (ck.last_load.step, ck.last_load.tier.value, check_state(out, "d", ck.last_load.step, rank))
    out10 = ck.load(step=10)
    second = (ck.last_load.step, ck.last_load.tier.value, check_state(out10, "d", 10, rank))
    result(rank=rank, latest=latest, load=first, load10=second)
    dist.barrier()
    ck.close()


def job(ckpt: str, rank: int, world: int, tag: str, job_id: str, disk_step: str) -> None:
    """Two jobs on one host: save DISK ``disk_step`` and MEMORY 20, 21 with job-specific values (21 evicts
    the disk step from memory), then load the newest (memory) and ``disk_step`` (disk)."""
    step = int(disk_step)
    ck = Checkpointer(ckpt, job_id=None if job_id == "-" else job_id, **OPTS)
    dist.barrier()
    ck.save({**state(tag, step, rank), "pad": torch.zeros(1 << 18)}, step, StorageType.DISK).wait()
    ck.save(state(tag, 20, rank), 20, StorageType.MEMORY)
    ck.save(state(tag, 21, rank), 21, StorageType.MEMORY)
    out = ck.load()
    mem = (ck.last_load.step, ck.last_load.tier.value, check_state(out, tag, 21, rank))
    out = ck.load(step=step)
    disk = (ck.last_load.step, ck.last_load.tier.value, check_state(out, tag, step, rank))
    result(rank=rank, tag=tag, pid=ck.persister_pid, job=ck.job, mem=mem, disk=disk)
    dist.barrier()
    ck.close()


def die_mid_copy(ckpt: str, rank: int, world: int) -> None:
    """C8/C9 first job: step 10 everywhere (memory and disk); step 20: rank 1 SIGKILLs itself halfway
    through copying into its slot, rank 0 completes it; then the job dies without close()."""
    from snapckpt.engine.stager import Stager

    ck = Checkpointer(ckpt, **{**OPTS, "persister_idle_timeout_secs": 60})
    big = lambda step: {**state("k", step, rank), "layers": [values("k", step, rank) * i for i in range(8)]}
    ck.save(big(10), 10, StorageType.DISK).wait()
    dist.barrier()
    if rank == 1:
        real = Stager.copy_into

        def copy_then_die(prepared, slot, buf, device_done=None):
            for src, off in prepared.copies[: len(prepared.copies) // 2]:
                slot[off:off + src.numel()].copy_(src)
            os.kill(os.getpid(), signal.SIGKILL)
            real(prepared, slot, buf)  # never reached

        Stager.copy_into = staticmethod(copy_then_die)
    ck.save(big(20), 20, StorageType.MEMORY)
    result(rank=rank, pid=ck.persister_pid, saved=20)
    os._exit(0)  # the job is killed: no close(), no barrier


def restart(ckpt: str, rank: int, world: int) -> None:
    """C8/C9 restarted job: report what this rank holds in memory and what load() picked."""
    ck = Checkpointer(ckpt, **OPTS)
    held = sorted(s["step"] for s in ck._request("held")["slots"])
    out = ck.load()
    step = ck.last_load.step
    ok = check_state({k: out[k] for k in ("w", "tag", "step", "rank")}, "k", step, rank) and all(
        torch.equal(t, values("k", step, rank) * i) for i, t in enumerate(out["layers"]))
    result(rank=rank, pid=ck.persister_pid, held=held, step=step, tier=ck.last_load.tier.value, ok=ok)
    dist.barrier()
    ck.close()


def timed_policy(ckpt: str, rank: int, world: int) -> None:
    """A time-based policy on clocks that differ: rank 1 starts its hooks 0.35 s after rank 0; steps take
    0.1 s each (a barrier keeps them in lockstep, as a data-parallel all-reduce does). Reports the steps
    each rank snapshotted."""
    import time

    from snapckpt.engine.hooks import HookRegistry, SnapshotPolicy

    ck = Checkpointer(ckpt, **OPTS)
    dist.barrier()
    if rank == 1:
        time.sleep(0.35)
    hooks = HookRegistry(ck, lambda: {"w": torch.zeros(64)}, SnapshotPolicy(memory_interval_secs=0.5))
    taken = []
    hooks.on("snapshot_taken", lambda e: taken.append(e.step))
    for step in range(1, 21):
        time.sleep(0.1)
        dist.barrier()
        hooks.step_end(step)
    hooks.train_end()
    result(rank=rank, taken=taken)
    dist.barrier()
    ck.close()


SCENARIOS = {"construct": construct, "misuse": misuse, "busy_group": busy_group, "disagree": disagree,
             "job": job, "die_mid_copy": die_mid_copy, "restart": restart,
             "timed_policy": timed_policy}

if __name__ == "__main__":
    scenario, ckpt, *rest = sys.argv[1:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    try:
        SCENARIOS[scenario](ckpt, r, w, *rest)
    except Exception as e:
        traceback.print_exc()
        result(rank=r, error_type=type(e).__name__, error=str(e))
        sys.stdout.flush()
        os._exit(1)
    dist.destroy_process_group()
