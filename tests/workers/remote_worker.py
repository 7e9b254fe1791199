"""Ranks of the remote-tier tests (tests/test_remote_s3.py).

Usage: remote_worker.py MODE CKPT_DIR REMOTE_URL [STEPS] [NBYTES]

- ``save``: save each of STEPS (comma-separated) to DISK with ``remote_dir=REMOTE_URL``, wait for each
  commit, close cleanly; prints ``RESULT {"saved": [...], "events": [...]}``.
- ``load``: a fresh start: ``Checkpointer(CKPT_DIR, remote_dir=REMOTE_URL)``, ``latest_step()``, ``load()``;
  prints ``RESULT {"step", "tier", "equal"}`` (``equal``: the state is bitwise the one ``save`` made).
- ``start``: only construct; prints ``ERROR <type> <message>`` when the constructor raises.
- ``only-save`` (remote-only mode: ``Checkpointer(REMOTE_URL)``, CKPT_DIR unused, ``keep_last=2``): save
  each of STEPS to DISK and wait, then the next step to MEMORY only; print ``RESULT``, then SIGKILL itself
  (a crash: the persister keeps the memory snapshot and flushes it to the store).
- ``only-resume`` (remote-only): ``load()`` (prints its step, tier, equality), then save the first of STEPS
  to DISK and wait (``save_error``: the error type when the persister dies in the middle); exits at once.
- ``only-load`` (remote-only): ``latest_step()``, ``load()``, close cleanly.

The state of rank R at step S is deterministic (seeded by R and S), NBYTES bytes of float32 tensors
(default 64 KiB), so a loader can check it bitwise without a reference file.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from snapckpt import Checkpointer, StorageType


def state(rank: int, step: int, nbytes: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = max(1, nbytes // 4)
    return {"w": torch.randn(n, generator=g), "b": torch.randint(0, 1 << 30, (16,), generator=g),
            "step": step, "note": f"rank {rank} step {step}"}


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def main() -> None:
    mode, ckpt, url = sys.argv[1], sys.argv[2], sys.argv[3]
    steps = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 and sys.argv[4] else []
    nbytes = int(sys.argv[5]) if len(sys.argv) > 5 else 64 << 10
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode.startswith("only-"):
        remote_only(mode, rank, url, steps, nbytes)
        return
    opts = dict(persister_idle_timeout_secs=20, coordination_timeout_secs=60, commit_timeout_secs=60,
                remote_dir=url)
    if mode == "start":
        try:
            ck = Checkpointer(ckpt, **opts)
        except Exception as e:
            print(f"ERROR {type(e).__name__} {e}", flush=True)
            dist.destroy_process_group()
            return
        ck.close()
        print("STARTED", flush=True)
    elif mode == "save":
        events = []
        ck = Checkpointer(ckpt, **opts)
        ck.add_listener(lambda e: events.append([e.kind, e.step]))
        for s in steps:
            ck.save(state(rank, s, nbytes), s, StorageType.DISK).wait()
        ck.close()
        print("RESULT " + json.dumps({"saved": steps, "events": events}), flush=True)
    elif mode == "load":
        ck = Checkpointer(ckpt, **opts)
        latest = ck.latest_step()
        got = ck.load()
        step = ck.last_load.step
        print("RESULT " + json.dumps({"latest": latest, "step": step, "tier": ck.last_load.tier.value,
                                      "equal": equal(got, state(rank, step, nbytes))}), flush=True)
        ck.close()
    dist.destroy_process_group()


def remote_only(mode: str, rank: int, url: str, steps: list, nbytes: int) -> None:
    """The remote-only modes (see the module docstring)."""
    # the persister must outlive a slow relaunch (under load) to serve the memory tier after the crash
    opts = dict(persister_idle_timeout_secs=120, coordination_timeout_secs=60, commit_timeout_secs=60,
                keep_last=2)
    ck = Checkpointer(url, **opts)
    if mode == "only-save":
        for s in steps:
            ck.save(state(rank, s, nbytes), s, StorageType.DISK).wait()
        ck.save(state(rank, steps[-1] + 1, nbytes), steps[-1] + 1, StorageType.MEMORY)
        print("RESULT " + json.dumps({"saved": steps, "latest": ck.latest_step()}), flush=True)
        dist.barrier()  # rank 0 hosts the rendezvous: it must not die while another rank still reads it
        os.kill(os.getpid(), 9)
    got = ck.load()
    res = {"step": ck.last_load.step, "tier": ck.last_load.tier.value,
           "equal": equal(got, state(rank, ck.last_load.step, nbytes))}
    if mode == "only-resume":
        try:
            ck.save(state(rank, steps[0], nbytes), steps[0], StorageType.DISK).wait(timeout=60)
            res["save_error"] = None
        except Exception as e:
            res["save_error"] = type(e).__name__
        print("RESULT " + json.dumps(res), flush=True)
        dist.barrier()
        os._exit(0)  # the persister is gone: nothing to close
    print("RESULT " + json.dumps(res), flush=True)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
