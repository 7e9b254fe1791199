"""Ranks of the remote-tier tests (tests/test_remote_s3.py).

Usage: remote_worker.py MODE CKPT_DIR REMOTE_URL [STEPS] [NBYTES]

- ``save``: save each of STEPS (comma-separated) to DISK with ``remote_dir=REMOTE_URL``, wait for each
  commit, close cleanly; prints ``RESULT {"saved": [...], "events": [...]}``.
- ``load``: a fresh start: ``Checkpointer(CKPT_DIR, remote_dir=REMOTE_URL)``, ``latest_step()``, ``load()``;
  prints ``RESULT {"step", "tier", "equal"}`` (``equal``: the state is bitwise the one ``save`` made).
- ``start``: only construct; prints ``ERROR <type> <message>`` when the constructor raises.

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


if __name__ == "__main__":
    main()
