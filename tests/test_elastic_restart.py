"""torchrun restarts (``--max_restarts``): every attempt coordinates on its own keys (contract 12, case G5).

torch's elastic agent keeps its rendezvous TCPStore across restart attempts, so a restarted attempt that
numbered its coordination rounds from 1 again under the same keys read the previous attempt's answers:
``latest_step()`` said "no checkpoint" (attempt 0's answer) although step 5 was committed, and one rank
could start from step 0 while another resumed.

torch's own gloo keys are stale in that store too (a restarted gloo group can read the dead attempt's
addresses and fail with "connectFullMesh ... Connection refused", about one run in two here), so the
worker runs with ``TORCH_GLOO_LAZY_INIT=1``: gloo connects at the first collective, which this worker never
runs; only snapckpt's own coordination (the store, never the training group) is exercised.
"""
from __future__ import annotations

import json
import os
import sys

from _harness import REPO, WORKERS, run_torchrun


def test_G5_restarted_attempt_never_reads_the_previous_attempts_answers(snap_env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, **snap_env.env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_GLOO_LAZY_INIT="1")
    # is_host=1: a taken port fails the launch (run_torchrun retries it) instead of torchrun joining whatever
    # listens there as a client and waiting
    proc = run_torchrun(lambda port: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--max_restarts", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_conf", "is_host=1", os.path.join(WORKERS, "elastic_worker.py"), snap_env.ckpt_dir, str(out)],
        env=env, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = {(a, r): json.loads((out / f"attempt{a}_rank{r}.json").read_text()) for a in (0, 1) for r in (0, 1)}
    assert [seen[0, r]["latest"] for r in (0, 1)] == [None, None]
    # attempt 1 sees the checkpoint attempt 0 committed, on every rank, and loads it
    assert [seen[1, r]["latest"] for r in (0, 1)] == [5, 5], seen
    assert [seen[1, r]["loaded_step"] for r in (0, 1)] == [5, 5]
    assert seen[1, 0]["w"] == seen[1, 1]["w"] == [5.0] * 4
