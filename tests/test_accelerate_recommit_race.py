"""``AcceleratorCheckpointer.load_state()`` while the job saving into the directory commits the newest folder again
(a save after a rewind swaps a new copy in) after snapckpt verified the folder and before ``accelerator.load_state``
reads it by path. The new copy was never checked: here it has a damaged byte (a power loss after its commit), and
accelerate loads it without a word. Right: the folder accelerate read must be the one verified; when it was
committed again meanwhile, the load is done again (the new copy verified first: damaged here, so the previous
folder, ``checkpoint_1``, is loaded), never a state nobody checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from _harness import REPO, result_lines, wait_until

WORKER = os.path.join(REPO, "tests", "workers", "accel_recommit_worker.py")


def _run(args, env):
    p = subprocess.run([sys.executable, WORKER, *args], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout + p.stderr


def test_accelerate_load_state_of_a_folder_committed_again_after_its_check_never_loads_it_unchecked(snap_env):
    out, other = os.path.join(snap_env.tmp, "run"), os.path.join(snap_env.tmp, "other")
    _run(["save", out, "0"], snap_env.env)
    _run(["save", other, "1"], snap_env.env)  # another commit of checkpoint_2 (other values)
    assert wait_until(lambda: not snap_env.persisters(), 30)  # no memory tier: the folders decide
    res = [json.loads(x) for x in result_lines(_run(["load", out, os.path.join(other, "checkpoint_2")],
                                                    snap_env.env))]
    assert len(res) == 1 and res[0]["swapped"], res
    r = res[0]
    assert "raised" not in r, r
    # not the damaged new copy of checkpoint_2 (values 102 and a flipped one), loaded without a check
    assert (r["loaded"], r["values"]) == ("checkpoint_1", [1.0]), r
