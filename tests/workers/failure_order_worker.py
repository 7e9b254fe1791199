"""Failures in order, on one node: one rank fails first, the others die of the collective error.

``crash``: every rank trains 4 steps (a gloo all-reduce per step), saves step 2 to DISK and step 4 to
MEMORY inside ``with Checkpointer(...)``; then rank ``FIRST`` raises (it leaves the ``with`` block through
``close()`` during the exception) while the other ranks block in the next all-reduce and die of the
collective error (they leave the same way). ``resume``: every rank loads and prints
``RESULT {"step", "tier", "w"}``. ``interrupted_close``: a Ctrl-C while the clean close waits for a commit.
"""
import json
import os
import signal
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

FIRST = 1


def crash(ckpt_dir: str) -> None:
    from snapckpt import Checkpointer, StorageType

    state = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(ckpt_dir) as ck:
        for step in range(1, 5):
            dist.all_reduce(torch.ones(1))  # the training step's collective
            state["w"] += 1
            state["step"] = step
            if step == 2:
                ck.save(state, step, StorageType.DISK).wait()
            elif step == 4:
                ck.save(state, step, StorageType.MEMORY)
        print("SAVED", flush=True)
        if dist.get_rank() == FIRST:
            raise RuntimeError(f"rank {FIRST} fails first (a bug, an OOM...)")
        dist.all_reduce(torch.ones(1))  # its peer is gone: this raises (gloo: connection closed)


def interrupted_close(ckpt_dir: str) -> None:
    """Step 2 to DISK (its commit slowed by the persister), step 4 to MEMORY, then a normal end: the clean
    close waits for step 2's commit and a Ctrl-C (SIGINT) arrives during that wait."""
    from snapckpt import Checkpointer, StorageType

    # A Ctrl-C raises KeyboardInterrupt even where this process inherited SIGINT ignored (a launcher started
    # in the background of a non-interactive shell, as a CI script's `cmd &`: Python keeps SIG_IGN then).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    state = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(ckpt_dir) as ck:
        for step in range(1, 5):
            dist.all_reduce(torch.ones(1))
            state["w"] += 1
            state["step"] = step
            if step in (2, 4):
                ck.save(state, step, StorageType.DISK if step == 2 else StorageType.MEMORY)
        print("SAVED", flush=True)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    print("CLOSED", flush=True)  # not reached: the KeyboardInterrupt leaves through close()


def persister_killed(ckpt_dir: str) -> None:
    """Step 1 to DISK; rank 0 SIGKILLs the persister; every rank's next call starts a new one, rank 1's
    first (rank 0 waits 2 s): step 2 to DISK must commit. Prints ``RESULT {"committed": [steps]}``."""
    from snapckpt import Checkpointer
    from snapckpt.errors import PersisterDiedError

    with Checkpointer(ckpt_dir, persister_idle_timeout_secs=5) as ck:
        ck.save({"w": torch.ones(4)}, 1).wait()
        dist.barrier()
        if dist.get_rank() == 0:
            os.kill(ck.persister_pid, signal.SIGKILL)
        dist.barrier()
        if dist.get_rank() == 0:
            threading.Event().wait(2.0)  # rank 1 reaches the new persister first
        try:
            ck.save({"w": torch.full((4,), 2.0)}, 2)
        except PersisterDiedError:  # raised once, by the first call after the death
            ck.save({"w": torch.full((4,), 2.0)}, 2)
        ck.wait(timeout=60)
        print("RESULT " + json.dumps({"latest": ck.latest_step()}), flush=True)


def resume(ckpt_dir: str) -> None:
    from snapckpt import Checkpointer

    with Checkpointer(ckpt_dir) as ck:
        state = ck.load()
        info = ck.last_load
        print("RESULT " + json.dumps({"step": info.step, "tier": info.tier.value, "w": state["w"].tolist()}),
              flush=True)


if __name__ == "__main__":
    mode, ckpt_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    {"crash": crash, "interrupted_close": interrupted_close, "resume": resume,
     "persister_killed": persister_killed}[mode](ckpt_dir)
    dist.destroy_process_group()
