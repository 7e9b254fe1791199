"""Many saves of one step and directory again (over KEEP_ENDED, so the records are pruned between them), with
free-space refusals before the persister in between, in either order of the two ranks, and the handles asked late
and out of order: every handle hears its own save's outcome and no save waits for the commit timeout. Real
scheduler tasks (writers, commits), the slot reads stubbed as in test_resave_after_failure; the handles hear the
persister's status replies (Server._op_status), in which a save again deferred behind the earlier one still
running (a refused save's other writer) is "pending", not the earlier save's outcome."""
import os
import random
import threading
from types import SimpleNamespace

import pytest
from _harness import wait_until
from test_resave_after_failure import parts, _node, RUN, TAG, NBYTES  # noqa: F401
from snapckpt.persister import scheduler as sched_mod
from snapckpt.persister.arena import SlotState
from snapckpt.persister.server import Server
from snapckpt.persister.slots import RankEntry, Slot


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_step_saved_again_many_times_with_refusals_between_gives_each_handle_its_own_outcome(tmp_path, parts,
                                                                                                  monkeypatch, seed):
    rnd = random.Random(seed)
    ckpt = str(tmp_path)
    sched, run = _node(ckpt)
    run.connected = {0, 1}
    sched.slots.ranks[0] = RankEntry(rank=0, slots=[], run_id=RUN)
    sched.slots.ranks[1] = RankEntry(rank=1, slots=[], run_id=RUN)
    owner = SimpleNamespace(scheduler=sched, slots=sched.slots)  # (what Server._op_status reads)
    seq = [0]
    untold = []  # (rank, step, dirname, seq, expected)
    # a refused save's writer of rank 1 is held until the next save's parts came: that save, of step 7 again,
    # waits for it (deferred), as under CPU load, where a writer outlives its save's failed commit
    held_writers = {}  # slot seq -> its writer's gate
    stubbed = sched_mod._slot_map

    def slot_map(s):
        gate = held_writers.get(s.seq)
        if gate is not None:
            gate.wait(30)
        return stubbed(s)

    monkeypatch.setattr(sched_mod, "_slot_map", slot_map)

    def ready(rank, step, dirname, hold=False):
        seq[0] += 1
        if hold:
            held_writers[seq[0]] = threading.Event()
        s = Slot(index=seq[0], path=os.path.join(ckpt, f"rank{rank}"), nbytes=NBYTES, state=SlotState.READY,
                 step=step, run_id=RUN, dirname=dirname, seq=seq[0])
        with sched.lock:
            sched.slots.ranks[rank].slots.append(s)
            sched.persist(sched.slots.ranks[rank], step, run)
        return seq[0]

    def status(rank, step, dirname, sq, tell):
        """The persister's answer to the rank's status request of its snapshot ``sq`` (Server._op_status: a save
        of the step again that waits for the earlier one to be over says "pending"); ``tell=False``: a peek,
        which leaves the records' ``told`` as they were (an untold rank's records are kept: Scheduler._prune)."""
        with sched.lock:
            recs = sched.results.records((RUN, step, dirname))
            was = [(r, set(r.told)) for r in recs]
            reply = Server._op_status(owner, sched.slots.ranks[rank], {"step": step, "dirname": dirname, "seq": sq})
            if not tell:
                for r, told in was:
                    r.told = told
            return reply["state"]

    def held(step, dirname):
        """The records of ``(step, dirname)``, read with the lock (the tasks change them meanwhile)."""
        with sched.lock:
            return [(r.gen, r.state, dict(r.rank_seq), sorted(r.deferred_seqs))
                    for r in sched.results.records((RUN, step, dirname))]

    def peek(rank, step, dirname, sq):
        return status(rank, step, dirname, sq, tell=False)

    def ask(rank, step, dirname, sq):
        return status(rank, step, dirname, sq, tell=True)

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
                seqs[r] = ready(r, step, dirname, hold=refuse)
        for sq, gate in held_writers.items():  # the previous refused save's: this save's parts came
            if sq not in seqs.values():
                gate.set()
        ok = wait_until(lambda: all(peek(r, step, dirname, sq) != "pending" for r, sq in seqs.items()
                                    if sq is not None), timeout=30)
        assert ok, (i, step, refuse, order, held(step, dirname))
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
                assert got == h[4], (i, h, got, held(h[1], h[2]))
            else:
                keep.append(h)
        untold = keep
        with sched.lock:
            for e in sched.slots.ranks.values():
                e.slots = [s for s in e.slots if s.state == SlotState.PERSISTING]
    for gate in held_writers.values():
        gate.set()
    for h in untold:
        got = ask(*h[:4])
        assert got == h[4], (h, got, held(h[1], h[2]))
    # a refused save's other writer outlives its failed commit: stopped before the stubbed slot reads are undone
    assert wait_until(lambda: sched.pending == 0, timeout=30), sched.pending
    sched.pool.shutdown(wait=True)
    sched.remove_pool.shutdown(wait=True)
