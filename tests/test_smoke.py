"""Smoke: one process saves to both tiers, mutates, loads back from memory and from disk."""
import os
import resource
import threading

import pytest
import torch

from _harness import wait_until

from snapckpt import Checkpointer, StorageType


def test_memory_and_disk_round_trip(snap_env):
    model = torch.nn.Linear(8, 4)
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        h = ck.save({"model": model.state_dict(), "step": 1}, 1, StorageType.DISK)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        h.wait()
        assert h.done() and h.snapshot_taken
        # the persister wrote and committed the torch.save file without torch (no 2 s import, no libtorch)
        with open(f"/proc/{ck.persister_pid}/maps") as f:
            assert "libtorch" not in f.read()
        out = ck.load()
        assert ck.last_load.step == 1 and ck.last_load.tier == StorageType.MEMORY
        for k in expected:
            assert torch.equal(out["model"][k], expected[k])
    on_disk = torch.load(f"{snap_env.ckpt_dir}/step_00000001/rank_00000.pt", weights_only=True)
    assert torch.equal(on_disk["model"]["weight"], expected["weight"])
    # contract 10: after a clean close nothing of the job is left: no persister, no arena (the fixture
    # checks both), and not even its runtime directory (socket, token, lock files, log).
    runtime = os.path.join(snap_env.runtime_root, f"snapckpt-{os.getuid()}")
    assert wait_until(lambda: not os.listdir(runtime), timeout=15), os.listdir(runtime)


def test_the_documented_loop_ends_without_waiting_for_a_slot(snap_env):
    """README's loop (memory every 5 steps, disk every 20, save_on_train_end) over 25 steps: the final DISK save of
    step 25 comes while step 20 is being written and step 25's memory snapshot holds the other slot; train_end
    waits for step 20's commit first, so it gets a slot without a ``slot_wait`` (its warning reads as a
    misconfigured interval), and step 25 is on disk."""
    from snapckpt import HookRegistry, SnapshotPolicy

    state = {"w": torch.zeros(1 << 16), "step": 0}
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        kinds = []
        ck.add_listener(lambda e: kinds.append(e.kind))
        hooks = HookRegistry(ck, lambda: state, SnapshotPolicy(memory_interval_steps=5, disk_interval_steps=20,
                                                               save_on_train_end=True))
        for step in range(1, 26):
            hooks.before_optimizer_step()
            state["w"].add_(1.0)
            state["step"] = step
            hooks.step_end(step)
        hooks.train_end()
        assert "slot_wait" not in kinds, kinds
        assert kinds.count("committed") == 2, kinds  # steps 20 and 25
    on_disk = torch.load(f"{snap_env.ckpt_dir}/step_00000025/rank_00000.pt", weights_only=True)
    assert on_disk["step"] == 25 and torch.equal(on_disk["w"], torch.full((1 << 16,), 25.0))


def test_persister_runs_under_batch_scheduling_so_its_wake_up_does_not_preempt_the_rank(snap_env):
    """A rank's ``ready`` wakes the persister to write; under SCHED_BATCH it does not take the rank's CPU there."""
    with Checkpointer(snap_env.ckpt_dir) as ck:
        ck.save({"w": torch.ones(4)}, 1, StorageType.DISK).wait()
        pid = ck.persister_pid
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        # threads started after the switch (the writer's among them) inherit the policy
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert len(tids) > 1 and all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in tids)


def test_arena_reserved_at_construction_for_the_first_save(snap_env):
    """Target 4 of the performance issue: the arena is reserved and mapped before the first save. With
    ``expected_nbytes`` the persister grows both slots of the rank right after construction, before any save,
    and the first save of a state of that size uses a reserved slot as it is (no regrowth); on a restart the
    default hint is the size of the rank's files in the newest checkpoint. A hint larger than shared memory
    never fails the constructor: the save of the real (small) state works. A restart that starts the persister
    reads the rank's file of the newest checkpoint into the page cache meanwhile (engine/prefetch.py); the
    load into live tensors is exact and no prefetch thread outlives ``close()``."""
    def slot_sizes():
        return sorted(os.path.getsize(f) for f in snap_env.shm_files() if os.path.basename(f).startswith("r"))

    mib = 1 << 20
    state = {"w": torch.randn(2 * mib // 4)}  # 2 MiB
    with Checkpointer(snap_env.ckpt_dir, keep_last=2, expected_nbytes=2 * mib) as ck:
        assert ck._prefetch is None  # a new job: no checkpoint to read ahead
        # the size the constructor reserves (Checkpointer._reserve_ahead); a slot file grows to it piece by piece
        want = int(2 * mib * ck.options.slot_headroom) + mib
        assert wait_until(lambda: slot_sizes() == [want, want], timeout=30), slot_sizes()
        reserved = slot_sizes()
        ck.save(state, 1, StorageType.DISK).wait()
        assert slot_sizes() == reserved, (reserved, slot_sizes())  # the first save fitted the reserved slot
    assert wait_until(lambda: not snap_env.shm_files(), timeout=15)  # that persister exited, its arena is gone
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:  # restart: the hint comes from step 1 on disk
        # it started the persister, so it read this rank's file of step 1 into the page cache meanwhile
        part = f"{snap_env.ckpt_dir}/step_00000001/rank_00000.pt"
        assert ck._prefetch is not None and ck._prefetch._files == [(part, os.path.getsize(part))]
        assert wait_until(lambda: len(slot_sizes()) == 2 and min(slot_sizes()) >= 2 * mib, timeout=30), slot_sizes()
        fresh = {"w": torch.zeros_like(state["w"])}
        out = ck.load(fresh)
        assert ck.last_load.step == 1 and out is fresh and torch.equal(out["w"], state["w"])
        assert ck._prefetch.done.wait(30)
    assert not [t for t in threading.enumerate() if t.name == "snapckpt-prefetch"]
    assert wait_until(lambda: not snap_env.shm_files(), timeout=15)
    with Checkpointer(snap_env.ckpt_dir, keep_last=2, expected_nbytes=1 << 50) as ck:  # 1 PiB: cannot fit
        ck.save(state, 2, StorageType.MEMORY).wait()
        assert torch.equal(ck.load()["w"], state["w"]) and ck.last_load.step == 2


def test_second_slot_is_mapped_before_its_first_save(snap_env):
    """Issue 18: the save that first uses the rank's second slot blocks like any later save, because that slot
    was grown and mapped (every page writable) in the background after the first save. Counted in the minor
    page faults of this process during the save (all its threads), not in time."""
    nbytes = 16 << 20
    pages = nbytes // resource.getpagesize()
    state = {"w": torch.rand(nbytes // 4)}

    def faults_of(step):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ck.save(state, step, StorageType.MEMORY)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        first = faults_of(1)  # slot 0: fresh pages, a fault each (4 KiB pages; plus slot 1's prefault)
        for p in list(ck._maps._pending.values()):
            assert p.future.result(timeout=60) is not None  # slot 1 mapped
        second = faults_of(2)  # slot 1
        assert second < pages // 8, (first, second, pages)  # without the prefault: a fault per page, as `first`
        assert torch.equal(ck.load()["w"], state["w"]) and ck.last_load.step == 2


def test_memory_load_into_the_saved_state_copies_from_the_slot_without_reading_its_skeleton(snap_env, monkeypatch):
    """A memory load into a live state of the layout this process saved copies each tensor from the slot in
    place (snapckpt.engine.slot_restore); one whose non-tensor values differ, by the plain digest
    (snapckpt.engine.plain_restore); one whose value types differ goes the general way; all get the saved values."""
    import snapckpt.engine.loader as loader_mod

    state = {"model": {f"w{i}": torch.rand(3, 2) for i in range(30)}, "opt": {"lr": 0.1}, "iteration": 4}
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        ck.save(state, 1, StorageType.MEMORY)
        ck.fence()
        saved = {k: v.clone() for k, v in state["model"].items()}
        live = list(state["model"].values())
        for t in live:
            t.add_(1.0)
        general = loader_mod.read_slot

        def refuse(*args, **kwargs):
            raise AssertionError("the slot's skeleton was read")

        monkeypatch.setattr(loader_mod, "read_slot", refuse)
        assert ck.load(state) is state and ck.last_load.tier == StorageType.MEMORY
        assert list(state["model"].values()) == live and all(torch.equal(state["model"][k], saved[k]) for k in saved)
        for t in live:
            t.add_(1.0)
        state["iteration"] = 5  # another value, which the load replaces: by the plain digest, no skeleton read either
        ck.load(state)
        assert state["iteration"] == 4 and all(torch.equal(state["model"][k], saved[k]) for k in saved)
        monkeypatch.setattr(loader_mod, "read_slot", general)
        state["iteration"] = 5.0  # a value of another type: the general path
        ck.load(state)
        assert state["iteration"] == 4 and all(torch.equal(state["model"][k], saved[k]) for k in saved)


def test_restarted_process_restores_memory_into_a_state_of_the_saved_layout_without_its_skeleton(snap_env,
                                                                                                  monkeypatch):
    """Issue 18 (5): a restarted rank (a new Checkpointer, its Stager fresh) loads a memory snapshot into a live
    state of the saved structure by the slot's plain digest (snapckpt.engine.plain_restore), without reading the
    skeleton, though its own non-tensor values (iteration, learning rate, RNG state) are a fresh start's: the load
    sets the saved ones, and without reading the live tensors field by field (the slot's shape table); a live state
    whose shape differs goes the general way, which names the mismatch."""
    import random

    import snapckpt.engine.loader as loader_mod
    from snapckpt.engine import plain_restore
    from snapckpt.errors import IncompatibleCheckpointError

    def build(fill, iteration=9, lr=0.1, seed=9):
        return {"model": {f"layers.{i}.w": fill((8, 4)) for i in range(50)},
                "opt": {"state": {i: {"exp_avg": fill((8, 4)), "step": fill(())} for i in range(50)},
                        "param_groups": [{"lr": lr, "params": list(range(50))}]}, "iteration": iteration,
                "sched": {"last_epoch": iteration, "_last_lr": [lr]}, "rng": random.Random(seed).getstate()}

    state = build(torch.rand)
    ck = Checkpointer(snap_env.ckpt_dir, keep_last=2)
    ck.save(state, 9, StorageType.MEMORY).wait()
    ck.close(clean=False)  # leaves like a crashed rank: the persister keeps the snapshot

    def refuse(*args, **kwargs):
        raise AssertionError("the slot's skeleton was read")

    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck2:
        live = build(torch.zeros, iteration=0, lr=1.0, seed=0)
        with monkeypatch.context() as mp:
            mp.setattr(loader_mod, "read_slot", refuse)
            # by the slot's shape table: the live tensors are not read field by field either
            mp.setattr(plain_restore, "_find", lambda *a, **k: pytest.fail("the live tensors were read one by one"))
            assert ck2.load(live) is live and ck2.last_load.tier == StorageType.MEMORY and ck2.last_load.step == 9
        assert live["iteration"] == 9 and live["sched"] == {"last_epoch": 9, "_last_lr": [0.1]}
        assert live["opt"]["param_groups"] == state["opt"]["param_groups"] and live["rng"] == state["rng"]
        for k, v in state["model"].items():
            assert torch.equal(live["model"][k], v)
        for i, d in state["opt"]["state"].items():
            assert torch.equal(live["opt"]["state"][i]["exp_avg"], d["exp_avg"])
            assert torch.equal(live["opt"]["state"][i]["step"], d["step"])
        other = build(torch.zeros)
        other["model"]["layers.3.w"] = torch.zeros(4, 8)
        with pytest.raises(IncompatibleCheckpointError, match="layers.3.w"):
            ck2.load(other)


def test_state_that_grows_a_little_keeps_its_slots_and_mappings(snap_env):
    """Issue 18 (loop): a state whose non-tensor part grows by a few bytes every save (a log list, as the HF
    Trainer's ``log_history``; or the step number gaining a digit) fits the slot's headroom
    (``slot_headroom``): the slots are not regrown and the rank's mappings of them are kept, so a later save
    takes no page fault per page of its slot (a regrown slot is mapped anew, and its copy faults every page
    in again). Counted in the minor faults of this process and in the slot files' sizes, not in time."""
    nbytes = 16 << 20
    pages = nbytes // resource.getpagesize()
    state = {"w": torch.rand(nbytes // 4), "log": []}

    def slot_sizes():
        return sorted(os.path.getsize(f) for f in snap_env.shm_files() if os.path.basename(f).startswith("r"))

    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        state["log"].append({"step": 1, "loss": 0.5})
        ck.save(state, 1, StorageType.MEMORY)
        for p in list(ck._maps._pending.values()):
            assert p.future.result(timeout=60) is not None  # slot 1 mapped
        sizes = slot_sizes()
        for step in range(2, 13):  # 9 -> 10 adds a digit too
            state["log"].append({"step": step, "loss": 0.5})
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ck.save(state, step, StorageType.MEMORY)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            assert faults < pages // 8, (step, faults, pages)
            assert slot_sizes() == sizes, (step, sizes, slot_sizes())
        out = ck.load()
        assert ck.last_load.step == 12 and torch.equal(out["w"], state["w"]) and out["log"] == state["log"]


def test_memory_restore_copies_before_the_other_slot_is_prefaulted(snap_env, monkeypatch):
    """Issue 18 (recovery time): a restart that loads from memory maps the slot holding the snapshot, which starts
    the background prefault of the rank's other slot (for the first save); that prefault waits until the copy
    into the live tensors is done, instead of sharing the CPUs and memory bandwidth with it, then goes on."""
    import snapckpt.engine.checkpointer as checkpointer_mod
    from snapckpt.engine import plain_restore

    state = {"w": torch.rand((4 << 20) // 4), "step": 7}
    ck = Checkpointer(snap_env.ckpt_dir, keep_last=2)
    ck.save(state, 1, StorageType.MEMORY).wait()
    ck.close(clean=False)  # leaves like a crashed rank: the persister keeps the snapshot
    seen = []
    real, real_run = checkpointer_mod.copy_into, plain_restore.PlainCopies.run

    def copy_into(*args, **kwargs):
        pending = list(ck2._maps._pending.values())
        seen.append((ck2._maps._go.is_set(), [p.future.done() for p in pending]))
        return real(*args, **kwargs) if args else None

    def run(self):  # the restore by the plain digest (the fresh state's "step" 0 does not keep it from there)
        copy_into()
        return real_run(self)

    monkeypatch.setattr(checkpointer_mod, "copy_into", copy_into)
    monkeypatch.setattr(plain_restore.PlainCopies, "run", run)
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck2:
        fresh = {"w": torch.zeros_like(state["w"]), "step": 0}
        out = ck2.load(fresh)
        assert ck2.last_load.tier == StorageType.MEMORY and torch.equal(out["w"], state["w"]) and out["step"] == 7
        assert seen == [(False, [False])], seen  # the other slot's prefault was queued and held during the copy
        assert ck2._maps._go.is_set()
        for p in list(ck2._maps._pending.values()):
            assert p.future.result(timeout=60) is not None  # then it mapped the slot


def test_memory_restore_asks_the_persister_once_for_the_slot(snap_env, monkeypatch):
    """Issue 18 (recovery time): a restart that loads from memory into a live state asks the persister which slots
    it holds once for the agreement and once for the slot to read, not a third time when the slot is read the
    general way (a restart's mapping has no saved layout to copy from): each question is a round trip to the
    persister process, on a node whose CPUs the restarting ranks share."""
    state = {"w": torch.rand(1 << 16), "step": 7}
    ck = Checkpointer(snap_env.ckpt_dir, keep_last=2)
    ck.save(state, 1, StorageType.MEMORY).wait()
    ck.close(clean=False)  # leaves like a crashed rank: the persister keeps the snapshot
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck2:
        ops = []
        real = ck2._session.request

        def request(op, **fields):
            ops.append(op)
            return real(op, **fields)

        monkeypatch.setattr(ck2._session, "request", request)
        fresh = {"w": torch.zeros_like(state["w"]), "step": 0}
        out = ck2.load(fresh)
        assert ck2.last_load.tier == StorageType.MEMORY and torch.equal(out["w"], state["w"]) and out["step"] == 7
        assert ops.count("held") == 2, ops


def test_a_memory_save_waits_for_one_answer_of_the_persister(snap_env):
    """A MEMORY save waits for its slot (``acquire``) and hands it over (``ready``) without waiting for that answer:
    each wait is a round trip to a persister under ``SCHED_BATCH`` (0.4 ms idle, up to 12 ms on a loaded 2-core
    host). The next request reads the answer first, and a load then finds the snapshot in memory."""
    state = {"w": torch.arange(1 << 12, dtype=torch.float32), "step": 1}
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        ck.save(state, 1, StorageType.MEMORY)  # the first save starts the persister and makes the arena
        client = ck._saver._session.client
        awaited, posted = [], []
        request, post = client.request, client.post
        client.request = lambda op, **kw: awaited.append(op) or request(op, **kw)
        client.post = lambda op, **kw: posted.append(op) or post(op, **kw)
        state["w"].add_(1.0)
        state["step"] = 2
        ck.save(state, 2, StorageType.MEMORY)
        assert (awaited, posted) == (["acquire"], ["ready"])
        out = ck.load()
        assert ck.last_load.step == 2 and ck.last_load.tier == StorageType.MEMORY
        assert torch.equal(out["w"], state["w"]) and out["step"] == 2


def test_memory_restore_under_inference_mode_restores_every_tensor(snap_env, monkeypatch):
    """An evaluation process that holds its weights as inference tensors (made under ``torch.inference_mode``)
    restores its memory snapshot into them under ``inference_mode``, as torch requires. The small tensors (80 MiB
    in all, over ``mover.SPLIT_NBYTES``) are copied by the calling thread and the mover's helpers. Right: every
    tensor gets the saved values (before the fix the helpers' parts raised "Inplace update to inference tensor
    outside InferenceMode": inference mode is per thread, and the restore raised with some tensors restored)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with torch.inference_mode():
        # 256 KiB each, 80 MiB: ten parts, which the helper takes a share of while the caller copies its first
        state = {f"w{i:03d}": torch.full((64 << 10,), float(i)) for i in range(320)}
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        ck.save(state, 1, StorageType.MEMORY).wait()
        with torch.inference_mode():
            for t in state.values():
                t.zero_()
            try:
                ck.load(state)
                err = None
            except RuntimeError as e:  # (its traceback holds views of the slot: not kept past the Checkpointer)
                err = str(e)[:200]
        tier = ck.last_load.tier if ck.last_load is not None else None
    assert err is None, err
    assert tier == StorageType.MEMORY
    bad = [k for i, (k, t) in enumerate(sorted(state.items())) if not bool((t == float(i)).all())]
    assert not bad, f"{len(bad)} of {len(state)} tensors not restored"
