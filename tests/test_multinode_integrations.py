"""A node lost and replaced, for every integration: DeepSpeed, Megatron, the HF Trainer, Accelerate (case G8).

The rig of tests/multinode.py, 2 nodes x 1 rank, peer replicas on (the default across nodes); the worker is
tests/workers/mn_integration_worker.py. Each rank first trains a fresh model without snapckpt (the
uninterrupted reference, in the same process: no separate launch), then the checkpointed run saves step 2 to
disk and step 3 to memory and pauses. Node 1 is lost whole (processes, persister, memory), node 0's trainers
are killed, a fresh node1 with empty memory joins and the job restarts: both ranks resume from memory at
step 3, rank 1's part fetched from node 0's replica, and the losses after the resume are bitwise equal to the
reference. The core's own case, with the crash flush across the lost node, is
tests/test_multinode.py::test_G8_node_lost_and_replaced_resumes_from_peer_replica.
"""
from __future__ import annotations

import json
import os

import pytest

from _harness import WORKERS, wait_until

WORKER = os.path.join(WORKERS, "mn_integration_worker.py")
STEPS, DISK, PAUSE = 5, 2, 3  # as the worker's
# the directory each framework commits step DISK to (step PAUSE is held in memory only)
DISK_DIR = {"deepspeed": "global_step{}", "megatron": "iter_{:07d}", "trainer": "checkpoint-{}",
            "accelerate": "checkpoint_{}"}


def _lines(out: str, tag: str):
    return [line.split(None, 1)[1] for line in out.splitlines() if line.startswith(tag + " ")]


def _losses(out: str, tag: str):
    return {int(s): v for s, v in (line.split() for line in _lines(out, tag))}


@pytest.mark.parametrize("framework", list(DISK_DIR))
def test_G8_integration_node_lost_and_replaced_resumes_from_peer_replica(rig, framework):
    """G8 through ``framework``'s own save and load calls: both ranks pause after the memory snapshot of step
    3 (disk holds step 2); node 1 is lost whole once node 0 holds rank 1's replica, node 0's trainers are
    killed, a fresh node1 joins; the restart resumes both ranks from memory at step 3, rank 1's part fetched
    from node 0's replica (the Trainer and Accelerate write it out as its folder, then load that natively),
    and the losses of steps 4-5 are bitwise those of the uninterrupted reference."""
    rig.start(2)
    rig.leftover_ok = True  # node 0's persister of the first run serves the restart; the rig kills it
    runs = rig.torchrun_all(WORKER, [framework, rig.ckpt_dir, "--pause"], 1)
    wait_until(lambda: all(f"PAUSED {PAUSE}" in r.output() for r in runs)
               or any(r.returncode is not None for r in runs), 240, 0.1)
    first = [r.output() for r in runs]
    assert all(f"PAUSED {PAUSE}" in o for o in first), "\n".join(o[-5000:] for o in first)
    # rank 1's snapshot of step PAUSE reaches node 0 in the background
    node0 = rig.nodes[0]
    assert wait_until(lambda: f"holding a replica of rank 1 step {PAUSE} " in node0.persister_log(), 30), \
        node0.persister_log()
    names = os.listdir(rig.ckpt_dir)
    assert DISK_DIR[framework].format(DISK) in names and DISK_DIR[framework].format(PAUSE) not in names, names
    rig.lose_node(1)
    rig.kill_trainers(0)
    assert rig.replace_node(1).shm_files() == []
    runs = rig.torchrun_all(WORKER, [framework, rig.ckpt_dir], 1)
    assert rig.wait_all(runs, 240) == [0, 0]  # raises naming the node that failed or hung
    outs = [r.output() for r in runs]
    got = sorted((json.loads(line) for o in outs for line in _lines(o, "RESUMED")), key=lambda x: x["rank"])
    assert [(r["rank"], r["step"], r["tier"], r["fetched_from"]) for r in got] == [
        (0, PAUSE, "memory", None), (1, PAUSE, "memory", "node 0 (replica)")], outs
    if framework in ("trainer", "accelerate"):  # their resume writes the memory snapshot out as its folder
        manifest = os.path.join(rig.ckpt_dir, DISK_DIR[framework].format(PAUSE), ".snapckpt", "manifest.json")
        assert os.path.exists(manifest), os.listdir(rig.ckpt_dir)
    for rank in (0, 1):
        ref = _losses(first[rank], "REF")
        assert sorted(ref) == list(range(1, STEPS + 1)), first[rank]
        before, after = _losses(first[rank], "LOSS"), _losses(outs[rank], "LOSS")
        assert before == {s: ref[s] for s in range(1, PAUSE + 1)}, (rank, before, ref)
        assert after == {s: ref[s] for s in range(PAUSE + 1, STEPS + 1)}, (rank, after, ref)
