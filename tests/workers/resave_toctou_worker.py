"""Worker ranks for tests/test_load_resave_toctou.py: another job loads a step while the job that owns the checkpoint
directory commits that step again (a save after a rewind swaps a new copy of ``step_N`` into place), the swap
landing on rank 1 AFTER it read (and checked) the manifest of the copy every rank agreed on and BEFORE it opened its
files: the manifest check of ``test_load_resave_race.py`` passes, the files are the new copy's.

Usage: ``resave_toctou_worker.py save DIR GEN STEP...`` saves each step to DISK with values of generation ``GEN``;
``resave_toctou_worker.py load DIR NEW_COPY MARKER HOW VERIFY`` loads the newest step (``HOW``: ``plain``
``load()``, ``into`` ``load(state)``, ``path`` ``load_with(fn, check=lambda c: c.verify())`` with ``fn`` reading
the rank's file by path as a framework's own loader does; ``VERIFY``: ``verify_checksums`` 1 or 0). Rank 0 reads
the raced step first and leaves ``MARKER``; rank 1 then swaps the directory for ``NEW_COPY`` between its manifest
read and its file reads. Each rank prints ``RESULT {json}``.
"""
import os
import sys

import torch

from snapckpt import Checkpointer
from snapckpt.engine import disk_restore
from snapckpt.engine import loader as loader_mod
from snapckpt.ondisk import layout

from resave_race_worker import (OPTS, RACED, init_dist, make_state, mark_after_read, report,  # noqa: F401
                                save, swap)  # save: the CLI verb


def _hooks(rank: int, d: str, new_copy: str, marker: str, how: str) -> None:
    swapped = []

    def once() -> None:
        if not swapped:
            swapped.append(True)
            swap(d, new_copy, marker)

    if rank == 0:  # after its own read of the raced step: let rank 1 swap the directory
        mark_after_read(marker)
        return
    if how == "plain":  # after the manifest and this rank's files were checked, before torch.load opens them
        for name in ("check_checksums", "check_sizes"):
            real = getattr(loader_mod, name)

            def checked(storage, path, *a, _real=real, **kw):
                out = _real(storage, path, *a, **kw)
                if os.path.basename(path) == RACED:
                    once()
                return out

            setattr(loader_mod, name, checked)
    elif how == "into":  # after the manifest was read, before the file is opened and read into the live tensors
        real_into = disk_restore.read_into

        def into(path, *a, **kw):
            if os.path.basename(os.path.dirname(path)) == RACED:
                once()
            return real_into(path, *a, **kw)

        disk_restore.read_into = into


def load(d: str, new_copy: str, marker: str, how: str, verify: str) -> None:
    rank = init_dist()
    _hooks(rank, d, new_copy, marker, how)
    with Checkpointer(d, verify_checksums=verify == "1", **OPTS) as ck:
        if how == "into":
            out = make_state(0, rank, 9)
            ck.load(out)
        elif how == "plain":
            out = ck.load()
        else:
            def fn(c):  # a framework's own loader: reads the verified directory by path
                if c.dirname == RACED:
                    if rank == 1:
                        swap(d, new_copy, marker)
                path = os.path.join(c.path, layout.rank_filename(rank))
                try:
                    return torch.load(path, weights_only=False)
                finally:
                    if rank == 0 and c.dirname == RACED:
                        open(marker, "w").close()

            out, _ = ck.load_with(fn, check=lambda c: c.verify())
        report(rank, ck, out)


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](*sys.argv[2:])
