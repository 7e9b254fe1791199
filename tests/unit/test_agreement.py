"""The load agreement's decision (snapckpt.engine.agreement) on constructed inventories: what each rank reports
after a node loss (its own slots, its node's holdings: own slots and peer replicas) and the committed steps.
Which step and tier a restart resumes from, and the warning naming what is lost.

The rig tests run the same functions in real jobs (tests/test_multinode.py: G3 without replicas, G8 a node
replaced, G9 a replica behind); the cases of three nodes are decided here.
"""
from __future__ import annotations

from snapckpt.engine.agreement import lost_steps, memory_tier, ranked

R = "run-a"


def _decide(reports, disk_steps):
    tier = memory_tier(reports, len(reports))
    cands = ranked(tier, [[s, f"step_{s:08d}", len(reports)] for s in disk_steps])
    return tier, cands, lost_steps(reports, tier, cands[0] if cands else None)


def test_a_replica_behind_resumes_from_the_older_replicated_step_and_names_the_lost_one():
    """2 nodes, one rank each: rank 1's step 9 was never replicated (the send was held), node 1 is lost and
    replaced. Node 0 holds rank 0's steps 6 and 9 and rank 1's replica of step 6: memory step 6 wins over disk
    step 6, and step 9 is named as lost, with who held it, rank 1's newest copy and the tier resumed from."""
    reports = [{"mem": [[6, R], [9, R]], "holds": [[0, 6, R, "own"], [0, 9, R, "own"], [1, 6, R, "replica"]],
                "node": 0},
               {"mem": [], "holds": [], "node": 1}]
    tier, cands, msg = _decide(reports, [6])
    assert cands == [(6, "memory", R), (6, "disk", "step_00000006")]
    assert tier.sources[(6, R)][1] == [(0, "replica")]
    assert msg == (
        "step 9 is held in memory by ranks [0] but not by ranks [1] on any node (held as rank 0: own slot on "
        "node 0); no node holds a copy of it for ranks [1]: their node was lost or restarted without its memory "
        "(or they died before their snapshot of it), and no peer replica of it survives (the replica was behind, "
        "or lost with its holder); their newest copies: rank 1 (node 1): step 6 (replica on node 0). The newest "
        "step complete on every rank across own memory, peer replicas and disk is 6 (memory; ranks [1] fetch "
        "their parts from where they are held): the steps after it are lost on this restart")


def test_two_of_three_nodes_lost_with_one_replica_fall_back_to_disk():
    """3 nodes, one rank each, replicas=1 (node i -> node i+1): nodes 1 and 2 are lost. Rank 1's own slot
    (node 1) and its replica (node 2) are both gone; rank 2's replica of step 9 survives on node 0. No memory
    step is complete: disk step 6 wins, and the warning names step 9 held by ranks 0 and 2 (node 0) and rank
    1 with no copy at all."""
    reports = [{"mem": [[6, R], [9, R]], "holds": [[0, 6, R, "own"], [0, 9, R, "own"], [2, 9, R, "replica"]],
                "node": 0},
               {"mem": [], "holds": [], "node": 1},
               {"mem": [], "holds": [], "node": 2}]
    tier, cands, msg = _decide(reports, [3, 6])
    assert tier.complete == set()
    assert cands[0] == (6, "disk", "step_00000006")
    assert msg.startswith("step 9 is held in memory by ranks [0, 2] but not by ranks [1] on any node (held as "
                          "rank 0: own slot on node 0; rank 2: replica on node 0)")
    assert "their newest copies: rank 1 (node 1): none." in msg
    assert msg.endswith("is 6 (disk, step_00000006): the steps after it are lost on this restart")


def test_two_nodes_lost_with_two_replicas_behind_resume_from_the_older_complete_step():
    """3 nodes, one rank each, replicas=2: nodes 1 and 2 are lost; node 0 holds a replica of each (one replica
    slot per peer rank). Both replicas behind at step 6: memory step 6 is complete (own slot and two replicas)
    and newer than disk step 3, it wins; step 9 is lost for ranks 1 and 2. Rank 1's replica at step 9 but rank
    2's at 6: no memory step is complete on every rank, disk step 3 wins and steps 6 and 9 are both lost."""
    own = [[0, 6, R, "own"], [0, 9, R, "own"]]
    reports = [{"mem": [[6, R], [9, R]], "holds": own + [[1, 6, R, "replica"], [2, 6, R, "replica"]], "node": 0},
               {"mem": [], "holds": [], "node": 1},
               {"mem": [], "holds": [], "node": 2}]
    _, cands, msg = _decide(reports, [3])
    assert cands == [(6, "memory", R), (3, "disk", "step_00000003")]
    assert "step 9 is held in memory by ranks [0] but not by ranks [1, 2] on any node" in msg
    assert "rank 1 (node 1): step 6 (replica on node 0); rank 2 (node 2): step 6 (replica on node 0)" in msg
    assert "is 6 (memory; ranks [1, 2] fetch their parts from where they are held)" in msg

    reports[0]["holds"] = own + [[1, 9, R, "replica"], [2, 6, R, "replica"]]
    _, cands, msg = _decide(reports, [3])
    assert cands == [(3, "disk", "step_00000003")]
    assert "step 9 is held in memory by ranks [0, 1] but not by ranks [2] on any node" in msg
    assert "rank 2 (node 2): step 6 (replica on node 0)" in msg
    assert msg.endswith("is 3 (disk, step_00000003): the steps after it are lost on this restart (memory steps "
                        "lost: [6, 9])")


def test_several_steps_lost_and_no_tier_complete_is_a_fresh_start_named_as_such():
    """Only rank 0 ever held anything (steps 3 and 6) and nothing is committed: both are listed as lost and
    the restart is named a fresh start."""
    reports = [{"mem": [[3, R], [6, R]], "node": 0}, {"mem": [], "node": 1}]
    _, cands, msg = _decide(reports, [])
    assert cands == []
    assert "step 6 is held in memory by ranks [0] but not by ranks [1]" in msg
    assert "rank 1 (node 1): none" in msg
    assert msg.endswith("is none (a fresh start): the steps after it are lost on this restart (memory steps "
                        "lost: [3, 6])")


def test_a_step_held_by_every_rank_but_from_two_runs_names_the_ranks_of_the_other_run():
    """Rank 0 holds step 9 of run A, rank 1 step 9 of run B (a replaced node's replica of an earlier run):
    step 9 is not complete; the warning names rank 1 as missing it and why (it held 'ranks []' before)."""
    reports = [{"mem": [[9, R]], "node": 0}, {"mem": [[9, "run-b"]], "node": 1}]
    _, cands, msg = _decide(reports, [6])
    assert cands[0] == (6, "disk", "step_00000006")
    assert "step 9 is held in memory by ranks [0] but not by ranks [1]" in msg, msg
    assert "rank 1 (node 1): step 9 of another run (run-b, not run-a)" in msg, msg


def test_nothing_is_lost_when_the_newest_step_is_complete_through_a_replica():
    """Node 1 lost, its rank's replica of the newest step on node 0: step 9 is complete, nothing is lost."""
    reports = [{"mem": [[6, R], [9, R]], "holds": [[0, 9, R, "own"], [1, 9, R, "replica"]], "node": 0},
               {"mem": [], "holds": [], "node": 1}]
    tier, cands, msg = _decide(reports, [6])
    assert cands[0] == (9, "memory", R) and msg is None
    # disk newer than every memory step: nothing held in memory is lost either
    _, cands, msg = _decide(reports, [12])
    assert cands[0] == (12, "disk", "step_00000012") and msg is None
