"""``Checkpointer.expect``: the arena reserved for a size learnt after construction (issue 18, target 4).

A new job without ``expected_nbytes`` knows its snapshot size only once its optimizer made its state (the first
step); ``expect`` then has the persister grow and the rank map its slots in the background, so the first save
finds them reserved. The Trainer callback calls it after the first step. Sizes are read from the slot files (no
time is asserted)."""
import os

import pytest
import torch

from _harness import wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.engine.preflight import tensor_nbytes
from snapckpt.errors import CheckpointerClosedError

MIB = 1 << 20


def _slot_sizes(snap_env):
    return sorted(os.path.getsize(f) for f in snap_env.shm_files() if os.path.basename(f).startswith("r"))


def test_tensor_nbytes_counts_each_tensors_bytes_once_through_modules_and_optimizers():
    """Right: a module and its AdamW after one step hold 3x the parameters' bytes (weights, exp_avg, exp_avg_sq)
    plus the step counters; a tied weight (two state_dict entries over one storage) and a tensor listed twice
    count once; a view counts its own bytes; a non-tensor counts 0."""
    lin = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 64)).sum().backward()
    opt.step()
    params = sum(p.numel() * 4 for p in lin.parameters())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert tensor_nbytes({"model": lin, "optimizer": opt}) == 3 * params + steps
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(8, 8, bias=False)
    tied.b = torch.nn.Linear(8, 8, bias=False)
    tied.b.weight = tied.a.weight
    assert len(tied.state_dict()) == 2 and tensor_nbytes(tied) == 8 * 8 * 4
    t = torch.zeros(100)
    assert tensor_nbytes([t, (t, {"x": t[:10]}), "text", 3]) == 400 + 40
    assert tensor_nbytes({"e": torch.empty(0)}) == 0


def test_expect_reserves_the_slots_before_the_first_save_and_nothing_after(snap_env):
    """Right: after ``expect(state)`` both slots of the rank grow to the size a save of that state asks for,
    before any save, and the first save uses a reserved slot as it is; once a save was made ``expect`` does
    nothing (``False``); bad arguments and a closed Checkpointer raise."""
    state = {"w": torch.randn(2 * MIB // 4), "step": 0}  # 2 MiB of tensors
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        assert _slot_sizes(snap_env) == []  # a new job without expected_nbytes reserves nothing
        with pytest.raises(ValueError, match="one of the two"):
            ck.expect()
        with pytest.raises(ValueError, match="one of the two"):
            ck.expect(state, nbytes=5)
        with pytest.raises(ValueError, match="int >= 0"):
            ck.expect(nbytes=-1)
        assert ck.expect(state) is True
        want = int(2 * MIB * ck.options.slot_headroom) + MIB  # as Checkpointer._reserve_ahead asks
        assert wait_until(lambda: _slot_sizes(snap_env) == [want, want], timeout=30), _slot_sizes(snap_env)
        ck.save(state, 1, StorageType.MEMORY).wait()
        assert _slot_sizes(snap_env) == [want, want]  # the first save fitted a reserved slot
        assert ck.expect(nbytes=64 * MIB) is False  # after a save: the slots follow the saved state
        assert _slot_sizes(snap_env) == [want, want]
        assert torch.equal(ck.load()["w"], state["w"])
    with pytest.raises(CheckpointerClosedError):
        ck.expect(nbytes=MIB)


def test_expect_of_a_size_the_host_cannot_hold_reserves_nothing_and_saves_still_work(snap_env):
    """Right: a size far beyond shared memory is not reserved (``False``, logged), and a save of the real state
    sizes its own slot."""
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        assert ck.expect(nbytes=1 << 50) is False
        assert _slot_sizes(snap_env) == []
        ck.save({"w": torch.ones(16)}, 1, StorageType.MEMORY).wait()
        assert torch.equal(ck.load()["w"], torch.ones(16))


def test_trainer_callback_reserves_the_arena_after_the_first_step(snap_env):
    """Right: with the callback and no ``expected_nbytes``, after the Trainer's first step (AdamW's state made)
    and before its first save (step 3), the rank's slots are reserved for the model's and optimizer's tensor
    bytes; the save of step 3 then writes checkpoint-3 as always."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    seen = {}

    class Probe(TrainerCallback):  # after SnapckptCallback: the sizes before the first save
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step == 2:
                need = tensor_nbytes({"model": model, "optimizer": optimizer})
                want = int(need * cb.checkpointer.options.slot_headroom) + MIB  # as Checkpointer._reserve_ahead
                seen["need"] = need
                seen["grown"] = wait_until(lambda: _slot_sizes(snap_env) == [want, want], timeout=30)
                seen["sizes"] = _slot_sizes(snap_env)

    args = TrainingArguments(output_dir=snap_env.ckpt_dir, max_steps=3, save_steps=3, save_strategy="steps",
                             per_device_train_batch_size=4, report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, seed=7)
    cb = SnapckptCallback(persister_idle_timeout_secs=2, commit_timeout_secs=60)
    trainer = cb.attach(Trainer(model=build_model(), args=args, train_dataset=Tokens(n=16), callbacks=[cb, Probe()]))
    trainer.train()
    # the model's and AdamW's bytes: more than the parameters' (exp_avg, exp_avg_sq)
    assert seen["need"] > 2 * sum(p.numel() * 4 for p in trainer.model.parameters()) and seen["grown"], seen
    assert os.path.isdir(os.path.join(snap_env.ckpt_dir, "checkpoint-3"))


def test_accelerator_checkpointer_reserves_the_arena_after_the_first_optimizer_step(snap_env):
    """Right: ``AcceleratorCheckpointer`` on the main process reserves the rank's slots for the prepared model's
    and optimizer's tensor bytes right after the first ``optimizer.step()`` (not before), and the first
    ``save_state`` fits them."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from accel_worker import setup
    from snapckpt.hf import AcceleratorCheckpointer

    acc, model, opt, loader, sched = setup()
    ck = AcceleratorCheckpointer(acc, snap_env.ckpt_dir, persister_idle_timeout_secs=5)
    try:
        x, y = next(iter(loader))
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        assert _slot_sizes(snap_env) == []  # the optimizer has no state yet: nothing to size
        opt.step()
        need = tensor_nbytes({"models": [model], "optimizers": [opt]})
        want = int(need * ck.checkpointer.options.slot_headroom) + MIB
        assert need > 3 * sum(p.numel() * 4 for p in model.parameters())  # weights, exp_avg, exp_avg_sq, steps
        assert wait_until(lambda: _slot_sizes(snap_env) == [want, want], timeout=30), (_slot_sizes(snap_env), want)
        ck.save_state(1).wait()
        assert _slot_sizes(snap_env) == [want, want]
        assert os.path.isfile(os.path.join(snap_env.ckpt_dir, "checkpoint_1", "optimizer.bin"))
    finally:
        ck.close()


def test_hook_registry_reserves_at_its_first_step_and_expect_says_when_it_found_no_tensor(snap_env, caplog):
    """Right: ``HookRegistry.step_end`` at the first step (no snapshot due) reserves the slots for ``state_fn()``'s
    size; ``expect`` of something without tensor data (an optimizer before its first step, a string) reserves
    nothing and logs why; ``model.parameters()`` (an iterator) is counted."""
    from snapckpt import HookRegistry, SnapshotPolicy

    lin = torch.nn.Linear(256, 256)
    assert tensor_nbytes(lin.parameters()) == (256 * 256 + 256) * 4
    with Checkpointer(snap_env.ckpt_dir, keep_last=2) as ck:
        opt = torch.optim.AdamW(lin.parameters())
        with caplog.at_level("WARNING", logger="snapckpt"):
            assert ck.expect(opt) is False and ck.expect("state") is False
        assert caplog.text.count("found no tensor data") == 2 and "AdamW" in caplog.text, caplog.text
        assert _slot_sizes(snap_env) == []
        state = {"w": torch.randn(MIB // 4)}
        hooks = HookRegistry(ck, lambda: state, SnapshotPolicy(disk_interval_steps=3))
        hooks.step_end(1)
        want = int(MIB * ck.options.slot_headroom) + MIB
        assert wait_until(lambda: _slot_sizes(snap_env) == [want, want], timeout=30), _slot_sizes(snap_env)
        for step in (2, 3):
            hooks.step_end(step)
        hooks.train_end()
        assert _slot_sizes(snap_env) == [want, want]
        assert ck.latest_step() == 3


@pytest.mark.parametrize("zero,only_model,ds", [(True, False, None), (False, False, None), (True, True, None),
                                                 (True, False, "ds.json")])
def test_trainer_callback_reserves_only_what_its_process_saves(zero, only_model, ds):
    """Right: the callback's first ``on_step_end`` sizes the arena for what that process's snapshot holds: the model
    and optimizer on the main process (the model only with ``save_only_model``), nothing on the other processes
    (their snapshots hold their RNG state only) nor under DeepSpeed (its engine saves its partitions; the DeepSpeed
    checkpointer sizes those); once per training."""
    from types import SimpleNamespace

    from snapckpt import SnapshotPolicy
    from snapckpt.hf import SnapckptCallback

    asked = []
    cb = SnapckptCallback()
    cb.checkpointer = SimpleNamespace(expect=asked.append, poll=lambda: None)
    cb._policy = SnapshotPolicy()
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters())
    args = SimpleNamespace(deepspeed=ds, save_only_model=only_model)
    state = SimpleNamespace(is_world_process_zero=zero, global_step=1)
    for _ in range(2):
        cb.on_step_end(args, state, SimpleNamespace(should_evaluate=False, should_save=False), model=lin, optimizer=opt)
    if not zero or ds:
        assert asked == []
    else:
        assert len(asked) == 1 and asked[0]["model"] is lin and asked[0]["optimizer"] is (None if only_model else opt)


class _Cursor:
    """A resumable sampler kept in the state as an object (pickled by the save): an iterator with a
    ``state_dict``."""

    def __init__(self, n: int) -> None:
        self.pos, self.n = 0, n

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += 1
        return self.pos

    def state_dict(self):
        return {"pos": self.pos}


def test_expect_leaves_the_states_iterators_and_odd_objects_alone_and_never_fails_a_step(snap_env):
    """Right: ``expect`` (and ``HookRegistry``'s first step, which calls it) counts the tensors of a state holding
    a user's iterator without advancing it (an infinite one hung ``expect``, a finite one lost its positions:
    the data the run reads next), and a sparse tensor (no storage) or a ``state_dict()`` that raises costs the
    hint, not the step: the first save, the one that sizes the slots, reports what it cannot snapshot."""
    cursor = _Cursor(10)
    w = torch.randn(MIB // 4)
    assert tensor_nbytes({"w": w, "data": cursor}) == MIB and cursor.pos == 0
    assert tensor_nbytes({"w": w, "emb": torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))}) == MIB
    from snapckpt import HookRegistry, SnapshotPolicy

    with Checkpointer(snap_env.ckpt_dir, keep_last=2, weights_only=False) as ck:  # the cursor is a user class
        state = {"w": w, "data": cursor, "odd": torch.nn.Module()}
        state["odd"].state_dict = lambda: 1 / 0  # what a broken state_dict() of a user's object raises
        hooks = HookRegistry(ck, lambda: state, SnapshotPolicy(disk_interval_steps=2))
        hooks.step_end(1)  # the first step: expect() of the state, which fails inside; the step goes on
        del state["odd"]
        hooks.step_end(2)  # a disk save of the cursor as an object
        ck.wait()
        assert ck.load()["data"].pos == 0 and cursor.pos == 0


def test_expect_grows_slots_that_an_earlier_reservation_sized_smaller(snap_env):
    """Right: after the construction's reservation (``expected_nbytes``, or on a restart the newest checkpoint's
    size) ended, ``expect`` of a larger state grows the slots to it; it did nothing (``False``, nothing logged)
    while the finished reservation was not yet taken by a save, and the first save grew its slot itself."""
    with Checkpointer(snap_env.ckpt_dir, keep_last=2, expected_nbytes=MIB) as ck:
        small = int(MIB * ck.options.slot_headroom) + MIB
        assert wait_until(lambda: _slot_sizes(snap_env) == [small, small], timeout=30), _slot_sizes(snap_env)
        state = {"w": torch.randn(4 * MIB // 4)}
        assert ck.expect(state) is True
        want = int(4 * MIB * ck.options.slot_headroom) + MIB
        assert wait_until(lambda: _slot_sizes(snap_env) == [want, want], timeout=30), _slot_sizes(snap_env)
        ck.save(state, 1, StorageType.MEMORY).wait(30)
        assert _slot_sizes(snap_env) == [want, want] and torch.equal(ck.load()["w"], state["w"])
