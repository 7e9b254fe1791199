"""Worker ranks for tests/test_load_resave_race.py: another job loads a step while the job that owns the checkpoint
directory commits that step again (a save after a rewind swaps a new copy of ``step_N`` into place).

Usage: ``resave_race_worker.py save DIR GEN STEP...`` saves each step to DISK with values of generation ``GEN``;
``resave_race_worker.py load DIR NEW_COPY MARKER plain|into`` loads the newest step while rank 1, just before it
reads the manifest of ``step_00000002``, waits for rank 0 to have read its files of that step and then swaps the
directory for ``NEW_COPY`` (another copy of the step). Each rank prints ``RESULT {json}``.
"""
import json
import os
import shutil
import sys
import time

import torch

from snapckpt import Checkpointer
from snapckpt.engine import loader as loader_mod
from snapckpt.engine.loader import Loader
from snapckpt.ondisk.manifest import MANIFEST

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=60)
RACED = "step_00000002"


def value(step: int, rank: int, gen: int) -> float:
    return float(gen * 10000 + step * 100 + rank)


def make_state(step: int, rank: int, gen: int) -> dict:
    return {"w": torch.full((1024,), value(step, rank, gen)), "step": step, "rank": rank, "gen": gen}


def init_dist() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank()


def save(d: str, gen: str, *steps: str) -> None:
    rank = init_dist()
    with Checkpointer(d, **OPTS) as ck:
        for step in map(int, steps):
            ck.save(make_state(step, rank, int(gen)), step).wait()


def swap(d: str, new_copy: str, marker: str) -> None:
    """Wait until rank 0 read the raced step (``marker``), then commit ``new_copy`` in its place as the owner's
    commit does (old copy renamed aside, the new one renamed in)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    tmp = os.path.join(d, f".{RACED}.incoming")
    shutil.copytree(new_copy, tmp)
    os.rename(os.path.join(d, RACED), os.path.join(d, f".{RACED}.replaced-other"))
    os.rename(tmp, os.path.join(d, RACED))


def mark_after_read(marker: str) -> None:
    """Rank 0: leave ``marker`` once its read of the raced step is over (the loader's ``read`` or ``read_into``)."""
    for name in ("read", "read_into"):
        real = getattr(Loader, name)

        def after(self, cand, *a, _real=real, **kw):
            try:
                return _real(self, cand, *a, **kw)
            finally:
                if cand.dirname == RACED and not os.path.exists(marker):
                    open(marker, "w").close()

        setattr(Loader, name, after)


def report(rank: int, ck: Checkpointer, out: dict) -> None:
    """The ``RESULT`` line of a rank's load: its step, generation, first value, whether every value is that one."""
    w = float(out["w"][0])
    print("RESULT " + json.dumps({"rank": rank, "step": ck.last_load.step, "gen": out["gen"], "w": w,
                                  "whole": bool((out["w"] == w).all()), "skipped": list(ck.last_load.skipped)}),
          flush=True)


def _hooks(rank: int, d: str, new_copy: str, marker: str) -> None:
    if rank == 0:  # after its own read of the raced step: let rank 1 swap the directory
        mark_after_read(marker)
        return
    real_parse = loader_mod.parse_manifest
    swapped = []

    def parse(data, dirname, *a, **kw):
        if dirname == RACED and not swapped:  # the owner's re-commit lands between rank 0's read and this one
            swap(d, new_copy, marker)
            swapped.append(True)
            with open(os.path.join(d, RACED, MANIFEST), "rb") as f:
                data = f.read()
        return real_parse(data, dirname, *a, **kw)

    loader_mod.parse_manifest = parse


def load(d: str, new_copy: str, marker: str, how: str) -> None:
    rank = init_dist()
    _hooks(rank, d, new_copy, marker)
    with Checkpointer(d, **OPTS) as ck:
        if how == "into":
            out = make_state(0, rank, 9)
            ck.load(out)
        else:
            out = ck.load()
        report(rank, ck, out)


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](*sys.argv[2:])
