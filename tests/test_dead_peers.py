"""Dead peers are detected in seconds, not after the commit timeout (issue 15; snapckpt.persister.peers).

Three ranks on one node: rank 1's process is killed with SIGKILL while a commit waits for it. Two nodes
of two ranks on the multi-node rig (tests/multinode.py): a rank of node 1 is killed, or node 1 is lost
whole (trainers and persister), while node 0's committer waits; node 0 is lost while node 1 waits. Every rank runs with ``commit_timeout_secs=600``: a save that ends within this test's
time limit ended because the dead peer was detected, not because the timeout passed.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal

import pytest

from _harness import finish, launch, result_lines, wait_until
from faults import committed, slow_env, verify_all

WORKER = "dead_peer_worker.py"


def _kill_victim(sig_dir: str, procs, survivors=()) -> int:
    """Wait until rank 1 waits to be killed (and ``survivors`` saved step 2), then SIGKILL it; its pid."""
    need = [os.path.join(sig_dir, "victim")] + [os.path.join(sig_dir, f"saved-{r}") for r in survivors]
    ok = wait_until(lambda: all(os.path.exists(p) for p in need) or any(p.poll() is not None for p in procs), 120)
    assert ok and all(os.path.exists(p) for p in need), \
        f"the ranks did not reach the kill point: {os.listdir(sig_dir)}; {[p.poll() for p in procs]}"
    pid = int(open(need[0]).read())
    assert pid == procs[1].pid
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.timeout(240)
def test_a_rank_killed_before_its_part_abandons_the_commit_at_once_and_the_job_restarts(snap_env):
    sig = os.path.join(snap_env.tmp, "sig")
    os.makedirs(sig)
    procs = launch(WORKER, 3, ["never_saves", snap_env.ckpt_dir, sig], snap_env.env)
    pid = _kill_victim(sig, procs, survivors=(0, 2))
    outs = finish(procs, timeout=180)
    assert procs[1].returncode == -signal.SIGKILL
    for r in (0, 2):
        assert procs[r].returncode == 0, outs[r]
        res = json.loads(result_lines(outs[r])[0])
        print(f"rank {r}: {res}")  # the seconds each call took (shown with -s)
        # the waiting save ends with the dead rank named, pid included (the commit timeout is 600 s)
        err, _secs = res["wait2"]
        assert err.startswith("PeerLostError: step 2: rank 1 (pid %d on host " % pid), err
        assert "abandoned" in err and "previous checkpoint and the tracker are untouched" in err, err
        # the job goes on: the next save needs rank 1 too and ends the same way, at once
        err3, _ = res["wait3"]
        assert err3.startswith("PeerLostError: step 3: rank 1 (pid %d" % pid), err3
        # and close() returns (nothing outstanding waits for the dead rank)
        assert res["close"][0] == "ok", res
    # the previous checkpoint is intact and the tracker did not move
    assert committed(snap_env.ckpt_dir) == {1: "step_00000001"}
    assert verify_all(snap_env.ckpt_dir) == []
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read().strip() == "step_00000001"
    assert not [n for n in os.listdir(snap_env.ckpt_dir) if ".partial-" in n]
    # the restarted job resumes from step 1 and commits step 2: nothing was left stuck
    outs = finish(launch(WORKER, 3, ["resume", snap_env.ckpt_dir, sig], snap_env.env), timeout=180)
    for r, out in enumerate(outs):
        res = json.loads(result_lines(out)[0])
        assert res["loaded"][0] == 1 and res["loaded"][2] == r * 100 + 1, out
        assert res["wait2"][0] == "ok", out
    assert committed(snap_env.ckpt_dir) == {1: "step_00000001", 2: "step_00000002"}
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read().strip() == "step_00000002"


@pytest.mark.timeout(240)
def test_a_rank_killed_after_handing_over_its_part_still_commits(snap_env):
    """No false alarm: a rank that dies after ``save()`` handed its DISK snapshot to the persister has its
    part written from shared memory; the commit of that step succeeds."""
    sig = os.path.join(snap_env.tmp, "sig")
    os.makedirs(sig)
    procs = launch(WORKER, 3, ["handed_over", snap_env.ckpt_dir, sig], {**snap_env.env, **slow_env(0.1)})
    _kill_victim(sig, procs)
    outs = finish(procs, timeout=180)
    assert procs[1].returncode == -signal.SIGKILL
    for r in (0, 2):
        assert procs[r].returncode == 0, outs[r]
        res = json.loads(result_lines(outs[r])[0])
        assert res["wait2"][0] == "ok" and res["close"][0] == "ok", res
    assert committed(snap_env.ckpt_dir) == {1: "step_00000001", 2: "step_00000002"}
    assert verify_all(snap_env.ckpt_dir) == []
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read().strip() == "step_00000002"
    # the part really was in flight when rank 1 died: the persister wrote it after the disconnect
    logs = glob.glob(os.path.join(snap_env.runtime_root, "**", "persister.log"), recursive=True)
    assert len(logs) == 1, logs
    text = open(logs[0]).read()
    gone, written = text.find("rank 1 (run "), text.find("rank 1 step 2: part written")
    assert 0 <= gone < written, text


def _lose_a_node_while_the_other_waits(rig, lost: int, held=None):
    """Two nodes of two ranks; step 1 committed; the ``held`` ranks (default: node ``lost``'s) hold while
    the others save step 2 and wait; node ``lost`` is lost whole, or (``held`` given) only the held ranks'
    processes are killed. Returns (the RESULT records of node ``1 - lost``, the pid of node ``lost``'s
    persister, or of the killed rank)."""
    rig.leftover_ok = True  # the survivor's torchrun agent waits at its exit barrier for the lost one's: killed
    rig.start(2)
    sig = os.path.join(rig.tmp, "sig")
    os.makedirs(sig)
    kill_ranks = held is not None
    held = held if kill_ranks else [2 * lost, 2 * lost + 1]
    runs = rig.torchrun_all(f"tests/workers/{WORKER}", ["node_lost", rig.ckpt_dir, sig, ",".join(map(str, held))],
                            nproc_per_node=2)
    saved = [r for r in range(4) if r not in held]
    need = [os.path.join(sig, f"held-{r}") for r in held] + [os.path.join(sig, f"saved-{r}") for r in saved]
    ok = wait_until(lambda: all(os.path.exists(p) for p in need) or any(r.returncode is not None for r in runs), 150)
    assert ok and all(os.path.exists(p) for p in need), \
        f"not at the kill point: {os.listdir(sig)}\n{runs[0].output()}\n{runs[1].output()}"
    lost_persister = rig.nodes[lost].persisters()
    assert len(lost_persister) == 1, lost_persister
    if kill_ranks:
        pids = [int(open(os.path.join(sig, f"held-{r}")).read()) for r in held]
        assert set(pids) <= set(rig.nodes[lost].trainers()), pids
        rig.nodes[lost].kill(pids)
        lost_persister = pids
    else:
        rig.lose_node(lost)
    survivor = runs[1 - lost]

    def results():
        return [json.loads(l) for l in result_lines(survivor.output())]

    def diag() -> str:
        """The survivor's output, the peer records and the surviving node's persister log."""
        out = [survivor.output()]
        for f in glob.glob(os.path.join(rig.ckpt_dir, ".snapckpt.peers-*", "*")):
            out.append(f + ": " + open(f).read())
        for f in glob.glob(rig.nodes[1 - lost].path(rig.runtime_dir) + "/**/persister.log", recursive=True):
            out.append(open(f).read())
        return "\n".join(out)

    assert wait_until(lambda: len(results()) == 2, 120), diag()
    assert committed(rig.ckpt_dir) == {1: "step_00000001"}
    assert verify_all(rig.ckpt_dir) == []
    assert open(os.path.join(rig.ckpt_dir, "latest")).read().strip() == "step_00000001"
    out = results()
    print(out)  # the seconds each call took (shown with -s)
    rig.kill_trainers(1 - lost)
    if kill_ranks:
        rig.kill_trainers(lost)
    return out, lost_persister[0]


@pytest.mark.timeout(300)
def test_a_node_lost_whole_while_the_committer_waits_is_abandoned_naming_its_ranks(rig):
    """Node 1 (ranks 2 and 3, and its persister) is lost while node 0's committer waits for their parts of
    step 2: its lease stops, and the commit is abandoned once it is ``peer_timeout_secs`` (3 s) old,
    naming node 1's ranks and host; node 0's ranks get the error and close at once. (The kill of node 1's
    processes is not atomic: when its persister outlives its ranks by a moment it records them as gone,
    and the commit is abandoned at once naming a dead rank of node1 instead; both are right.)"""
    results, pid = _lose_a_node_while_the_other_waits(rig, lost=1)
    for res in results:
        assert res["host"] == "node0" and res["rank"] in (0, 1), res
        err = res["wait2"][0]
        by_lease = err.startswith("PeerLostError: step 2: the node persister of ranks [2, 3] (pid %d on host "
                                  "node1)" % pid)
        if by_lease:
            assert "ranks [2, 3] can never deliver their part" in err and "peer_timeout_secs=3" in err, err
        else:
            assert re.match(r"PeerLostError: step 2: rank [23] \(pid \d+ on host node1\) died before handing over "
                            r"its part of step_00000002", err), err
        assert res["close"][0] == "ok", res
    # the committer removed the abandoned step's partial directory
    assert not [n for n in os.listdir(rig.ckpt_dir) if ".partial-" in n]


@pytest.mark.timeout(300)
def test_the_committers_node_lost_whole_the_other_node_stops_waiting(rig):
    """Node 0 (the committer's: ranks 0 and 1, and the persister of rank 0) is lost while node 1's ranks
    wait for the commit of step 2: node 1's persister (``watch_commit``) sees node 0's lease stop and
    gives up, naming ranks 0 and 1 and host node0 (or, when node 0's persister outlived its ranks by a
    moment and recorded them as gone, naming a dead rank of node0 at once: both are right)."""
    results, pid = _lose_a_node_while_the_other_waits(rig, lost=0)
    for res in results:
        assert res["host"] == "node1" and res["rank"] in (2, 3), res
        err = res["wait2"][0]
        if err.startswith("PeerLostError: step 2: the node persister of ranks [0, 1] (pid %d on host node0)" % pid):
            assert "ranks [0, 1] can never deliver their part" in err, err
        else:
            assert re.match(r"PeerLostError: step 2: rank [01] \(pid \d+ on host node0\) died before handing over "
                            r"its part of step_00000002", err), err
        assert res["close"][0] == "ok", res
    # node 1's parts stay in the hidden partial directory (only the committer removes it; the next run
    # of the job does): no loader looks there, and step 2 has no directory
    assert not os.path.exists(os.path.join(rig.ckpt_dir, "step_00000002"))


@pytest.mark.timeout(300)
def test_a_rank_killed_on_another_node_than_the_committer_is_named_at_once(rig):
    """Rank 3 (node 1) is killed with SIGKILL while node 0's committer waits for its part of step 2: node
    1's persister records it as gone in the checkpoint directory, and the committer on node 0 abandons the
    commit at once (no lease involved: node 1's persister lives), naming rank 3, its pid and host."""
    results, pid = _lose_a_node_while_the_other_waits(rig, lost=1, held=[3])
    assert sorted(r["rank"] for r in results) == [0, 1], results
    for res in results:
        err = res["wait2"][0]
        assert err.startswith("PeerLostError: step 2: rank 3 (pid %d on host node1) died before handing over"
                              % pid), err
        assert res["close"][0] == "ok", res
