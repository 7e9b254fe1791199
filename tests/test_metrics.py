"""Checkpoint metrics (snapckpt/metrics.py): the ``committed`` event's time-to-durable and throughput, the
shared metric names, and rank 0's one summary line per checkpoint."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import pytest
import torch

from snapckpt import Checkpointer, StorageType
from snapckpt import metrics as M
from snapckpt.events import Event, SaveStats

OPTS = dict(persister_idle_timeout_secs=2, commit_timeout_secs=60, request_timeout_secs=30)


def test_committed_event_carries_durable_secs_and_gbps_and_rank0_logs_one_line_per_checkpoint(
        snap_env, monkeypatch, caplog):
    """A DISK save (slowed persister, so the commit comes well after ``save`` returns) and a MEMORY save.
    Right behaviour: the ``committed`` event's stats hold ``durable_secs`` between the save's own blocking
    time and the span the test measured around save+wait, and ``persist_gbps`` = slot bytes / durable
    seconds; the metrics map each event to the shared names, each value once; rank 0 logs exactly one
    summary line per checkpoint (disk at its commit, memory at its snapshot) with human-readable bytes."""
    monkeypatch.setenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS", "0.05")
    state = {"w": torch.arange(256 * 1024, dtype=torch.float32), "step": 0}  # 1 MiB of tensor data
    events = []
    caplog.set_level(logging.INFO, logger="snapckpt.metrics")
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        ck.add_listener(events.append)
        t0 = time.monotonic()
        h = ck.save(state, 1, StorageType.DISK)
        h.wait()
        outer = time.monotonic() - t0
        ck.save(state, 2, StorageType.MEMORY)
    by = {(e.kind, e.step): e for e in events}
    taken, committed = by[("snapshot_taken", 1)], by[("committed", 1)]
    st = committed.stats
    assert st is not None and st.slot_nbytes == taken.stats.slot_nbytes >= 1024 * 1024
    assert st.blocking_secs <= st.durable_secs <= outer
    assert st.durable_secs == h.durable_secs
    assert st.persist_gbps == pytest.approx(st.slot_nbytes / st.durable_secs / 1e9)
    assert taken.stats.durable_secs is None and taken.stats.persist_gbps is None  # only commits carry them

    assert M.event_metrics(taken) == {M.STALL_SECS: taken.stats.blocking_secs, M.BYTES: float(st.slot_nbytes)}
    assert M.event_metrics(committed) == {M.DURABLE_SECS: st.durable_secs, M.PERSIST_GBPS: st.persist_gbps}
    assert set(M.event_metrics(by[("snapshot_taken", 2)])) == {M.STALL_SECS, M.BYTES}
    assert ("committed", 2) not in by  # memory tier: no commit

    lines = [r.getMessage() for r in caplog.records if r.name == "snapckpt.metrics"]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"snapckpt: step 1 \(disk\): 1\.0 MiB, stall \d+\.\d{3} s, durable \d+\.\d{2} s, "
                        r"\d+\.\d{2} GB/s", lines[0]), lines[0]
    assert re.fullmatch(r"snapckpt: step 2 \(memory\): 1\.0 MiB, stall \d+\.\d{3} s", lines[1]), lines[1]


def test_event_metrics_of_skipped_and_other_events():
    """``skipped`` counts 1 under ``snapckpt/skipped``; events without statistics map to nothing; every
    name is documented once in ``METRICS`` under the ``snapckpt/`` prefix."""
    assert M.event_metrics(Event("skipped", 3, StorageType.DISK, 0, reason="no slot")) == {M.SKIPPED: 1.0}
    for kind in ("slot_wait", "failed", "committed"):
        assert M.event_metrics(Event(kind, 3, StorageType.DISK, 0)) == {}
    st = SaveStats(3, StorageType.DISK, 10, 64, 0.1, 0.0, 0.2, 0.3)  # a commit without durable time
    assert M.event_metrics(Event("committed", 3, StorageType.DISK, 0, stats=st)) == {}
    assert M.event_metrics(Event("replicated", 3, StorageType.MEMORY, 0, reason="to node 1")) == {M.REPLICATED: 1.0}
    assert M.event_metrics(Event("replica_lagging", 3, StorageType.MEMORY, 0)) == {M.REPLICA_LAGGING: 1.0}
    names = [m[0] for m in M.METRICS]
    assert names == [M.STALL_SECS, M.BYTES, M.DURABLE_SECS, M.PERSIST_GBPS, M.SKIPPED, M.REPLICATED,
                     M.REPLICA_LAGGING]
    assert all(n.startswith("snapckpt/") for n in names)


def test_first_memory_save_does_not_import_the_cli(snap_env, tmp_path):
    """Rank 0's summary line of its first save formats bytes without importing ``snapckpt.cli`` (every
    subcommand's module: a few milliseconds of that first save, issue 18). In a fresh interpreter, since this
    one may have imported the CLI already."""
    code = (
        "import sys, torch\n"
        "from snapckpt import Checkpointer, StorageType\n"
        f"with Checkpointer({str(tmp_path / 'ck')!r}) as ck:\n"
        "    ck.save({'w': torch.ones(4)}, 1, StorageType.MEMORY)\n"
        "    print(sorted(m for m in sys.modules if m.startswith('snapckpt.cli')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
