"""Worker ranks for tests/test_skip_collective.py (``launch`` on one node, or torchrun on every node of the rig):
a DISK save skipped on one rank (``on_slot_busy="skip"``, one slot per rank, that slot held busy) must be
skipped on every rank.

``skip_worker.py SCENARIO DIR SIGNALS SKIPPER ORDER``. Every rank saves ``s1`` (step 1) first; the test holds the
part of rank ``SKIPPER`` in the persister (fault point ``persist.mid_file`` at step 1, released by the file
``SIGNALS/release``, which the skipper writes once it has skipped), so the skipper's only slot stays busy and its
next save is skipped. ``ORDER``: ``first``, the skipper skips before the other ranks save (and, in ``resave``,
saves again before they save at all); ``last``, the other ranks hand their snapshot over first.

- ``step``: step 2 (``s2``) is the save skipped; then step 3 (``s3``) on every rank.
- ``resave``: step 7 saved twice under the tag ``best`` (tracker ``latest``): the skipper skips the first save
  only.

Files: ``rank<R>.pt`` = ``{"w": full(4096, 100 * save + rank)}`` (save: 1, 2, 3; ``resave``: 71 and 72 for the two
saves of step 7). Each rank prints ``RESULT {"rank", "outcomes": {save: outcome}, "skipped": [reasons],
"failed": [...]}``, an outcome being ``committed``, ``skipped: <reason>`` or ``<error type>: <message>``.
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from snapckpt import Checkpointer, StorageType

# one slot per rank; only the skipper skips (another rank whose own slot is still being written waits for it)
OPTS = dict(slots_per_rank=1, persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=60,
            coordination_timeout_secs=120)


def _files(rank: int, save: int) -> dict:
    return {f"rank{rank}.pt": {"w": torch.full((4096,), float(100 * save + rank))}}


def _wait_for(path: str, secs: float = 120.0) -> None:
    deadline = time.monotonic() + secs
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _signal(path: str) -> None:
    open(path, "w").close()


def _outcome(h) -> str:
    try:
        h.wait()
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:400]
    if h.skipped:
        return f"skipped: {h.skipped_reason}"
    return "committed" if h.committed else "not committed"


def main(scenario: str, d: str, signals: str, skipper: str, order: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank, skips = dist.get_rank(), dist.get_rank() == int(skipper)
    events = []
    out = {}
    with Checkpointer(d, on_slot_busy="skip" if skips else "wait", **OPTS) as ck:
        ck.add_listener(events.append)

        def save(save_no: int, step: int, dirname: str):
            return ck.save_files(_files(rank, save_no), step, StorageType.DISK, dirname=dirname,
                                 tracker_name="latest", tracker_content=dirname)

        h1 = save(1, 1, "s1")  # the skipper's part is held in the persister: its slot stays busy
        if scenario == "step":
            if not skips and order == "first":
                _wait_for(os.path.join(signals, "skipped"))
            if skips and order == "last":
                _wait_for(os.path.join(signals, "handed"))
            h2 = save(2, 2, "s2")
            if skips:
                assert h2.skipped, "the skipper's slot was free"
                _signal(os.path.join(signals, "skipped"))
                _signal(os.path.join(signals, "release"))
            else:
                _signal(os.path.join(signals, "handed"))
            out["2"] = _outcome(h2)
            out["1"] = _outcome(h1)
            out["3"] = _outcome(save(3, 3, "s3"))
        elif scenario == "resave":
            if skips:
                if order == "last":
                    _wait_for(os.path.join(signals, "handed"))
                b1 = save(71, 7, "best")
                assert b1.skipped, "the skipper's slot was free"
                _signal(os.path.join(signals, "release"))
                out["1"] = _outcome(h1)  # its slot is free once its part of step 1 is written
                b2 = save(72, 7, "best")
                _signal(os.path.join(signals, "saved_again"))
            else:
                if order == "first":  # its first save of step 7 reaches the persister after the skipper's second
                    _wait_for(os.path.join(signals, "saved_again"))
                b1 = save(71, 7, "best")
                _signal(os.path.join(signals, "handed"))
                out["1"] = _outcome(h1)
                out["71"] = _outcome(b1)
                b2 = save(72, 7, "best")
            out.setdefault("71", _outcome(b1))
            out["72"] = _outcome(b2)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        dist.barrier()
    print("RESULT " + json.dumps({"rank": rank, "outcomes": out,
                                  "skipped": [e.reason for e in events if e.kind == "skipped"],
                                  "failed": [f"{e.step}: {e.error}" for e in events if e.kind == "failed"]}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
