"""Every trainer of a multi-node job killed at once (case G2), at 2 and 4 simulated nodes: the restart
resumes from memory with losses bitwise equal to an uninterrupted run. The rig and the worker are those of
tests/test_multinode.py, and so are the uninterrupted reference runs: both modules are one xdist group, so
the world-2 reference is made once and the world-4 one is test_G2_commit_across_two_nodes's run (each
computed here when this module runs alone).
"""
from __future__ import annotations

import os

import pytest

from test_multinode import PAUSE, WORKER, _args, _persister_log, _resume_and_compare, _trim_log, _wait_paused

pytestmark = pytest.mark.xdist_group("test_multinode")


def test_G2_every_trainer_killed_at_once_resumes_from_memory(rig):
    """G2: every trainer of both nodes (one rank each) killed at the same instant (the persisters live): the restart resumes
    from memory at the newest step (9, disk holds 6) with losses bitwise equal to an uninterrupted run."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), loss_log=log)[1:], 1)
    _wait_paused(runs, 2)
    persisters = [n.persisters() for n in rig.nodes]
    assert all(len(p) == 1 for p in persisters), persisters
    rig.kill_all_trainers()
    assert [n.persisters() for n in rig.nodes] == persisters  # the memory tier lives on
    _trim_log(log, PAUSE)
    _resume_and_compare(rig, 1, log)


def test_G2_G6_four_nodes_killed_resume_from_memory_on_other_nodes(rig):
    """G2 at 4 nodes (one rank each): every trainer killed at once, and the restart places every rank on
    another node (node i becomes node rank i+1, as a new allocation can). Every rank still resumes from
    memory at step 9, its snapshot fetched from the node that holds it (its old node's slot or a replica),
    losses bitwise equal to an uninterrupted 4-rank run (DDP without bucket rebuild); each node then frees
    the slots of the rank that moved away, at the new run's first snapshot."""
    rig.start(4)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), loss_log=log)[1:], 1)
    _wait_paused(runs, 4)
    assert all(len(n.persisters()) == 1 for n in rig.nodes)
    rig.kill_all_trainers()
    _trim_log(log, PAUSE)
    _resume_and_compare(rig, 1, log, node_ranks=[1, 2, 3, 0])
    for i, node in enumerate(rig.nodes):
        assert f"freed the memory slots of ranks [{i}], held from an earlier run" in _persister_log(node), i

