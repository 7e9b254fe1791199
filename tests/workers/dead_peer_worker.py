"""Dead peers on one node: a rank's process is killed (``kill -9``, by the test) while a commit waits.

Modes (argv: mode, checkpoint dir, signal dir; every rank commits step 1 to DISK first):

- ``never_saves``: rank 1 writes ``<signal dir>/victim`` (its pid) and sleeps (the test kills it); the
  other ranks save step 2 to DISK, write ``<signal dir>/saved-<rank>`` and wait for the commit, then save
  step 3 and wait, then close. Each prints ``RESULT {"wait2", "wait3", "close"}``: the error type and
  message of each (or ``"ok"``) and the seconds each took.
- ``handed_over``: every rank saves step 2 to DISK (the test slows the persister's writes); rank 1 then
  writes ``victim`` and sleeps (killed with its part in flight); the others wait for the commit and print
  ``RESULT {"wait2", ...}``: the persister writes the dead rank's part from memory, the commit succeeds.
- ``node_lost`` (two nodes of two ranks under torchrun, on the multi-node rig; argv[4]: the held ranks,
  ``R,R``): after step 1 is committed, the held ranks write ``held-<rank>`` (their pid) and sleep (the
  test kills them, or loses their node whole); the other ranks save step 2 to DISK, write
  ``saved-<rank>``, wait for the commit and close: ``RESULT {"rank", "host", "wait2", "close"}``
  (``peer_timeout_secs=3``).
- ``resume``: every rank loads (printing the step), saves step 2 to DISK, waits, closes:
  ``RESULT {"loaded", "wait2"}``.
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

VICTIM = 1
OPTS = dict(commit_timeout_secs=600, persister_idle_timeout_secs=3, request_timeout_secs=60,
            coordination_timeout_secs=60, fsync=False)


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        out = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    return out, round(time.monotonic() - t0, 3)


def _signal(sig_dir: str, name: str, text: str = "") -> None:
    with open(os.path.join(sig_dir, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(sig_dir, name + ".tmp"), os.path.join(sig_dir, name))


def _state(rank: int, step: int):
    return {"w": torch.full((256,), float(rank * 100 + step)), "step": step}


def victim_waits(sig_dir: str) -> None:
    _signal(sig_dir, "victim", str(os.getpid()))
    time.sleep(600)  # killed by the test
    sys.exit(3)


def never_saves(ckpt: str, sig_dir: str) -> None:
    from snapckpt import Checkpointer, StorageType

    rank = dist.get_rank()
    ck = Checkpointer(ckpt, **OPTS)
    ck.save(_state(rank, 1), 1, StorageType.DISK).wait()
    dist.barrier()
    if rank == VICTIM:
        victim_waits(sig_dir)
    h = ck.save(_state(rank, 2), 2, StorageType.DISK)
    _signal(sig_dir, f"saved-{rank}")
    wait2 = _timed(h.wait)
    wait3 = _timed(lambda: ck.save(_state(rank, 3), 3, StorageType.DISK).wait())  # the job goes on
    close = _timed(ck.close)
    print("RESULT " + json.dumps({"wait2": wait2, "wait3": wait3, "close": close}), flush=True)


def handed_over(ckpt: str, sig_dir: str) -> None:
    from snapckpt import Checkpointer, StorageType

    rank = dist.get_rank()
    ck = Checkpointer(ckpt, **OPTS)
    ck.save(_state(rank, 1), 1, StorageType.DISK).wait()
    dist.barrier()
    h = ck.save(_state(rank, 2), 2, StorageType.DISK)  # handed to the persister when save() returns
    if rank == VICTIM:
        victim_waits(sig_dir)
    wait2 = _timed(h.wait)
    close = _timed(ck.close)
    print("RESULT " + json.dumps({"wait2": wait2, "close": close}), flush=True)


def node_lost(ckpt: str, sig_dir: str) -> None:
    import socket

    from snapckpt import Checkpointer, StorageType

    rank, held = dist.get_rank(), {int(r) for r in sys.argv[4].split(",")}
    ck = Checkpointer(ckpt, **{**OPTS, "peer_timeout_secs": 3})
    assert ck.topology.num_nodes == 2, ck.topology
    ck.save(_state(rank, 1), 1, StorageType.DISK).wait()
    dist.barrier()
    if rank in held:
        _signal(sig_dir, f"held-{rank}", str(os.getpid()))
        time.sleep(600)  # killed, or lost with its node
        sys.exit(3)
    h = ck.save(_state(rank, 2), 2, StorageType.DISK)
    _signal(sig_dir, f"saved-{rank}")
    wait2 = _timed(h.wait)
    close = _timed(ck.close)
    print("RESULT " + json.dumps({"rank": rank, "host": socket.gethostname(), "wait2": wait2, "close": close}),
          flush=True)


def resume(ckpt: str, sig_dir: str) -> None:
    from snapckpt import Checkpointer, StorageType

    rank = dist.get_rank()
    with Checkpointer(ckpt, **OPTS) as ck:
        state = ck.load()
        loaded = [ck.last_load.step, ck.last_load.tier.value, state["w"][0].item()]
        wait2 = _timed(lambda: ck.save(_state(rank, 2), 2, StorageType.DISK).wait())
    print("RESULT " + json.dumps({"loaded": loaded, "wait2": wait2}), flush=True)


if __name__ == "__main__":
    mode, ckpt_dir, sig = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    {"never_saves": never_saves, "handed_over": handed_over, "node_lost": node_lost, "resume": resume}[mode](ckpt_dir, sig)
    if mode == "resume":
        dist.destroy_process_group()
    # after a peer died, no collective (destroy included) is made: the survivors just exit
