"""Many saves of one step and directory again (over KEEP_ENDED, so the records are pruned between them), with
free-space refusals before the persister in between, in either order of the two ranks, and the handles asked late
and out of order: every handle hears its own save's outcome and no save waits for the commit timeout. Real
scheduler tasks (writers, commits), the slot reads stubbed as in test_resave_after_failure."""
import os
import random

import pytest
from _harness import wait_until
from test_resave_after_failure import parts, _node, RUN, TAG, NBYTES  # noqa: F401
from snapckpt.persister.arena import SlotState
from snapckpt.persister.slots import RankEntry, Slot


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_step_saved_again_many_times_with_refusals_between_gives_each_handle_its_own_outcome(tmp_path, parts,
                                                                                                  seed):
    rnd = random.Random(seed)
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    run.connected = {0, 1}
    sched.slots.ranks[0] = RankEntry(rank=0, slots=[], run_id=RUN)
    sched.slots.ranks[1] = RankEntry(rank=1, slots=[], run_id=RUN)
    seq = [0]
    untold = []  # (rank, step, dirname, seq, expected)

    def ready(rank, step, dirname):
        seq[0] += 1
        s = Slot(index=seq[0], path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.READY,
                 step=step, run_id=RUN, dirname=dirname, seq=seq[0])
        with sched.lock:
            sched.slots.ranks[rank].slots.append(s)
            sched.persist(sched.slots.ranks[rank], step, run)
        return seq[0]

    def peek(rank, step, dirname, sq):
        with sched.lock:
            res = sched.result((RUN, step, dirname), rank, sq)
            return "none" if res is None else ("failed" if rank in res.part_errors else res.state)

    def ask(rank, step, dirname, sq):
        with sched.lock:
            res = sched.result((RUN, step, dirname), rank, sq)
            if res is None:
                return "none"
            if rank in res.part_errors:
                res.told.add(rank)
                return "failed"
            if res.state != "pending":
                res.told.add(rank)
            return res.state

    for i in range(200):
        if rnd.random() < 0.5:
            step, dirname = 7, TAG
        else:
            step, dirname = 8 + i % 200, f"d{i}"
        refuse = rnd.random() < 0.3
        order = [0, 1] if rnd.random() < 0.5 else [1, 0]
        seqs = {}
        for r in order:
            if r == 0 and refuse:
                sched.fail_part(0, run, step, dirname, {"type": "InsufficientDiskError", "message": "no room"})
                seqs[0] = None
            else:
                seqs[r] = ready(r, step, dirname)
        key = (RUN, step, dirname)
        ok = wait_until(lambda: all(peek(r, step, dirname, sq) != "pending" for r, sq in seqs.items()
                                    if sq is not None), timeout=30)
        assert ok, (i, step, refuse, order, [(r.gen, r.state, r.rank_seq) for r in sched.results.records(key)])
        exp = "failed" if refuse else "committed"
        for r, sq in seqs.items():
            if sq is not None:
                untold.append((r, step, dirname, sq, exp))
        # ask some of the old handles, in random order, late
        rnd.shuffle(untold)
        keep = []
        for h in untold:
            if rnd.random() < 0.3:
                got = ask(*h[:4])
                assert got == h[4], (i, h, got, [(r.gen, r.state, r.rank_seq)
                                                 for r in sched.results.records((RUN, h[1], h[2]))])
            else:
                keep.append(h)
        untold = keep
        with sched.lock:
            for e in sched.slots.ranks.values():
                e.slots = [s for s in e.slots if s.state == SlotState.PERSISTING]
    for h in untold:
        got = ask(*h[:4])
        assert got == h[4], (h, got)
    sched.pool.shutdown(wait=False)
