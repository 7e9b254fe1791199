"""The node persister's resident memory over many DISK saves (issue: its save records were never dropped, about
4 KB per save).

One rank, one :class:`~snapckpt.Checkpointer` (``keep_last=2``, ``fsync=False``) makes ``SAVES`` DISK saves of a
16-element tensor, waits for them every ``BLOCK`` saves and prints the persister's ``VmRSS`` then; at the end it
checks that every save's handle ended committed. Run it outside the source tree (``python -m`` puts the working
directory first on the persister's path)::

    cd /tmp && PYTHONPATH=/path/to/tree python /path/to/tree/benchmarks/record_memory.py 10000 2000

Prints one JSON line per block, ``{"saves", "pid", "rss_kb", "secs"}``, then ``{"not_committed", "first_bad",
"load1"}``. Kilobytes; seconds since the first save.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from snapckpt import Checkpointer


def rss_kb(pid: int) -> int:
    """``VmRSS`` of process ``pid`` in kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> None:
    n, block = int(sys.argv[1]), int(sys.argv[2])
    d = tempfile.mkdtemp(prefix="record-memory-")
    state = {"w": torch.zeros(16)}
    t0 = time.monotonic()
    handles = []
    with Checkpointer(d, keep_last=2, fsync=False) as ck:
        for step in range(1, n + 1):
            state["w"][0] = step
            handles.append(ck.save(state, step))
            if step % block == 0:
                ck.wait()
                print(json.dumps({"saves": step, "pid": ck.persister_pid, "rss_kb": rss_kb(ck.persister_pid),
                                  "secs": round(time.monotonic() - t0, 1)}), flush=True)
        ck.wait()
    bad = [h.step for h in handles if not h.committed]
    print(json.dumps({"not_committed": len(bad), "first_bad": bad[:5], "load1": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
