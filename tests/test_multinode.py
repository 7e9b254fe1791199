"""Jobs that span several (simulated) nodes: the rig of tests/multinode.py, real torchrun over gloo.

Every node has its own host name, ``/dev/shm`` and runtime directory (so its own persister and memory
tier) and all share the checkpoint directory. Cases G1, G2, G3 (one node lost, and two of three) and G7 of
docs/design/cases.md (every trainer killed at once: tests/test_multinode_kill_all.py).
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from _harness import REPO, WORKERS, result_lines, wait_until
from multinode import loss_lines

# scripts/test.sh hands out tests one by one (--dist loadgroup); these and tests/test_multinode_kill_all.py share
# the reference runs in `_reference`: one worker runs them all, so each is made once
pytestmark = pytest.mark.xdist_group("test_multinode")

WORKER = os.path.join(WORKERS, "mn_worker.py")
STEPS = 12
# memory every 3 steps, disk every 6: the pause at step 9 holds step 9 in memory and step 6 on disk
MEM, DISK, PAUSE = 3, 6, 9

# world size -> {step: loss} of an uninterrupted run: test_G2_commit_across_two_nodes's (world 4), else
# reference_losses' own run
_reference = {}


def _args(ckpt_dir, *extra, loss_log=None):
    a = [WORKER, ckpt_dir, "--steps", str(STEPS), "--memory-interval", str(MEM), "--disk-interval", str(DISK)]
    if loss_log:
        a += ["--loss-log", loss_log]
    return a + list(extra)


def _run_all(rig, args, nproc, timeout=180, node_ranks=None):
    """Run ``args`` on every node of the rig; assert every agent exits 0; return their outputs. The timeout
    only costs a run that hangs (a node that fails ends the wait at once): at load 25 on 2 cores a restart
    spent 110 s starting torch and finished 9 s past the 120 s it used to get. It stays well under
    pytest-timeout's 300 s per test, so a hang ends with the rig's report (stacks), not pytest's."""
    runs = rig.torchrun_all(args[0], args[1:], nproc, node_ranks=node_ranks)
    assert rig.wait_all(runs, timeout) == [0] * len(runs)  # raises naming the node that failed or hung
    return [r.output() for r in runs]


def _results(outs, tag="RESULT"):
    return [json.loads(l) for o in outs for l in result_lines(o, tag)]


def reference_losses(rig, world):
    """Losses of an uninterrupted run of ``world`` ranks, computed once per world size on node 0 alone
    (the losses do not depend on placement: the resumed multi-node runs are compared with it), unless an
    uninterrupted run of that world size was already logged (test_G2_commit_across_two_nodes: world 4)."""
    if world not in _reference:
        ref_dir, ref_log = os.path.join(rig.tmp, "ref-ckpt"), os.path.join(rig.tmp, "ref.log")
        run, = rig.torchrun_all(WORKER, _args(ref_dir, loss_log=ref_log)[1:], world, nodes=[0])
        assert run.wait(120) == 0, run.output()
        with open(ref_log) as f:
            _reference[world] = loss_lines(f.read())
        assert sorted(_reference[world]) == list(range(1, STEPS + 1))
    return _reference[world]


def _wait_paused(runs, nranks, timeout=90):
    """Until ``PAUSED`` was printed by ``nranks`` ranks (every agent's output together)."""
    ok = wait_until(lambda: sum(r.output().count(f"PAUSED {PAUSE}") for r in runs) >= nranks, timeout, 0.1)
    assert ok, "the ranks did not reach the pause:\n" + "\n".join(r.output() for r in runs)


def _resume_and_compare(rig, nproc, log, node_ranks=None):
    """Restart the job on every node (node ``i`` as node rank ``node_ranks[i]``); every rank resumes from
    memory at step PAUSE (fetched from another node when its rank moved); losses bitwise equal. Returns the
    agents' outputs."""
    outs = _run_all(rig, _args(rig.ckpt_dir, loss_log=log), nproc, node_ranks=node_ranks)
    resumed = _results(outs, "RESUMED")
    assert len(resumed) == len(rig.nodes) * nproc, outs
    assert {(r["step"], r["tier"]) for r in resumed} == {(PAUSE, "memory")}, resumed
    moved = node_ranks is not None and any(r != i for i, r in enumerate(node_ranks))
    assert all(bool(r["fetched_from"]) == moved for r in resumed), resumed
    with open(log) as f:
        text = f.read()
    got = loss_lines(text)
    ref = reference_losses(rig, len(rig.nodes) * nproc)
    assert got == ref, f"losses differ from the uninterrupted run:\n{got}\n{ref}"
    # the resumed run's own lines start right after the resumed step
    assert [int(l.split()[1]) for l in text.splitlines()][PAUSE:] == list(range(PAUSE + 1, STEPS + 1))
    return outs


def _verify(ckpt_dir):
    cp = subprocess.run([sys.executable, "-m", "snapckpt", "verify", ckpt_dir], capture_output=True, text=True,
                        cwd=REPO)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return cp.stdout


def test_rig_lose_and_replace_node(rig):
    """The rig itself: nodes have their own host name and memory; losing a node kills every process in it
    and its memory goes with it; a replacement under the same name starts empty."""
    a, b = rig.start(2)
    assert [n.run(["hostname"]).strip() for n in rig.nodes] == ["node0", "node1"]
    for n in rig.nodes:
        n.run(["bash", "-c", f"echo {n.name} > {rig.shm_dir}/mem && echo sock > {rig.runtime_dir}/sock"])
    assert open(a.path(f"{rig.shm_dir}/mem")).read() == "node0\n"  # private: each node its own file
    assert open(b.path(f"{rig.shm_dir}/mem")).read() == "node1\n"
    assert not os.path.exists(f"{rig.shm_dir}/mem") and not os.listdir(rig.runtime_dir)  # not on the host
    sleeper = b.popen(["sleep", "600"], "sleeper.log")
    assert wait_until(lambda: len(b.pids()) == 2, 10)
    rig.lose_node(1)
    assert sleeper.proc.poll() is not None and not b.alive and not b.pids()
    assert a.shm_files() == [f"{rig.shm_dir}/mem"]  # the other node keeps its memory
    c = rig.replace_node(1)
    assert c.run(["hostname"]).strip() == "node1" and c.shm_files() == [] and rig.nodes[1] is c
    assert c.run(["ls", "-A", rig.runtime_dir]) == ""
    a.run(["rm", f"{rig.shm_dir}/mem"])  # the fixture checks every node's memory is empty at the end


def test_G2_commit_across_two_nodes(rig):
    """G2: 2 nodes x 2 ranks: placement really differs, each node has its own persister, commits complete
    with the tracker last and ``snapckpt verify`` passes; at a clean end every persister exits and no
    node keeps shared memory (checked by the fixture)."""
    rig.start(2)
    log = os.path.join(rig.tmp, "losses.log")
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, loss_log=log)[1:], 2)
    seen = {}  # node -> persister pids seen while training
    wait_until(lambda: all(n.persisters() for n in rig.nodes) or any(r.returncode is not None for r in runs),
               60, 0.05)
    for n in rig.nodes:
        seen[n.name] = n.persisters()
    assert rig.wait_all(runs, 120) == [0, 0]
    res = sorted(_results([r.output() for r in runs]), key=lambda x: x["rank"])
    assert [r["host"] for r in res] == ["node0", "node0", "node1", "node1"], res
    assert {r["num_nodes"] for r in res} == {2}
    assert [r["node_index"] for r in res] == [0, 0, 1, 1]
    assert [r["local_ranks"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(len(p) == 1 for p in seen.values()), f"one persister per node expected: {seen}"
    # the tracker names the last step; the directory verifies (manifest, every rank's part, checksums)
    with open(os.path.join(rig.ckpt_dir, "latest")) as f:
        assert f.read().strip().endswith(str(STEPS))
    out = _verify(rig.ckpt_dir)
    assert str(STEPS) in out
    with open(log) as f:  # an uninterrupted 4-rank run: the reference of the 4-node kill test
        losses = loss_lines(f.read())
    assert sorted(losses) == list(range(1, STEPS + 1))
    _reference.setdefault(4, losses)


def test_G1_G2_one_node_dies_first_the_other_by_exception_resumes_from_memory(rig):
    """G1 across nodes: node 1's trainers are killed first; node 0's ranks then die of the gloo error and
    leave ``with Checkpointer`` by exception (not a clean end). Both persisters keep their memory and the
    restart resumes from memory at step 9 with bitwise-equal losses."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), "--hold-ranks", "1",
                                          loss_log=log)[1:], 1)
    _wait_paused(runs, 2)
    rig.kill_trainers(1)
    assert runs[0].wait(90) != 0  # node 0's ranks failed by exception (the agent reports the failure)
    out0 = runs[0].output()
    assert "barrier with a held rank returned" not in out0
    assert all(n.persisters() for n in rig.nodes), "a persister exited: it took the failure for a clean end"
    _trim_log(log, PAUSE)
    _resume_and_compare(rig, 1, log)


def _read(path):
    """The stripped text of ``path``, or ``None`` while it does not exist."""
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _trim_log(log, step):
    """Keep the interrupted run's lines up to ``step`` (the ones after it were never checkpointed)."""
    with open(log) as f:
        lines = [l for l in f.read().splitlines() if int(l.split()[1]) <= step]
    assert [int(l.split()[1]) for l in lines] == list(range(1, step + 1)), lines
    with open(log, "w") as f:
        f.write("".join(l + "\n" for l in lines))


def test_G2_a_commit_ending_behind_a_later_one_commits_on_every_node_with_keep_last_1(rig):
    """Commits of one job run in parallel and may end out of order. 2 nodes x 1 rank, ``keep_last=1``, steps 1
    and 2 saved back to back; on the committer node step 1's commit is held before its rename until step 2's
    has written its tracker, then held after its rename (before its tracker) while step 2's retention runs.
    Step 2's retention must not retire step 1, whose commit is still in flight (contract 5): before, it did,
    and node 1's watcher, reading step 1's manifest after that, took the commit for aborted (its rank's
    ``wait()`` raised while rank 0's said committed). Both saves commit on every rank; the tracker names
    step 2; step 1 is retired by its own retention once reported and its committed notice sent to node 1."""
    rig.start(2)
    hold = {k: os.path.join(rig.tmp, f"release-{k}") for k in ("rename1", "retention2", "tracker1")}
    env = {"SNAPCKPT_FAULT_POINT": ";".join([
        f"commit.before_rename:step=1:action=wait:path={hold['rename1']}",
        f"commit.after_tracker_before_retention:step=2:action=wait:path={hold['retention2']}",
        f"commit.before_tracker:step=1:action=wait:path={hold['tracker1']}"])}
    runs = rig.torchrun_all(os.path.join(WORKERS, "mn_out_of_order_worker.py"), [rig.ckpt_dir], 1, env=env)
    node0 = rig.nodes[0]
    assert wait_until(lambda: "hit commit.before_rename rank=None step=1" in _persister_log(node0)
                      and "hit commit.after_tracker_before_retention rank=None step=2" in _persister_log(node0),
                      90), _persister_log(node0)
    open(hold["rename1"], "w").close()
    step1 = os.path.join(rig.ckpt_dir, "step_00000001")
    assert wait_until(lambda: os.path.isdir(step1), 30, 0.005)
    open(hold["retention2"], "w").close()  # at once: node 1's watcher reads step 1's manifest once a second
    time.sleep(0.5)  # step 2's retention runs (the fault point's wait polls every 0.05 s)
    open(hold["tracker1"], "w").close()
    assert rig.wait_all(runs, 120) == [0, 0]
    res = sorted(_results([r.output() for r in runs]), key=lambda r: r["rank"])
    assert res == [{"rank": 0, "1": "committed", "2": "committed"},
                   {"rank": 1, "1": "committed", "2": "committed"}], res
    assert _read(os.path.join(rig.ckpt_dir, "latest")) == "step_00000002"
    # its committed notice reached node 1: step 1, beyond keep_last, is retired by its own retention once reported
    assert wait_until(lambda: not os.path.exists(step1), 30), os.listdir(rig.ckpt_dir)
    assert "its committed notice did not reach every other node" not in _persister_log(node0)


def test_G2_a_tag_saved_again_while_its_save_is_in_flight_on_the_committer_but_over_on_the_other_node(rig):
    """A fixed tag (``best``) saved at steps 1 and 2 back to back, 2 nodes x 1 rank, step 1's commit held on the
    committer node after its rename (before its tracker). Node 1's watch of step 1 has ended (it read the
    manifest): its part of step 2 is written at once, while node 0's waits for step 1's save there. Right: rank
    0's ``save`` of step 2 returns while step 1 is still held (the engine no longer waits on the training
    thread; before, it blocked until the release); once released, both saves commit on every rank, ``best``
    holds each rank's step-2 values and ``latest`` names step 2."""
    rig.start(2)
    release, signals = os.path.join(rig.tmp, "release"), os.path.join(rig.tmp, "signals")
    os.makedirs(signals)
    env = {"SNAPCKPT_FAULT_POINT": f"commit.before_tracker:step=1:action=wait:path={release}"}
    runs = rig.torchrun_all(os.path.join(WORKERS, "mn_out_of_order_worker.py"), [rig.ckpt_dir, "tag", signals], 1,
                            env=env)
    node0, node1 = rig.nodes
    try:
        assert wait_until(lambda: "rank 1 step 2: part written" in _persister_log(node1)
                          and "rank 0's part waits for the save of step 1 of best" in _persister_log(node0)
                          and os.path.exists(os.path.join(signals, "saved2-0")), 120), \
            (_persister_log(node0), _persister_log(node1), os.listdir(signals))
        with open(os.path.join(rig.ckpt_dir, "best", ".snapckpt", "manifest.json")) as f:
            assert json.load(f)["step"] == 1  # step 1 renamed into place, its tracker held
    finally:
        open(release, "w").close()
    assert rig.wait_all(runs, 120) == [0, 0]
    res = sorted(_results([r.output() for r in runs]), key=lambda r: r["rank"])
    assert [(r["1"], r["2"]) for r in res] == [("committed", "committed")] * 2, res
    assert res[0]["first_done"] is False, res
    with open(os.path.join(rig.ckpt_dir, "best", ".snapckpt", "manifest.json")) as f:
        assert json.load(f)["step"] == 2
    for r in (0, 1):
        assert torch.load(os.path.join(rig.ckpt_dir, "best", f"rank{r}.pt"))["w"][0].item() == 20 + r
    assert _read(os.path.join(rig.ckpt_dir, "latest")) == "best@2"
    assert not glob.glob(os.path.join(rig.ckpt_dir, ".best.partial-*"))


@pytest.mark.parametrize("scenario,skipper", [("step", 0), ("step", 1), ("resave", 0)])
def test_G2_a_save_one_rank_skips_is_skipped_on_every_node_and_the_next_save_commits(rig, scenario, skipper):
    """``on_slot_busy="skip"`` across nodes (2 nodes x 1 rank, tests/workers/skip_worker.py, order ``first``):
    rank ``skipper``'s only slot is held busy (its part of step 1 held in its node's persister), so it skips the
    next save before the other rank saves at all. ``step``: step 2 skipped, then step 3; ``resave``: step 7 saved
    twice under the tag ``best``, the first save skipped by the committer's rank, which saves again before node 1's
    rank hands over its first snapshot. Right: the other node's save ends skipped, naming the skipper (the committer
    ended the save at once; node 1 hears it even when its rank comes after the committer's abort notices, and does
    not write its part into the partial directory the committer deleted); the next save commits with both ranks'
    parts. Before the fix the other rank's save failed at the commit timeout, and a step saved again mixed the two
    saves' snapshots."""
    rig.start(2)
    signals = os.path.join(rig.tmp, "signals")
    os.makedirs(signals)
    env = {"SNAPCKPT_FAULT_POINT": f"persist.mid_file:rank={skipper}:step=1:action=wait:"
                                   f"path={os.path.join(signals, 'release')}"}
    runs = rig.torchrun_all(os.path.join(WORKERS, "skip_worker.py"),
                            [scenario, rig.ckpt_dir, signals, str(skipper), "first"], 1, env=env)
    assert rig.wait_all(runs, 180) == [0, 0]
    res = {r["rank"]: r for r in _results([r.output() for r in runs])}
    assert sorted(res) == [0, 1], res
    skipped, then, last = ("2", "3", "s3") if scenario == "step" else ("71", "72", "best")
    for rank in (0, 1):
        out = res[rank]["outcomes"]
        assert out[skipped].startswith("skipped: ") and f"rank {skipper} had no free arena slot" in out[skipped], res
        assert out["1"] == "committed" and out[then] == "committed", res
        assert res[rank]["failed"] == [], res
        w = torch.load(os.path.join(rig.ckpt_dir, last, f"rank{rank}.pt"))["w"][0].item()
        assert w == 100 * int(then) + rank, (rank, w)
    assert _read(os.path.join(rig.ckpt_dir, "latest")) == last
    assert "s2" not in os.listdir(rig.ckpt_dir)
    # (a hidden .s2.partial-* may stay: node 1's part of step 2 written before the committer's abort notice reached
    # node 1 but after the committer deleted that directory; never loaded, removed at the job's next start)
    assert wait_until(lambda: not [n for n in os.listdir(rig.ckpt_dir) if ".partial-" in n
                                   and not n.startswith(".s2.")], 30), os.listdir(rig.ckpt_dir)
    if scenario == "resave":  # node 1's rank came long after the committer ended the first save: not written
        assert "step 7: rank 1's part of best is not written: the committer's node ended that save (1)" in \
            _persister_log(rig.nodes[1]), _persister_log(rig.nodes[1])


def test_G7_node_local_checkpoint_dir_is_refused_at_start(rig):
    """G7: node 1 sees its own (private) directory at the checkpoint path. Every rank's Checkpointer fails
    at construction with a CheckpointDirError naming the rank and node that do not see rank 0's directory
    and the fix; nothing is left in the shared directory and no persister was started."""
    rig.start(2, private_paths={1: [rig.ckpt_dir]})
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir)[1:], 1)
    for n, r in enumerate(runs):
        assert r.wait(90) != 0, f"node{n} ran with a node-local checkpoint directory:\n{r.output()}"
        out = r.output()
        assert "CheckpointDirError" in out and "is not the same directory on every node" in out, out
        assert "rank(s) 1 on node1" in out and "(on node0)" in out and "filesystem every node mounts" in out
        assert "step 1 loss" not in out
    assert os.listdir(rig.ckpt_dir) == []  # the probe is removed; nothing else was written
    assert not rig.nodes[1].run(["ls", "-A", rig.ckpt_dir]).strip()


def _commit_line(text, step, role):
    """``(seconds, filesystem checks, wakes, peer notices)`` of the persister's log line about the commit of
    ``step`` (``role``: committer | watcher), or None."""
    m = re.search(rf"step {step}: commit committed after ([0-9.]+) s \({role}, [^)]*\): (\d+) filesystem checks, "
                  rf"(\d+) wakes, (\d+) peer notices", text)
    return None if m is None else (float(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)))


def test_G3_node_lost_without_replicas_resumes_from_disk(rig):
    """G3 with the peer-memory tier turned off (``replicas=0``): every rank paused at step 9 (memory; disk holds 6), node 1 is
    lost (processes, persister and memory) and node 0's trainers die; a fresh node1 joins. The restart
    agrees on disk step 6 on every rank (node 0's memory alone is not a complete step) and trains on with
    losses bitwise equal to an uninterrupted run. The steps held only in memory (7..9) are lost.

    On the way, the commit path without polling (issue 15): node 1's part of step 6 is held 3 s (a fault
    point sleeps before its marker) while both persisters wait; the committer learns of the part, and
    node 1 of the commit, from the other's notice over the peer channel (there even with ``replicas=0``),
    and each read the shared filesystem a few times in those seconds (a backstop re-read a second), not
    every 20 ms (about 150 reads)."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    # node 0's crash flush of step 9 can never commit: give up soon; no peer replicas
    extra = ["--commit-timeout", "20", "--replicas", "0"]
    hold = {"SNAPCKPT_FAULT_POINT": f"persist.before_part_marker:rank=1:step={DISK}:action=sleep:secs=3",
            "SNAPCKPT_LOG_LEVEL": "DEBUG"}  # (the persisters log each peer notice they receive)
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), *extra, loss_log=log)[1:], 1,
                            env=hold)
    _wait_paused(runs, 2)
    assert wait_until(lambda: os.path.exists(os.path.join(rig.ckpt_dir, "latest")), 30)
    assert "EVENT" not in runs[0].output() + runs[1].output()  # nothing replicated
    assert wait_until(lambda: _commit_line(_persister_log(rig.nodes[1]), DISK, "watcher"), 10), \
        _persister_log(rig.nodes[1])
    assert f"SNAPCKPT_FAULT_POINT hit persist.before_part_marker rank=1 step={DISK}" in _persister_log(rig.nodes[1])
    told = 0
    for node, role in ((0, "committer"), (1, "watcher")):
        secs, checks, wakes, notices = _commit_line(_persister_log(rig.nodes[node]), DISK, role)
        print(f"step {DISK} {role}: {secs:.2f} s, {checks} filesystem checks, {wakes} wakes, {notices} notices")
        assert secs >= 2.5, (role, secs)  # the commit was held by node 1's part
        assert checks <= secs + 5, (role, secs, checks, wakes)  # a backstop read a second and the wakes
        told += notices
    # the peer channel carried step DISK's notices both ways (there even with replicas=0): node 1's part to the
    # committer, the commit's end to node 1. Each wait may still see the filesystem first at its backstop read,
    # the notice arriving after its commit line (a loaded CI host saw that for one wait, then for both: told 0),
    # so the notices are read from the receiving persisters' logs, not from the commit lines
    for node, op in ((0, "part_done"), (1, "commit_ended")):
        assert wait_until(lambda: f"{op} of step {DISK} (" in _persister_log(rig.nodes[node]), 10), \
            (node, op, told, _persister_log(rig.nodes[node])[-3000:])
    rig.lose_node(1)
    rig.kill_trainers(0)
    assert rig.nodes[0].persisters() and rig.nodes[0].shm_files()  # node 0 still holds step 9 in memory
    fresh = rig.replace_node(1)
    assert fresh.shm_files() == [] and not fresh.persisters()
    _trim_log(log, DISK)
    outs = _run_all(rig, _args(rig.ckpt_dir, *extra, loss_log=log), 1)
    resumed = _results(outs, "RESUMED")
    assert sorted((r["rank"], r["step"], r["tier"]) for r in resumed) == [(0, DISK, "disk"), (1, DISK, "disk")], \
        outs
    # and rank 0 says what was lost: step 9 held by rank 0 only
    assert any("step 9 is held in memory by ranks [0] but not by ranks [1]" in o and "steps after it are lost"
               in o for o in outs), outs
    with open(log) as f:
        got = loss_lines(f.read())
    assert got == reference_losses(rig, 2)


def _persister_log(node):
    """The text of ``node``'s persister logs (its runtime directory is private to the node)."""
    out = ""
    for path in glob.glob(node.path(f"{node.rig.runtime_dir}/snapckpt-*/*/persister.log")):
        with open(path, errors="replace") as f:
            out += f.read()
    return out


@pytest.mark.parametrize("disk6", ["committed", "in_flight"])
def test_G8_node_lost_and_replaced_resumes_from_peer_replica(rig, disk6):
    """G8, the peer-memory tier (replicas on by default across nodes): every rank paused at step 9 (memory;
    disk holds 6) and each node's persister holds a replica of the other node's rank. Node 1 is lost whole
    (processes, persister, memory) and node 0's trainers die; a fresh node1 (empty memory) joins. The restart
    agrees on memory step 9: rank 0 reads its own node's slot, rank 1's part is fetched from node 0's replica
    into the new node's arena; the losses are bitwise equal to an uninterrupted run. The ranks heard how
    their earlier snapshots replicated (``replicated``, or ``replica_lagging`` when the next snapshot overtook a
    send in flight on a loaded host; CI saw that once). Before the restart, node 0's crash flush committed
    step 9 to disk with rank 1's part written from the replica (the crash flush no longer needs every node).

    ``disk6``: step 6's disk save is committed before the loss, or (a CI run's order under load: the save of step
    6 was still in flight when the test went on) node 1's part of step 6 is held until the node is lost, so no
    ``latest`` exists yet and step 6's commit can never complete: step 9's still does."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    extra = ["--commit-timeout", "40"]
    # node 0's crash flush waits out node 1's lease (renewed every second while it lives): 5 s, not the default
    # 10, a wait this test spends idle after the loss
    env = {"SNAPCKPT_PEER_TIMEOUT_SECS": "5"}
    if disk6 == "in_flight":
        env["SNAPCKPT_FAULT_POINT"] = f"persist.before_part_marker:rank=1:step={DISK}:action=sleep:secs=600"
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), *extra, loss_log=log)[1:], 1,
                            env=env)
    _wait_paused(runs, 2)
    tracker = os.path.join(rig.ckpt_dir, "latest")
    if disk6 == "committed":
        assert wait_until(lambda: os.path.exists(tracker), 60), _persister_log(rig.nodes[0])
    else:
        assert wait_until(lambda: f"hit persist.before_part_marker rank=1 step={DISK}" in _persister_log(
            rig.nodes[1]), 30), _persister_log(rig.nodes[1])
        assert not os.path.exists(tracker)
    for holder, rank in ((0, 1), (1, 0)):  # step 9 is replicated both ways (in the background)
        assert wait_until(lambda: f"holding a replica of rank {rank} step {PAUSE} " in _persister_log(
            rig.nodes[holder]), 30), _persister_log(rig.nodes[holder])
    events = _results([r.output() for r in runs], "EVENT")
    # each rank heard of its earlier snapshots' replication: sent ("replicated"), or, on a loaded host, overtaken
    # by the next snapshot while its send was in flight ("replica_lagging", which replicates the newer one)
    reported = {(e["rank"], e["step"]) for e in events if e["kind"] in ("replicated", "replica_lagging")}
    assert {r for r, _ in reported} == {0, 1} and {s for _, s in reported} <= {MEM, DISK}, events
    assert any(e["kind"] == "replicated" for e in events), events
    assert all("to node" in e["reason"] for e in events if e["kind"] == "replicated"), events
    assert all("not replicated to node" in e["reason"] for e in events if e["kind"] == "replica_lagging"), events
    rig.lose_node(1)
    rig.kill_trainers(0)
    # the whole job died and node 1 is gone: node 0's crash flush still commits step 9, writing rank 1's
    # part from its replica once node 1's lease is stale (peer_timeout_secs, 5 s here)
    assert wait_until(lambda: _read(tracker) == f"step_{PAUSE:08d}", 60), _persister_log(rig.nodes[0])
    assert "rank 1 step 9: part written from the peer replica (the lease of rank 1's node" in _persister_log(
        rig.nodes[0])
    assert f"step_{PAUSE:08d}" in _verify(rig.ckpt_dir)
    fresh = rig.replace_node(1)
    assert fresh.shm_files() == []
    _trim_log(log, PAUSE)
    outs = _run_all(rig, _args(rig.ckpt_dir, *extra, loss_log=log), 1)
    resumed = sorted(_results(outs, "RESUMED"), key=lambda r: r["rank"])
    assert [(r["rank"], r["step"], r["tier"], r["fetched_from"]) for r in resumed] == [
        (0, PAUSE, "memory", None), (1, PAUSE, "memory", "node 0 (replica)")], outs
    with open(log) as f:
        got = loss_lines(f.read())
    assert got == reference_losses(rig, 2)
    assert "step 9 was not in this node's memory: fetched from node 0 (replica)" in outs[1]


def test_G8_a_crash_flush_overtaken_by_a_restart_with_the_committer_moved_is_abandoned(rig):
    """G8 with the restart before node 0's crash flush of step 9 could commit (it awaits node 1's lease to
    age: a 120 s peer timeout here forces that order, which a loaded host hit with the default 10 s) and the
    node ranks swapped: rank 0, so the new committer, on the fresh node 1, whose persister does not serve the
    crashed run and removes its leftovers (step 9's partial directory, its peer records). Node 0's flush of
    step 9 ends at once as abandoned, naming why (it waited for ``commit_timeout_secs``, 600 s, before; found
    by tests/test_multinode_remote.py), writes nothing from the replica and leaves no partial directory; the
    restart resumed from memory step 9 and ``latest`` ends at step 12."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), loss_log=log)[1:], 1,
                            env={"SNAPCKPT_PEER_TIMEOUT_SECS": "120"})
    _wait_paused(runs, 2)
    assert wait_until(lambda: f"holding a replica of rank 1 step {PAUSE} " in _persister_log(rig.nodes[0]), 30), \
        _persister_log(rig.nodes[0])
    rig.lose_node(1)
    rig.kill_trainers(0)
    assert wait_until(lambda: f"standing in for rank 1's part of step {PAUSE} " in _persister_log(rig.nodes[0]),
                      30), _persister_log(rig.nodes[0])
    rig.replace_node(1)
    _trim_log(log, PAUSE)
    outs = _run_all(rig, _args(rig.ckpt_dir, loss_log=log), 1, node_ranks=[1, 0])
    assert sorted((r["rank"], r["step"], r["tier"]) for r in _results(outs, "RESUMED")) == [
        (0, PAUSE, "memory"), (1, PAUSE, "memory")], outs
    abandoned = f"step {PAUSE}: commit failed: step {PAUSE}: the peer records of run"
    assert wait_until(lambda: abandoned in _persister_log(rig.nodes[0]), 30), _persister_log(rig.nodes[0])[-3000:]
    node0 = _persister_log(rig.nodes[0])
    assert "a later run of this job has started" in node0, node0[-3000:]
    assert f"rank 1 step {PAUSE}: part written from the peer replica" not in node0, node0[-3000:]
    assert _read(os.path.join(rig.ckpt_dir, "latest")) == f"step_{STEPS:08d}"
    assert not glob.glob(os.path.join(rig.ckpt_dir, f".step_{PAUSE:08d}.partial-*")), os.listdir(rig.ckpt_dir)
    assert not os.path.exists(os.path.join(rig.ckpt_dir, f"step_{PAUSE:08d}"))


def test_G3_node_lost_with_its_replica_behind_resumes_from_the_newest_complete_step(rig):
    """G3 with the peer-memory tier on and a replica behind: node 1's send of rank 1's step 9 is held (fault
    point ``replica.before_send``), so node 0 holds rank 1's replica of step 6 only. Every rank paused at step
    9, node 1 is lost whole and node 0's trainers die; a fresh node1 joins. The restart agrees on the newest
    step complete across own memory, peer replicas and disk: memory step 6 (rank 0's own slot, rank 1's part
    fetched from node 0's replica), with bitwise-equal losses; rank 0 warns, and emits ``steps_lost``,
    naming step 9 as lost, who held it and where, rank 1's newest copy and the step and tier resumed from."""
    rig.start(2)
    rig.leftover_ok = True
    log = os.path.join(rig.tmp, "losses.log")
    extra = ["--commit-timeout", "20"]  # node 0's crash flush of step 9 can never commit: give up soon
    # rank 1 hands step 9 to its persister 3 s late, so that step 6's send has ended (a snapshot still queued
    # when the next one comes is dropped as lagging), then that persister holds step 9's send
    hold = {"SNAPCKPT_FAULT_POINT": f"snapshot.before_ready:rank=1:step={PAUSE}:action=sleep:secs=3;"
                                    f"replica.before_send:rank=1:step={PAUSE}:action=sleep:secs=600"}
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), *extra, loss_log=log)[1:], 1,
                            env=hold)
    _wait_paused(runs, 2)
    assert wait_until(lambda: f"hit replica.before_send rank=1 step={PAUSE} " in _persister_log(rig.nodes[1])
                      and f"holding a replica of rank 1 step {DISK} " in _persister_log(rig.nodes[0]), 30), \
        _persister_log(rig.nodes[0]) + _persister_log(rig.nodes[1])
    rig.lose_node(1)
    rig.kill_trainers(0)
    assert f"holding a replica of rank 1 step {PAUSE} " not in _persister_log(rig.nodes[0])
    rig.replace_node(1)
    _trim_log(log, DISK)
    outs = _run_all(rig, _args(rig.ckpt_dir, *extra, loss_log=log), 1)
    resumed = sorted(_results(outs, "RESUMED"), key=lambda r: r["rank"])
    assert [(r["rank"], r["step"], r["tier"], r["fetched_from"]) for r in resumed] == [
        (0, DISK, "memory", None), (1, DISK, "memory", "node 0 (replica)")], outs
    with open(log) as f:
        assert loss_lines(f.read()) == reference_losses(rig, 2)
    warning = ("step 9 is held in memory by ranks [0] but not by ranks [1] on any node (held as rank 0: own slot on "
               "node 0); no node holds a copy of it for ranks [1]")
    assert warning in outs[0], outs[0]
    assert ("their newest copies: rank 1 (node 1): step 6 (replica on node 0). The newest step complete on every "
            "rank across own memory, peer replicas and disk is 6 (memory; ranks [1] fetch their parts from where "
            "they are held): the steps after it are lost on this restart") in outs[0], outs[0]
    lost = [e for e in _results(outs, "EVENT") if e["kind"] == "steps_lost"]
    assert [(e["rank"], e["step"]) for e in lost] == [(0, PAUSE)] and warning in lost[0]["reason"], lost


def test_G3_two_of_three_nodes_lost_with_a_ranks_snapshot_and_its_replica_resumes_from_disk(rig):
    """Two nodes lost (issue 15): 3 nodes x 1 rank, ``replicas=1`` in ring order (node ``i`` sends to node
    ``i+1``: node 0 holds rank 2's replica, node 1 rank 0's, node 2 rank 1's). Every rank paused at step 9
    (memory; disk holds 6) with step 9 replicated; nodes 1 and 2 are lost whole, taking rank 1's own slot and
    its only replica, and node 0's trainers die; fresh node1 and node2 join. Node 0 still holds step 9 for
    ranks 0 (own slot) and 2 (replica), not for rank 1, and no older memory step is complete: the restart
    resumes from disk step 6 on every rank, its steps 7..9 bitwise equal to the interrupted run's (an
    uninterrupted run from step 6), and rank 0 warns, and emits ``steps_lost``, naming step 9, its holders
    and where, and rank 1 with no copy."""
    rig.start(3)
    rig.leftover_ok = True
    log, log2 = os.path.join(rig.tmp, "losses.log"), os.path.join(rig.tmp, "resumed.log")
    extra = ["--commit-timeout", "20", "--replicas", "1"]  # node 0's crash flush of step 9 can never commit
    runs = rig.torchrun_all(WORKER, _args(rig.ckpt_dir, "--pause-at", str(PAUSE), *extra, loss_log=log)[1:], 1)
    _wait_paused(runs, 3)
    tracker = os.path.join(rig.ckpt_dir, "latest")
    assert wait_until(lambda: os.path.exists(tracker) and open(tracker).read().strip() == f"step_{DISK:08d}", 30)
    for holder, rank in ((0, 2), (1, 0), (2, 1)):  # the ring, step 9 replicated in the background
        assert wait_until(lambda: f"holding a replica of rank {rank} step {PAUSE} " in _persister_log(
            rig.nodes[holder]), 30), _persister_log(rig.nodes[holder])
    rig.lose_node(1)
    rig.lose_node(2)
    rig.kill_trainers(0)
    for i in (1, 2):
        assert rig.replace_node(i).shm_files() == []
    with open(log) as f:
        before = loss_lines(f.read())  # the interrupted run: steps 1..9
    outs = _run_all(rig, _args(rig.ckpt_dir, *extra, loss_log=log2), 1)
    resumed = sorted(_results(outs, "RESUMED"), key=lambda r: r["rank"])
    assert [(r["rank"], r["step"], r["tier"]) for r in resumed] == [(r, DISK, "disk") for r in range(3)], outs
    with open(log2) as f:
        after = loss_lines(f.read())
    assert sorted(after) == list(range(DISK + 1, STEPS + 1)), after
    assert {s: after[s] for s in range(DISK + 1, PAUSE + 1)} == {s: before[s] for s in range(DISK + 1, PAUSE + 1)}
    warning = ("step 9 is held in memory by ranks [0, 2] but not by ranks [1] on any node (held as rank 0: own slot "
               "on node 0; rank 2: replica on node 0); no node holds a copy of it for ranks [1]")
    assert warning in outs[0], outs[0]
    assert ("their newest copies: rank 1 (node 1): none. The newest step complete on every rank across own memory, "
            f"peer replicas and disk is 6 (disk, step_{DISK:08d}): the steps after it are lost on this restart"
            in outs[0]), outs[0]
    lost = [e for e in _results(outs, "EVENT") if e["kind"] == "steps_lost"]
    assert [(e["rank"], e["step"]) for e in lost] == [(0, PAUSE)] and warning in lost[0]["reason"], lost



def test_G2_a_part_that_comes_after_the_committers_commit_failed_ends_at_once(rig):
    """2 nodes x 1 rank: rank 0's free-space preflight refuses step 2 (its commit fails at once on the committer's
    node, which deletes the partial directory and sends its abort notice); rank 1 hands over its part of step 2
    a second later. Right: rank 1's wait() fails at once, as it does on one node. Before (found by breakit15): node 1
    had no record of that save when the abort notice came and dropped it; rank 1's part was then written
    (re-creating the partial directory the committer had deleted) and its watch waited for the commit timeout plus
    20 s (60 s) before failing with CommitTimeoutError. Node 1 now keeps the abort for the save its ranks have not
    handed over yet (Scheduler.aborts_ahead, skipagree8). The retry of the step by both ranks commits."""
    rig.start(2)
    runs = rig.torchrun_all(os.path.join(WORKERS, "commit_crash_worker.py"),
                            ["preflight_fail_then_retry", rig.ckpt_dir, "room"], 1)
    assert rig.wait_all(runs, 150) == [0, 0]
    res = {r["rank"]: r for r in _results([r.output() for r in runs])}
    assert res[0]["errors"]["first"].startswith("InsufficientDiskError"), res
    assert res[1]["errors"]["first"].startswith("CommitError"), res
    assert res[1]["secs"]["first"] < 30, res
    assert res[0]["errors"]["retry"] is None and res[1]["errors"]["retry"] is None, res
