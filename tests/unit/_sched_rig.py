"""A node's scheduler with real writer and commit tasks on threads and the slot reads stubbed, shared by the
scheduler tests (test_resave_after_failure.py, test_skip_records.py): the slot of step ``s`` holds ``NBYTES``
bytes of value ``s``, its index one file ``rank<R>.bin`` (the slot's ``path`` names the rank); :func:`write_part`
writes such a part in its partial directory as a writer leaves it."""
from __future__ import annotations

import json
import os
import threading
from typing import Optional, Tuple

from snapckpt.ondisk.manifest import CHECKSUM, SIDECAR, ChecksumWriter, partial_dirname
from snapckpt.persister import scheduler as sched_mod
from snapckpt.persister.scheduler import Scheduler
from snapckpt.persister.slots import Run, SlotTable

NBYTES = 64


def stub_slot_reads(monkeypatch) -> None:
    """Replace the writer task's slot map and index reads (see the module)."""
    def index(buf, path):
        return {"step": buf[0], "files": [{"path": f"{os.path.basename(path)}.bin", "kind": "bytes",
                                           "chunks": [[0, NBYTES]]}]}

    monkeypatch.setattr(sched_mod, "_slot_map", lambda s: bytearray(bytes([s.step]) * NBYTES))
    monkeypatch.setattr(sched_mod, "read_index", index)


def node(run_id: str, ckpt: str, committer: bool = True, world_size: int = 2,
         local_ranks=(0, 1)) -> Tuple[Scheduler, Run]:
    """A scheduler and its run ``run_id`` on a node of ``local_ranks`` (no commit timeout to speak of: 600 s)."""
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    run = Run(run_id=run_id, world_size=world_size, local_ranks=list(local_ranks), committer=committer,
              checkpoint_dir=ckpt, keep_last=None, commit_timeout_secs=600.0, flush_on_crash=False, fsync=False)
    return sched, run


def write_part(ckpt: str, tag: str, run_id: str, rank: int, step: int, *, fill: Optional[int] = None,
               **fields) -> str:
    """Rank ``rank``'s part of ``step`` in ``tag``'s partial directory of run ``run_id`` under ``ckpt``, written and
    durable, as the writer and the part syncer leave it: ``rank<R>.bin`` of ``NBYTES`` bytes of value ``fill``
    (default ``step``, as the stubbed slot of that step holds) and its part marker with ``fields`` (``gen``,
    ``flush``). Returns the file's checksum (hex str)."""
    d = os.path.join(ckpt, partial_dirname(tag, run_id))
    os.makedirs(os.path.join(d, SIDECAR), exist_ok=True)
    name = f"rank{rank}.bin"
    with open(os.path.join(d, name), "wb") as f:
        cw = ChecksumWriter(f)
        cw.write(bytes([step if fill is None else fill]) * NBYTES)
    marker = {"rank": rank, "run_id": run_id, "step": step, **fields,
              "files": {name: {"nbytes": cw.nbytes, CHECKSUM: cw.hexdigest, "kind": "bytes"}}}
    with open(os.path.join(d, SIDECAR, f"part_{rank:05d}.json"), "w") as f:
        json.dump(marker, f)
    return cw.hexdigest
