"""Worker ranks for tests/test_commit_crash.py (cases B1, B2, B8, B9, C5, C8 and the kill tests).

Usage: ``commit_crash_worker.py SCENARIO CHECKPOINT_DIR [ARGS...]``. Multi-rank scenarios are launched by
``_harness.launch`` (gloo, env:// rendezvous); ``slow_disk``, ``hung_then_exit`` and ``save_loop`` run as one
process without a process group. Each rank prints ``SAVED <step>`` lines when a snapshot was taken (so the test knows
when to kill) and ``RESULT {json}`` lines with what it observed.

State written at ``step`` by ``rank``: every tensor is filled with ``step * 100 + rank``, so a torn or
mixed-step checkpoint is visible in any single element (:func:`consistent`).
"""
import dataclasses
import json
import os
import signal
import sys
import time

import torch

from snapckpt import Checkpointer, StorageType

# idle 120 s: under load, a torchrun restart can take longer than 30 s, and the persister must still hold memory
OPTS = dict(persister_idle_timeout_secs=120, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30, persister_startup_timeout_secs=60)


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def saved(step: int) -> None:
    print(f"SAVED {step}", flush=True)


def value(step: int, rank: int) -> float:
    return float(step * 100 + rank)


def make_state(step: int, rank: int, n_small: int = 0, big_numel: int = 0) -> dict:
    """``{"big"?, "w", "s000".., "step", "rank"}``; ``big`` comes first so that it is written first."""
    v = value(step, rank)
    st = {}
    if big_numel:
        st["big"] = torch.full((big_numel,), v)
    st["w"] = torch.full((256,), v)
    for i in range(n_small):
        st[f"s{i:03d}"] = torch.full((16,), v)
    st["step"], st["rank"] = step, rank
    return st


def consistent(out: dict, rank: int) -> bool:
    """Every tensor of a loaded state holds the value of the step and rank the state claims."""
    v = value(out["step"], out["rank"])
    return out["rank"] == rank and all(bool((t == v).all()) for t in out.values() if isinstance(t, torch.Tensor))


def init_dist():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist, dist.get_rank()


def kill_in_copy(d: str) -> None:
    """Kill test (a), case C8: rank 1 SIGKILLs itself halfway through copying step 2 into its slot."""
    dist, rank = init_dist()
    ck = Checkpointer(d, **{**OPTS, "coordination_timeout_secs": 10})
    ck.save(make_state(1, rank), 1, StorageType.MEMORY)
    saved(1)
    dist.barrier()
    if rank == 1:
        from snapckpt.engine.stager import Stager

        def copy_half_then_die(prepared, slot, buf, device_done=None):
            src, off = prepared.copies[0]
            half = src.numel() // 2
            slot[off:off + half].copy_(src[:half])
            print("DYING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        Stager.copy_into = staticmethod(copy_half_then_die)
    ck.save(make_state(2, rank), 2, StorageType.MEMORY)
    saved(2)
    # Rank 0 survives: a collective call now must name the dead rank within the bound, never hang.
    ck.options = dataclasses.replace(ck.options, coordination_timeout_secs=1.5)
    try:
        ck.load()
        result(rank=rank, error_type=None, error="")
    except Exception as e:
        result(rank=rank, error_type=type(e).__name__, error=str(e))
    ck.close()
    os._exit(0)  # the peer is dead: skip the process group's teardown


def crash_after_save(d: str, flush: str, tier2: str, n_small: str) -> None:
    """Kill test (c), cases B1/B8: commit step 1, snapshot step 2, then wait to be SIGKILLed."""
    dist, rank = init_dist()
    ck = Checkpointer(d, keep_last=1, flush_on_crash=flush == "1", **OPTS)
    ck.save(make_state(1, rank), 1).wait()
    dist.barrier()
    ck.save(make_state(2, rank, n_small=int(n_small)), 2, StorageType(tier2))
    saved(2)
    time.sleep(600)


def load(d: str) -> None:
    """A restarted job: load the newest step, report what came back and from which tier."""
    dist, rank = init_dist()
    with Checkpointer(d, **OPTS) as ck:
        out = ck.load()
        result(rank=rank, step=ck.last_load.step, tier=ck.last_load.tier.value, state_step=out["step"],
               consistent=consistent(out, rank))


def save_steps(d: str, *steps: str) -> None:
    """A job that saves ``steps`` to DISK and exits (a checkpoint directory of this world size)."""
    dist, rank = init_dist()
    with Checkpointer(d, **OPTS) as ck:
        for step in map(int, steps):
            ck.save(make_state(step, rank), step).wait()
    result(rank=rank, saved=list(map(int, steps)))


def parts(d: str) -> None:
    """Case B9 / C5: an extra rank's part marker, a rank that does not save, an empty shard."""
    dist, rank = init_dist()
    ck = Checkpointer(d, **{**OPTS, "commit_timeout_secs": 5})
    if rank == 0:  # a stray process of an unexpected rank 5 writes its part marker for step 1
        side = os.path.join(d, f".step_00000001.partial-{ck.run_id}", ".snapckpt")
        os.makedirs(side, exist_ok=True)
        with open(os.path.join(side, "part_00005.json"), "w") as f:
            json.dump({"rank": 5, "run_id": ck.run_id, "step": 1, "files": {}}, f)
    dist.barrier()
    out = {"rank": rank}
    try:
        ck.save(make_state(1, rank), 1).wait()
        out["step1"] = None
    except Exception as e:
        out["step1"] = [type(e).__name__, str(e)]
    dist.barrier()
    if rank == 0:  # misuse: only rank 0 calls the collective save of step 2
        try:
            ck.save(make_state(2, rank), 2).wait()
            out["step2"] = None
        except Exception as e:
            out["step2"] = [type(e).__name__, str(e)]
    dist.barrier()
    ck.save({} if rank == 1 else make_state(3, rank), 3).wait()  # rank 1's shard is empty
    out["step3_loaded"] = ck.load(step=3)
    out["step3_loaded"] = {k: v for k, v in out["step3_loaded"].items() if not isinstance(v, torch.Tensor)}
    result(**out)
    ck.close()


def slow_disk(d: str, n_small: str) -> None:
    """Case B2 (one process): commit step 1, then snapshot a big step 2 and wait to be SIGKILLed."""
    ck = Checkpointer(d, **OPTS)
    ck.save(make_state(1, 0), 1).wait()
    ck.save(make_state(2, 0, n_small=int(n_small), big_numel=3 << 20), 2)  # 12 MiB, past the write buffer
    saved(2)
    time.sleep(600)


def hung_then_exit(d: str) -> None:
    """Case B5, the rank dies (one process): commit step 1, snapshot step 2 in memory, SIGSTOP the persister;
    the next save times out (the client gives the request up with ``abandon``) and the process exits
    without close()."""
    ck = Checkpointer(d, **{**OPTS, "request_timeout_secs": 2})
    ck.save(make_state(1, 0), 1).wait()
    ck.save(make_state(2, 0), 2, StorageType.MEMORY).wait()
    os.kill(ck.persister_pid, signal.SIGSTOP)
    print(f"STOPPED {ck.persister_pid}", flush=True)
    try:
        ck.save(make_state(3, 0), 3, StorageType.MEMORY)
        result(error_type=None)
    except Exception as e:
        result(error_type=type(e).__name__)
    os._exit(1)


def save_loop(d: str) -> None:
    """Kill test (a), loop form (one process): MEMORY snapshots of a 16 MiB state until SIGKILLed."""
    ck = Checkpointer(d, **OPTS)
    step = 0
    while True:
        step += 1
        v = value(step, 0)
        ck.save({"a": torch.full((2 << 20,), v), "b": torch.full((2 << 20,), v),
                 "step": step, "rank": 0}, step, StorageType.MEMORY)
        saved(step)


def full_disk_one_rank(d: str) -> None:
    """B4 across ranks: the node persister gets a 512 KiB file-size limit; rank 1's part (4 MiB) fails with
    EFBIG while rank 0's (tiny) fits. Each rank reports what ``wait()`` raised and after how long (the
    test checks the type and cause, never the time), then whether a small save still commits."""
    import resource

    import torch.distributed as dist

    init_dist()
    rank = dist.get_rank()
    ck = Checkpointer(d, **dict(OPTS, commit_timeout_secs=120))
    ck.save(make_state(1, rank), 1).wait()
    numel = (1 << 20) if rank == 1 else 0
    ck.save(make_state(2, rank, big_numel=numel), 2, StorageType.MEMORY)  # size both arena slots before
    ck.save(make_state(3, rank, big_numel=numel), 3, StorageType.MEMORY)  # the limit
    dist.barrier()
    if rank == 0:
        resource.prlimit(ck.persister_pid, resource.RLIMIT_FSIZE, (512 << 10, resource.RLIM_INFINITY))
    dist.barrier()
    t0 = time.monotonic()
    try:
        ck.save(make_state(4, rank, big_numel=numel), 4).wait()
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    dist.barrier()
    if rank == 0:
        resource.prlimit(ck.persister_pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    ck.save(make_state(5, rank), 5).wait()
    result(rank=rank, error=err, secs=took, latest=ck.latest_step(),
           partials=[n for n in os.listdir(d) if ".partial-" in n])
    ck.close()
    dist.destroy_process_group()


def preflight_fail_one_rank(d: str) -> None:
    """B4/contract 7 across ranks: rank 0's free-space preflight refuses step 2 (fault injection: it sees
    0 bytes free), rank 1's tiny part is accepted. Each rank reports what its save / wait raised."""
    import torch.distributed as dist

    init_dist()
    rank = dist.get_rank()
    ck = Checkpointer(d, **dict(OPTS, commit_timeout_secs=120))
    ck.save(make_state(1, rank), 1).wait()
    real = ck.storage.free_bytes
    if rank == 0:
        ck.storage.free_bytes = lambda path: 0
    try:
        ck.save(make_state(2, rank), 2).wait()
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    ck.storage.free_bytes = real
    dist.barrier()
    ck.save(make_state(3, rank), 3).wait()
    result(rank=rank, error=err, latest=ck.latest_step(), partials=[n for n in os.listdir(d) if ".partial-" in n])
    ck.close()
    dist.destroy_process_group()


def resave_tag_after_failure(d: str, go: str) -> None:
    """A fixed tag saved again as soon as its save failed: each rank saves ``best`` at step 1 (the test holds
    rank 1's part, then makes rank 0's fail: rank 0 saves once the file ``go`` exists), then at once at step 2;
    each reports what each ``wait()`` raised."""
    init_dist()
    import torch.distributed as dist

    rank = dist.get_rank()
    ck = Checkpointer(d, **OPTS)
    ck.save_files({f"warm{rank}.pt": {"w": torch.ones(1)}}, 0, StorageType.DISK, dirname="warm",
                  tracker_name=None).wait()  # (the first save's collective claim of the directory)
    errors = {}
    for step in (1, 2):
        while step == 1 and rank == 0 and not os.path.exists(go):
            time.sleep(0.02)
        files = {f"rank{rank}.pt": {"w": torch.full((1 << 16,), value(step, rank))}}
        try:
            ck.save_files(files, step, StorageType.DISK, dirname="best", tracker_name=None).wait()
            errors[step] = None
        except Exception as e:
            errors[step] = f"{type(e).__name__}: {e}"
    result(rank=rank, errors=errors)
    ck.close()
    dist.destroy_process_group()


def preflight_fail_then_retry(d: str, mode: str) -> None:
    """Rank 0's free-space preflight refuses step 2 (fault injection: it sees 0 bytes free). ``mode``
    ``refused``: rank 1 saved step 2 a moment before (its part is written); then step 2 is saved again, and
    rank 0's preflight refuses it again before rank 1's part comes. ``room``: rank 1 saves step 2 a moment later
    (its part comes once that save failed); then step 2 is saved again, rank 1 first, and rank 0 has room. Each rank reports what each ``wait()`` raised and the seconds it took."""
    import torch.distributed as dist

    init_dist()
    rank = dist.get_rank()
    ck = Checkpointer(d, **dict(OPTS, commit_timeout_secs=40))
    ck.save(make_state(1, rank), 1).wait()
    real = ck.storage.free_bytes
    errors, secs = {}, {}
    for attempt in ("first", "retry"):
        refused = rank == 0 and (attempt == "first" or mode == "refused")
        if refused:
            ck.storage.free_bytes = lambda path: 0
        if rank == {"first": 0 if mode == "refused" else 1, "retry": 1 if mode == "refused" else 0}[attempt]:
            time.sleep(1.0)  # (the other rank's request first)
        t0 = time.monotonic()
        try:
            ck.save(make_state(2, rank), 2).wait()
            errors[attempt] = None
        except Exception as e:
            errors[attempt] = f"{type(e).__name__}: {e}"
        secs[attempt] = round(time.monotonic() - t0, 3)
        ck.storage.free_bytes = real
        dist.barrier()
    result(rank=rank, errors=errors, secs=secs, latest=ck.latest_step())
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    scenario, *rest = sys.argv[1:]
    {"kill_in_copy": kill_in_copy, "crash_after_save": crash_after_save, "load": load, "parts": parts, "save_steps": save_steps,
     "slow_disk": slow_disk, "hung_then_exit": hung_then_exit, "save_loop": save_loop,
     "full_disk_one_rank": full_disk_one_rank, "preflight_fail_one_rank": preflight_fail_one_rank,
     "resave_tag_after_failure": resave_tag_after_failure, "preflight_fail_then_retry": preflight_fail_then_retry}[scenario](*rest)
