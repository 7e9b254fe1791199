"""A hung (stopped, not dead) persister during a DISK save (case B5): ``wait()`` ends within
``request_timeout_secs`` with an error that names the cause (the process is stopped) and the fixes (a larger
timeout for a slow persister, killing a hung one), and the save goes on once the persister is resumed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from snapckpt import Checkpointer
from snapckpt.errors import PersisterTimeoutError


def test_B5_stopped_persister_error_names_the_state_the_pid_and_the_fixes(snap_env):
    d = snap_env.ckpt_dir
    ck = Checkpointer(d, request_timeout_secs=3, persister_idle_timeout_secs=5)
    pid = ck.persister_pid
    try:
        ck.save({"w": torch.ones(1 << 18), "step": 1}, 1).wait()
        h = ck.save({"w": torch.full((1 << 18,), 2.0), "step": 2}, 2)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(PersisterTimeoutError) as ei:
                h.wait()
        finally:
            os.kill(pid, signal.SIGCONT)
        msg = str(ei.value)
        assert f"pid {pid}" in msg and "stopped" in msg, msg  # the cause: the process is stopped, not slow
        assert "request_timeout_secs" in msg and "kill" in msg, msg  # the two fixes
        assert "committed checkpoints are intact" in msg, msg
        ck.save({"w": torch.full((1 << 18,), 3.0), "step": 3}, 3).wait()
        assert ck.load()["step"] == 3
    finally:
        ck.close()


def test_B5_stopped_persister_found_at_construction_is_named_by_its_pid(snap_env):
    """A new process of the job meets the job's persister stopped: its ``hello`` times out before any reply
    told it the pid. Before the fix the error said "pid None"; right: the pid (from ``persister.pid``), its
    state and the fixes."""
    d = snap_env.ckpt_dir
    ck = Checkpointer(d, request_timeout_secs=30, persister_idle_timeout_secs=5)
    pid = ck.persister_pid
    code = ("import sys\nfrom snapckpt import Checkpointer\n"
            "try:\n    Checkpointer(sys.argv[1], request_timeout_secs=2, persister_startup_timeout_secs=30)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=120)
        finally:
            os.kill(pid, signal.SIGCONT)
        msg = out.stdout.strip()
        assert msg.startswith("PersisterTimeoutError"), (out.stdout, out.stderr[-2000:])
        assert f"pid {pid}" in msg and f"kill -9 {pid}" in msg and "stopped" in msg, msg
        assert "None" not in msg, msg
    finally:
        ck.close()
