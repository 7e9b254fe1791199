"""``snapckpt ps`` counts a job's ranks once over its runs: a restarted job is a new run of the same local ranks,
and the persister keeps the crashed run (its snapshots) beside it. Found by a new-user trial: a 2-rank Megatron
job restarted once showed RANKS ``0/4``."""
from __future__ import annotations

import argparse

from snapckpt.cli import ps


def test_a_restarted_jobs_ranks_are_counted_once(monkeypatch, capsys):
    rec = {"pid": 7, "job": "j" * 16, "age_secs": 5.0, "memory_bytes": 1 << 20, "steps_held": [10], "stopping": False,
           "error": None, "slots": [], "pending_tasks": 0,
           "runs": [{"run_id": "a", "checkpoint_dir": "/ck", "local_ranks": [0, 1], "connected_ranks": []},
                    {"run_id": "b", "checkpoint_dir": "/ck", "local_ranks": [0, 1], "connected_ranks": [0, 1]}]}
    monkeypatch.setattr(ps, "find_persisters", lambda root: ["entry"])
    monkeypatch.setattr(ps, "_describe", lambda e: rec)
    assert ps.cmd_ps(argparse.Namespace(runtime_dir="/nowhere", json=False), None) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert " 2/2 " in row, row
