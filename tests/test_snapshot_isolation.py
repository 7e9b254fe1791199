"""Snapshot isolation, slot reuse, stale caches, aliasing and the torch.save round trip.

Cases A1-A5, D3, E1 (aliasing), E4, E5/E6 of ``docs/design/cases.md`` and design contracts (docs/design/contracts.md) 1
(snapshot isolation), 2 (no slot reuse before release), 3 (no stale caches) and 9 (aliasing from storage).

The reference for "what the checkpoint must hold" is always a SHA-256 of every tensor's bytes (plus dtype
and shape) and the ``repr`` of every other value, taken at the moment of ``save``; what lands on disk is
read back with stock ``torch.load`` (not snapckpt's loader), and the memory tier through ``Checkpointer.load``.
Most tests are single-process (the Checkpointer works without ``torch.distributed``); a slow persister
(``SNAPCKPT_FAULT_WRITE_DELAY_SECS``) keeps the persister reading a slot while training goes on.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os

import pytest
import torch
from torch import nn

from _harness import assert_equal_state, result_lines, run_ranks, wait_until
from snapckpt import Checkpointer, HookRegistry, SnapshotPolicy, StorageType
from snapckpt.errors import IncompatibleCheckpointError

OPTS = dict(persister_idle_timeout_secs=2, commit_timeout_secs=60, request_timeout_secs=30,
            coordination_timeout_secs=30, persister_startup_timeout_secs=60)
SLOW_PERSISTER = "SNAPCKPT_FAULT_WRITE_DELAY_SECS"


# ------------------------------------------------------------------------------------------ helpers
def tensor_digest(t: torch.Tensor) -> tuple:
    """``(dtype, shape, sha256 of the values in logical order)``."""
    t = t.detach()
    # numpy() of the live tensor would mark its storage non-resizable: hash a private copy
    data = t.reshape(-1).clone().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest()


def digest(obj):
    """A comparable fingerprint of a whole state: every tensor hashed, every other value by ``repr``."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", type(obj).__name__) + tensor_digest(obj)
    if isinstance(obj, dict):
        return (type(obj).__name__, tuple((repr(k), digest(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(digest(v) for v in obj))
    return ("py", repr(obj))


def rank_file(ckpt_dir: str, step: int, rank: int = 0) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}", f"rank_{rank:05d}.pt")


def plain_load(ckpt_dir: str, step: int):
    """What landed on disk, read by stock PyTorch (no snapckpt code involved)."""
    return torch.load(rank_file(ckpt_dir, step), weights_only=True)


def committed_steps(ckpt_dir: str) -> list:
    """Steps whose directory has a commit record (manifest)."""
    out = []
    for name in os.listdir(ckpt_dir):
        if name.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, name, ".snapckpt", "manifest.json")):
            out.append(int(name[len("step_"):]))
    return sorted(out)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train_state(model, opt, step: int, history: list) -> dict:
    """A training state as a user saves it: live references to every tensor, plus plain values."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "history": history,
            "meta": {"lr": opt.param_groups[0]["lr"], "tags": ["a", "b"]}}


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def wait_persisters_gone(snap_env) -> None:
    assert wait_until(lambda: not snap_env.persisters(), timeout=30), \
        f"persister did not exit after close(): {[p.pid for p in snap_env.persisters()]}"


# ------------------------------------------------------------------------------ contract 1: isolation
def test_A1_mutate_right_after_save(snap_env, monkeypatch):
    """A1 / contract 1. Fault: CPU parameters are mutated in place (``p.add_(1)``, an AdamW step) and
    the non-tensor items changed (a list appended, a dict entry rewritten, the state dict's ``step``
    replaced) the moment ``save`` returns, while a slow persister has not written anything yet.
    Right behaviour: the file on disk and the memory tier both hold exactly the state of step N."""
    monkeypatch.setenv(SLOW_PERSISTER, "0.01")
    model, opt = make_model()
    history = [train_step(model, opt, s) for s in range(3)]
    state = train_state(model, opt, 3, history)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        expected = digest(state)
        h = ck.save(state, 3, StorageType.DISK)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        history.append(train_step(model, opt, 3))
        state["meta"]["lr"] = 123.0
        state["meta"]["tags"].append("mutated")
        state["step"] = 4
        assert digest(state) != expected, "the test did not change the live state"
        h.wait()
        from_memory = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY and ck.last_load.step == 3
        assert digest(from_memory) == expected
    assert digest(plain_load(snap_env.ckpt_dir, 3)) == expected


def test_A2_adamw_step_and_params_from_same_step(snap_env, monkeypatch):
    """A2. Fault: parameters and AdamW state live in shared memory (``share_memory_()``, which is what a
    hand-off through a ``torch.multiprocessing`` queue does to them), and the optimizer steps right after
    ``save(N)``. Right behaviour: checkpoint N is internally consistent: AdamW's ``step`` is N, and
    params, ``exp_avg`` and ``exp_avg_sq`` hash exactly as they did when N was taken."""
    monkeypatch.setenv(SLOW_PERSISTER, "0.01")
    model, opt = make_model()
    n = 4
    for s in range(n):
        train_step(model, opt, s)
    model.share_memory()
    for st in opt.state.values():
        for v in st.values():
            v.share_memory_()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    assert all(p.is_shared() for p in model.parameters())
    expected = digest(state)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        h = ck.save(state, n, StorageType.DISK)
        train_step(model, opt, n)  # in place: step += 1, exp_avg.lerp_, p.addcdiv_
        h.wait()
    on_disk = plain_load(snap_env.ckpt_dir, n)
    assert {int(st["step"]) for st in on_disk["optim"]["state"].values()} == {n}
    assert {int(st["step"]) for st in opt.state.values()} == {n + 1}
    assert digest(on_disk) == expected


def test_A3_training_continues_while_persister_writes(snap_env, monkeypatch):
    """A3. Fault: a slow persister is still serializing checkpoint k while training runs steps k+1,
    k+2, ... that rewrite every layer. Right behaviour: every layer in the file is from step k (no mix of
    layers from k and later steps), and so are the optimizer moments."""
    monkeypatch.setenv(SLOW_PERSISTER, "0.02")
    model, opt = make_model()
    for s in range(2):
        train_step(model, opt, s)
    state = train_state(model, opt, 2, [])
    per_layer = {k: tensor_digest(v) for k, v in state["model"].items()}
    expected = digest(state)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        h = ck.save(state, 2, StorageType.DISK)
        steps_during_persist = 0
        while steps_during_persist < 3 or (not h.done() and steps_during_persist < 500):
            train_step(model, opt, 2 + steps_during_persist)
            steps_during_persist += 1
        h.wait()
    on_disk = plain_load(snap_env.ckpt_dir, 2)
    mixed = [k for k, v in on_disk["model"].items() if tensor_digest(v) != per_layer[k]]
    assert not mixed, f"layers {mixed} do not hold step 2 ({steps_during_persist} steps ran during the persist)"
    assert digest(on_disk) == expected
    assert all(tensor_digest(v) != per_layer[k] for k, v in model.state_dict().items())


# --------------------------------------------------------------------- contract 2: no slot reuse early
def _distinct_state(step: int) -> dict:
    """A state whose every tensor (and counter) says which step it is from."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g) + step, "b": torch.full((257,), float(step)),
            "ids": torch.arange(step, step + 100), "step": step}


def test_A4_slow_persister_wait_policy_never_overwrites_a_slot_being_read(snap_env, monkeypatch):
    """A4 / contract 2, ``on_slot_busy="wait"``. Fault: a DISK snapshot every step, two slots, and a
    persister that sleeps before every write, so every slot is busy most of the time and the state
    (updated in place) changes between saves. Right behaviour: no snapshot is written into a slot the
    persister is still reading: every step is committed and each file equals its step's state at save
    time; a save that had to wait says so with a ``slot_wait`` event (not a ``skipped`` one: the
    snapshot was taken), before its ``snapshot_taken``."""
    monkeypatch.setenv(SLOW_PERSISTER, "0.02")
    events = []
    live = _distinct_state(0)
    expected = {}
    steps = list(range(1, 7))
    with Checkpointer(snap_env.ckpt_dir, slots_per_rank=2, on_slot_busy="wait", slot_wait_timeout_secs=120,
                      **OPTS) as ck:
        ck.add_listener(events.append)
        handles = []
        for step in steps:
            new = _distinct_state(step)
            for k in ("w", "b", "ids"):
                live[k].copy_(new[k])  # in place: the same storages every step
            live["step"] = step
            expected[step] = digest(live)
            h = ck.save(live, step, StorageType.DISK)
            assert h.snapshot_taken
            handles.append(h)
        for h in handles:
            h.wait()
    assert committed_steps(snap_env.ckpt_dir) == steps
    for step in steps:
        assert digest(plain_load(snap_env.ckpt_dir, step)) == expected[step], f"step {step} is torn"
    kinds = [(e.kind, e.step) for e in events]
    assert not [e for e in events if e.kind in ("skipped", "failed")], kinds
    waited = [e for e in events if e.kind == "slot_wait"]
    assert waited, f"no save waited for a slot under a slow persister: {kinds}"
    for e in waited:
        assert e.tier == StorageType.DISK and e.reason
        assert kinds.index(("slot_wait", e.step)) < kinds.index(("snapshot_taken", e.step))
    assert sorted(s for k, s in kinds if k == "committed") == steps


def test_A4_slow_persister_skip_policy_emits_skipped(snap_env, monkeypatch):
    """A4 / contract 2, ``on_slot_busy="skip"``, driven by a ``HookRegistry`` with a DISK snapshot every
    step. Fault: a slow persister holds every slot. Right behaviour: the snapshots that find no free slot
    are skipped with a ``skipped`` event (seen through ``HookRegistry.on`` and
    ``Checkpointer.add_listener`` alike, with a reason), no directory appears for them, every step that
    was taken is committed, and each committed file equals its step's state at save time."""
    monkeypatch.setenv(SLOW_PERSISTER, "0.02")
    live = _distinct_state(0)
    expected = {}
    from_hooks, from_listener = [], []

    def state_fn():
        expected[live["step"]] = digest(live)
        return live

    with Checkpointer(snap_env.ckpt_dir, slots_per_rank=2, on_slot_busy="skip", **OPTS) as ck:
        hooks = HookRegistry(ck, state_fn, SnapshotPolicy(disk_interval_steps=1))
        hooks.on("skipped", from_hooks.append)
        ck.add_listener(from_listener.append)
        for step in range(1, 9):
            hooks.before_optimizer_step()
            new = _distinct_state(step)
            for k in ("w", "b", "ids"):
                live[k].copy_(new[k])
            live["step"] = step
            hooks.step_end(step)
        hooks.train_end()
    skipped = sorted(e.step for e in from_hooks)
    assert skipped, "no snapshot was skipped although the persister held every slot"
    assert skipped == sorted(e.step for e in from_listener if e.kind == "skipped")
    assert all(e.reason and "slot" in e.reason for e in from_hooks)
    taken = sorted(e.step for e in from_listener if e.kind == "snapshot_taken")
    assert sorted(taken + skipped) == list(range(1, 9))
    assert committed_steps(snap_env.ckpt_dir) == taken
    assert not [n for n in os.listdir(snap_env.ckpt_dir) if any(f"step_{s:08d}" in n for s in skipped)]
    for step in taken:
        assert digest(plain_load(snap_env.ckpt_dir, step)) == expected[step], f"step {step} is torn"


# ------------------------------------------------------------------------ contract 3: no stale caches
def test_A5_stale_cache_replaced_tensors_new_groups_new_shapes(snap_env):
    """A5 / contract 3. Fault: between saves at steps 10, 20 and 30 the layout changes under a cached
    plan: the optimizer's state tensors are replaced by clones and two tied tensors are untied (10->20),
    a parameter group is added, a tensor is reshaped in place and another one grown past the arena
    slot's size (20->30). Right
    behaviour: each checkpoint equals the live state at its step (none repeats an earlier one or writes
    at a stale offset), and the Stager builds a new plan exactly when the layout changed."""
    model, opt = make_model()
    extra = nn.Parameter(torch.randn(5, 3))
    ema = torch.randn(15).view(5, 3)
    grow = torch.randn(8)
    tied = torch.randn(6)
    side = {"ema": ema, "grow": grow, "tied_a": tied, "tied_b": tied}
    expected = {}
    builds = {}

    def save(ck, step):
        state = {**train_state(model, opt, step, []), "side": dict(side)}
        expected[step] = digest(state)
        ck.save(state, step, StorageType.DISK).wait()
        builds[step] = ck._stager.plan_builds

    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        for s in range(10):
            train_step(model, opt, s)
        save(ck, 10)
        train_step(model, opt, 10)
        save(ck, 11)  # same layout, new values: the cached plan is reused
        for st in opt.state.values():
            st["exp_avg"] = st["exp_avg"].clone()
            st["exp_avg_sq"] = st["exp_avg_sq"].clone()
        side["tied_b"] = side["tied_b"].clone().mul_(-1)
        for s in range(11, 20):
            train_step(model, opt, s)
        save(ck, 20)
        opt.add_param_group({"params": [extra], "lr": 5e-3})
        ema.resize_(3, 5).mul_(2)  # same storage, same bytes count, new shape
        grow.resize_(100_000).uniform_()  # reallocated, 32 B -> 400 KB: the arena slots must grow
        for s in range(20, 30):
            extra.grad = torch.ones_like(extra)
            train_step(model, opt, s)
        save(ck, 30)
        from_memory = ck.load()
        assert ck.last_load.step == 30 and digest(from_memory) == expected[30]
    assert builds[11] == builds[10], "a save with an unchanged layout rebuilt its plan"
    assert builds[20] > builds[11], "untied tensors (a new aliasing) did not invalidate the cached plan"
    assert builds[30] > builds[20], "a new param group and new shapes did not invalidate the cached plan"
    for step in (10, 11, 20, 30):
        assert digest(plain_load(snap_env.ckpt_dir, step)) == expected[step], f"step {step}"
    assert len({expected[s] for s in (10, 11, 20, 30)}) == 4
    at30 = plain_load(snap_env.ckpt_dir, 30)
    assert len(at30["optim"]["param_groups"]) == 2
    assert at30["side"]["ema"].shape == (3, 5) and at30["side"]["grow"].shape == (100_000,)
    assert storage_of(at30["side"]["tied_a"]) != storage_of(at30["side"]["tied_b"])
    at10 = plain_load(snap_env.ckpt_dir, 10)
    assert storage_of(at10["side"]["tied_a"]) == storage_of(at10["side"]["tied_b"])


class _Opaque:
    """A pickled global nobody registers with ``torch.serialization.add_safe_globals`` (megatron-core registers
    ``argparse.Namespace`` when imported, so an in-process Megatron test earlier in the worker made it safe)."""

    def __init__(self, step):
        self.step = step

    def __repr__(self):  # digest() compares values by repr
        return f"_Opaque({self.step})"


def test_A5_fresh_allocations_of_one_layout_reuse_the_plan_and_save_their_own_values(snap_env, caplog):
    """Contract 3, the other direction. Fault: the state holds tensors allocated anew at every save (a
    fresh ``torch.get_rng_state()`` and RNG record, as every integration's sidecar does; optimizer state
    replaced by clones) with an unchanged layout. A cache keyed on raw data pointers rebuilt the plan (and
    re-ran the weights-only check, about 0.2 s on the training thread for 2,000 tensors) at every save.
    Right behaviour: one plan for the whole run, one weights-only warning, and every checkpoint equals the
    live state of its own step (the copy sources are the live tensors, never ones cached with the plan)."""
    import logging

    from snapckpt import rng

    model, opt = make_model()
    expected = {}
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck, caplog.at_level(logging.WARNING, "snapckpt"):
        for step in range(1, 7):
            train_step(model, opt, step)
            for st in opt.state.values():
                st["exp_avg"] = st["exp_avg"].clone()
            # an object pickles as a global that load() (weights_only=True) refuses: warned once
            state = {**train_state(model, opt, step, []), "rng": rng.capture(), "lr": torch.tensor(0.1 * step),
                     "args": _Opaque(step)}
            expected[step] = digest(state)
            ck.save(state, step, StorageType.DISK).wait()
        builds = ck._stager.plan_builds
    assert builds == 1, f"{builds} plans built for 6 saves of one layout"
    warned = [r for r in caplog.records if "load() will refuse it" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    for step in range(1, 7):
        got = torch.load(rank_file(snap_env.ckpt_dir, step), weights_only=False)
        assert digest(got) == expected[step], f"step {step}"
    assert len(set(expected.values())) == 6


# ------------------------------------------------------------------ contract 9: aliasing from storage
class _TiedLM(nn.Module):
    """A tiny LM whose head shares the embedding's Parameter (GPT-2 style) unless ``tie=False``."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def _aliasing_state():
    torch.manual_seed(0)
    tied = _TiedLM(tie=True)
    untied = _TiedLM(tie=False)  # "config says tied", tensors separate
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.wte.weight)  # equal values, separate storages
    shared_param = nn.Parameter(torch.randn(4, 4))
    buf = torch.arange(60, dtype=torch.float32)
    return {
        "tied": tied.state_dict(),  # two keys, two tensor objects, one storage
        "untied": untied.state_dict(),
        "same_param": {"embed": shared_param, "head": shared_param},  # two keys, one Parameter object
        "views": {"rows": buf.view(6, 10)[1:3], "overlap": buf[15:40], "t": buf.view(6, 10).t()},
        "separate": {"x": buf.clone(), "y": buf.clone()},
    }


def _check_aliasing(out, where: str) -> None:
    t = out["tied"]
    assert storage_of(t["wte.weight"]) == storage_of(t["lm_head.weight"]), f"{where}: tied weights untied"
    u = out["untied"]
    assert torch.equal(u["wte.weight"], u["lm_head.weight"])
    assert storage_of(u["wte.weight"]) != storage_of(u["lm_head.weight"]), f"{where}: separate weights tied"
    sp = out["same_param"]
    assert isinstance(sp["embed"], nn.Parameter) and storage_of(sp["embed"]) == storage_of(sp["head"]), where
    v = out["views"]
    assert len({storage_of(v["rows"]), storage_of(v["overlap"]), storage_of(v["t"])}) == 1, \
        f"{where}: views of one buffer lost their common storage"
    v["overlap"][0] = -1.0  # element 15 of the buffer: row 1, column 5
    assert v["rows"][0, 5] == -1.0 and v["t"][5, 1] == -1.0, f"{where}: views do not alias"
    s = out["separate"]
    assert storage_of(s["x"]) != storage_of(s["y"]), f"{where}: separate tensors came back shared"
    s["x"][0] = 99.0
    assert s["y"][0] == 0.0


def test_E1_aliasing_comes_back_from_storage_memory_and_disk(snap_env):
    """E1 / contract 9. Fault: aliasing that only the storage shows: GPT-2-style tied weights (two state
    dict keys, one storage), one Parameter under two keys, three overlapping views of one buffer; and the
    converse, a model that "ties" by config but holds two separate equal tensors, and two equal clones.
    Right behaviour: after load from memory, from disk through snapckpt and through stock torch.load, the
    shared ones share one storage (a write through one is seen through the other) and the separate ones
    stay separate; a fresh tied model loads the state strictly and stays tied."""
    state = _aliasing_state()
    expected = digest(state)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        ck.save(state, 1, StorageType.DISK).wait()
        from_memory = ck.load()
        assert ck.last_load.tier == StorageType.MEMORY
    assert digest(from_memory) == expected
    _check_aliasing(from_memory, "memory")
    plain = plain_load(snap_env.ckpt_dir, 1)
    assert digest(plain) == expected
    _check_aliasing(plain, "stock torch.load")
    wait_persisters_gone(snap_env)  # the memory tier is gone with it: the next load reads the disk
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        from_disk = ck.load()
        assert ck.last_load.tier == StorageType.DISK
    assert digest(from_disk) == expected
    _check_aliasing(from_disk, "disk")
    fresh = _TiedLM(tie=True)
    fresh.load_state_dict(from_disk["tied"], strict=True)
    assert fresh.lm_head.weight is fresh.wte.weight
    assert torch.equal(fresh.wte.weight, state["tied"]["wte.weight"])


# ---------------------------------------------------------------------------------- D3: views and size
def test_D3_view_into_large_buffer_writes_only_the_view(snap_env):
    """D3. Fault: the state holds a 4 KiB view and a 2 KiB strided view, 16 MiB apart, into one 64 MiB
    buffer; ``torch.save`` would write the whole buffer (and a single span over both views, 16 MiB).
    Right behaviour: the file and the bytes copied into the arena are about the size of the views, and
    the views' values come back intact from disk and from memory."""
    big = torch.arange(16 * 1024 * 1024, dtype=torch.float32)  # 64 MiB
    view = big[1_000_003:1_001_027]  # 1024 floats, not aligned to anything
    nested = big[5_000_000:5_000_512].view(16, 32)[:, ::2]  # a strided view of a view
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        h = ck.save({"v": view, "n": nested}, 1, StorageType.DISK)
        h.wait()
        assert h.stats.tensor_nbytes < 16 * 1024
        from_memory = ck.load()
        assert torch.equal(from_memory["v"], view) and torch.equal(from_memory["n"], nested)
    size = os.path.getsize(rank_file(snap_env.ckpt_dir, 1))
    assert size < 64 * 1024, f"{size} bytes written for 6 KiB of views into a 64 MiB buffer"
    out = plain_load(snap_env.ckpt_dir, 1)
    assert torch.equal(out["v"], view) and torch.equal(out["n"], nested)
    assert out["v"].untyped_storage().nbytes() < 16 * 1024 and out["n"].untyped_storage().nbytes() < 16 * 1024


# --------------------------------------------------------------------------------- E4: dtype and shape
def test_E4_float64_checkpoint_casts_into_float32_state_and_shape_mismatch_names_key(snap_env):
    """E4. Fault: a state saved in float64 is loaded into a float32 model's state dict; then into a model
    whose layer has another shape. Right behaviour: ``ck.load(state_dict=...)`` casts into the live
    float32 tensors in place (the optimizer keeps working: no failure later inside ``step()``); a shape
    mismatch raises ``IncompatibleCheckpointError`` naming every mismatched key, before copying anything
    (a refused load leaves the live state as it was: found by a new-user trial)."""
    torch.manual_seed(0)
    src = nn.Linear(8, 4).double()
    saved = {k: v.clone() for k, v in src.state_dict().items()}
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        ck.save({"model": src.state_dict(), "step": 7}, 7, StorageType.DISK).wait()
        dst = nn.Linear(8, 4)
        opt = torch.optim.AdamW(dst.parameters(), lr=1e-3)
        weight_before = dst.weight
        target = {"model": dst.state_dict(), "step": 0}
        got = ck.load(state_dict=target)
        assert got is target and got["step"] == 7
        assert dst.weight is weight_before and dst.weight.dtype == torch.float32
        for k, v in saved.items():
            live = dict(dst.named_parameters())[k]
            assert live.dtype == torch.float32 and torch.equal(live.detach(), v.float())
        dst(torch.randn(2, 8)).sum().backward()
        opt.step()  # would fail (or silently compute in float64) had the tensors been replaced
        assert dst.weight.dtype == torch.float32
        wrong = nn.Linear(8, 5)
        with pytest.raises(IncompatibleCheckpointError, match=r"model\.weight") as ei:
            ck.load(state_dict={"model": wrong.state_dict()})
        assert "model.bias" in str(ei.value) and "nothing was copied" in str(ei.value)
        # A refused load changes nothing: the weight fits and comes first, the bias does not.
        half = {"model": {"weight": torch.zeros(4, 8), "bias": torch.zeros(5)}, "step": 0}
        with pytest.raises(IncompatibleCheckpointError, match=r"model\.bias"):
            ck.load(state_dict=half)
        assert torch.equal(half["model"]["weight"], torch.zeros(4, 8)) and half["step"] == 0


# ------------------------------------------------------------------- format: stock torch.load round trip
def _format_state():
    torch.manual_seed(0)
    base = torch.arange(40, dtype=torch.float32).view(5, 8)
    p = nn.Parameter(torch.randn(3, 4))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    return {
        "param": p,
        "frozen_param": frozen,
        "grad_tensor": torch.randn(3, requires_grad=True),
        "base": base,
        "row_view": base[1],
        "col_slice": base[:, 2:5],
        "transposed": base.t(),
        "strided": base[::2, ::3],
        "expanded": torch.randn(3, 1).expand(3, 4),
        "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(3, dtype=torch.float16),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "int64": torch.arange(9, dtype=torch.int64) - 4,
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.randn(2, dtype=torch.complex64),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(3, 0, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "nested": [(base[0], [torch.ones(2), {"k": torch.zeros(1, dtype=torch.bool)}]),
                   collections.OrderedDict(a=torch.arange(3), b=(1, 2.5, "s", None, True))],
        "plain": {"int": 3, "float": 0.1, "str": "x", "none": None, "tuple": (1, (2, 3)), "list": [[], {}]},
    }


def _sharing_pattern(obj) -> list:
    """Which tensors (by path) share a storage: a partition of the tensor paths."""
    groups = collections.defaultdict(list)

    def walk(o, path):
        if isinstance(o, torch.Tensor):
            if o.untyped_storage().nbytes():
                groups[storage_of(o)].append(path)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{path}.{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")

    walk(obj, "")
    return sorted(sorted(g) for g in groups.values())


def test_file_loads_with_stock_torch_load_and_equals_torch_save(snap_env, tmp_path):
    """Format round trip. Fault: a file that only snapckpt can read, or that differs from what
    ``torch.save`` gives for the same state (Parameters, views, non-contiguous / transposed / expanded /
    channels-last tensors, bf16/f16/int/bool/complex dtypes, empty and 0-dim tensors, nested
    lists/tuples/OrderedDict). Right behaviour: stock ``torch.load(weights_only=True)`` reads the file,
    and what it returns equals ``torch.save``'s round trip of the same state in types, dtypes, shapes,
    strides, requires_grad, values and storage sharing; so does snapckpt's memory tier."""
    state = _format_state()
    ref_path = tmp_path / "ref.pt"
    torch.save(state, ref_path)
    ref = torch.load(ref_path, weights_only=True)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        ck.save(state, 1, StorageType.DISK).wait()
        from_memory = ck.load()
    got = plain_load(snap_env.ckpt_dir, 1)
    assert_equal_state(got, ref, strict=True)
    assert _sharing_pattern(got) == _sharing_pattern(ref)
    assert_equal_state(from_memory, ref, strict=True)
    assert _sharing_pattern(from_memory) == _sharing_pattern(ref)


# ---------------------------------------------------------------------------- E5/E6: user classes
def test_E5_E6_user_class_in_training_script_and_weights_only(snap_env):
    """E5/E6. Fault: the state holds an instance of a class defined in the training script (``__main__``
    of the worker, importable by no other process) and an ``argparse.Namespace``. Right behaviour: the
    persister writes and commits it without importing anything; with ``weights_only=True`` (default)
    snapckpt refuses it from memory and from disk with ``UnsafeCheckpointError`` that says how to trust
    it; with ``weights_only=False`` it loads from disk and from memory, equal to what was saved. Stock
    ``torch.load`` agrees: ``weights_only=True`` refuses, ``weights_only=False`` loads."""
    out = run_ranks("user_class_state.py", 1, [snap_env.ckpt_dir], snap_env.env, timeout=150)
    res = json.loads(result_lines(out[0])[-1])
    assert res["A_commit"] == "committed", res
    assert res["A_memory_safe"] == "UnsafeCheckpointError", res
    assert "weights_only=False" in res["A_memory_safe_msg"], res
    assert (res["B_disk_trusted"], res["B_disk_trusted_tier"]) == ("loaded", "disk"), res
    assert res["B_disk_trusted_equal"], res
    assert (res["B_memory_trusted"], res["B_memory_trusted_tier"]) == ("loaded", "memory"), res
    assert res["B_memory_trusted_equal"], res
    assert res["C_disk_safe"] == "UnsafeCheckpointError", res
    assert "weights_only=False" in res["C_disk_safe_msg"], res
    assert res["stock_weights_only"] == "refused", res
    assert res["stock_trusted_equal"], res


# ------------------------------------------------------------------------------------- overlapped copy
def test_overlap_copy_runs_until_fence_then_isolates(snap_env):
    """Contract 1 with ``overlap=True``: ``save`` returns while the copy thread copies; the training loop
    runs its forward/backward (which do not touch the weights) and calls ``fence()`` before the optimizer
    step, as the hooks and the integrations do. Right behaviour: after the fence the snapshot is taken
    (the handle says so, ``snapshot_taken`` fired), the optimizer step and in-place edits that follow do
    not reach it, and every tier holds exactly the state of step N; ``wait``/``load`` fence by themselves."""
    model, opt = make_model()
    history = [train_step(model, opt, s) for s in range(2)]
    events = []
    with Checkpointer(snap_env.ckpt_dir, overlap=True, **OPTS) as ck:
        ck.add_listener(lambda e: events.append(e.kind))
        for n in (2, 3, 4):
            state = train_state(model, opt, n, history)
            expected = digest(state)
            h = ck.save(state, n, StorageType.DISK if n == 3 else StorageType.MEMORY)
            loss = model(torch.randn(8, 16)).sum()  # forward/backward while the copy runs
            loss.backward()
            ck.fence()  # before the optimizer step
            assert h.snapshot_taken and ck.last_stats.step == n and ck.last_stats.copy_secs >= 0
            history.append(train_step(model, opt, n))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            if n == 3:
                h.wait()
                assert digest(plain_load(snap_env.ckpt_dir, 3)) == expected
        assert events.count("snapshot_taken") == 3 and "committed" in events
        state = train_state(model, opt, 5, history)
        expected = digest(state)
        ck.save(state, 5, StorageType.MEMORY)
        assert digest(ck.load()) == expected  # load fences first
        assert ck.last_load.step == 5 and ck.last_load.tier == StorageType.MEMORY


def test_overlap_copy_failure_is_raised_at_fence(snap_env, monkeypatch):
    """A copy that fails on the copy thread (here: an injected error) is raised on the training thread at
    ``fence()`` with its own type; the slot is freed, nothing of that step is held or written, and the
    next save works."""
    from snapckpt.engine import saver as ck_mod

    def boom(prepared, mapped, device_done=None):
        raise MemoryError("injected copy failure")

    model, opt = make_model()
    state = train_state(model, opt, 1, [])
    with Checkpointer(snap_env.ckpt_dir, overlap=True, **OPTS) as ck:
        monkeypatch.setattr(ck_mod, "_timed_copy", boom)
        h = ck.save(state, 1, StorageType.DISK)
        with pytest.raises(MemoryError, match="injected"):
            ck.fence()
        assert not h.snapshot_taken and isinstance(h.exception(), MemoryError)
        monkeypatch.undo()
        ck.save(state, 2, StorageType.DISK).wait()
        assert ck.latest_step() == 2
    assert sorted(n for n in os.listdir(snap_env.ckpt_dir) if n.startswith("step_")) == ["step_00000002"]


def test_B3_flipped_byte_in_a_record_read_straight_into_live_tensors_falls_back(snap_env):
    """A disk load into live tensors reads records of 1 MiB or more straight into them
    (``snapckpt.engine.disk_restore``, one reader thread, the checksum on another): a flipped byte in such a
    record fails the checksum before ``load`` returns, and the previous step is loaded over every tensor."""
    n = 1 << 20  # 4 MiB of float32: a record read straight into live["w"]
    with Checkpointer(snap_env.ckpt_dir, keep_last=2, **OPTS) as ck:
        for step in (1, 2):
            ck.save({"w": torch.full((n,), float(step)), "b": torch.full((4,), float(step))}, step,
                    StorageType.DISK).wait()
    assert wait_until(lambda: not snap_env.shm_files(), timeout=15)  # the persister left: disk only
    path = os.path.join(snap_env.ckpt_dir, "step_00000002", "rank_00000.pt")
    with open(path, "r+b") as f:  # the middle of the file is inside w's record
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    live = {"w": torch.zeros(n), "b": torch.zeros(4)}
    live_w = live["w"]
    with Checkpointer(snap_env.ckpt_dir, keep_last=2, **OPTS) as ck:
        ck.load(live)
        assert ck.last_load.step == 1 and ck.last_load.tier == StorageType.DISK
        assert "step_00000002" in " ".join(ck.last_load.skipped), ck.last_load
        assert live["w"] is live_w and torch.equal(live_w, torch.full((n,), 1.0))
        assert torch.equal(live["b"], torch.full((4,), 1.0))


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_A2_load_into_live_state_copies_and_never_aliases_the_arena_or_files(snap_env, tier):
    """``load(state_dict)`` reads a memory snapshot as views of the arena slot (a disk checkpoint as a memory
    map of its files) and copies them into the live tensors. Values the live state lacks (a fresh
    optimizer's empty ``state``) are inserted as deep copies: later snapshots into the same slots and
    deleting the checkpoint never change them, and two inserted tensors that shared storage still do."""
    w = torch.arange(12.0)
    saved = {"model": {"w": w.clone()}, "optim": {"state": {0: {"exp_avg": torch.full((12,), 7.0)}}},
             "tied": {"a": w, "b": w[:6]}, "step": 5}
    def other(step):
        return {"model": {"w": torch.full((12,), -1.0)},
                "optim": {"state": {0: {"exp_avg": torch.full((12,), -1.0)}}},
                "tied": {"a": torch.full((12,), -1.0), "b": torch.full((6,), -1.0)}, "step": step}

    with Checkpointer(snap_env.ckpt_dir, keep_last=1, **OPTS) as ck:
        st = StorageType.MEMORY if tier == "memory" else StorageType.DISK
        ck.save(saved, 5, st).wait()
        if tier == "disk":  # newer memory snapshots take both slots: step 5 is on disk only
            for step in (6, 7):
                ck.save(other(step), step, StorageType.MEMORY).wait()
        live = {"model": {"w": torch.zeros(12)}, "optim": {"state": {}}}
        live_w = live["model"]["w"]
        ck.load(live, step=5)
        assert ck.last_load.tier == st
        assert live["model"]["w"] is live_w and torch.equal(live_w, torch.arange(12.0))
        inserted = live["optim"]["state"][0]["exp_avg"]
        assert torch.equal(inserted, torch.full((12,), 7.0)) and live["step"] == 5
        a, b = live["tied"]["a"], live["tied"]["b"]
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        # Overwrite every slot with other values (and, for disk, retire step 5's directory).
        for step in (8, 9, 10):
            ck.save(other(step), step, st).wait()
        assert torch.equal(inserted, torch.full((12,), 7.0))
        assert torch.equal(a, torch.arange(12.0)) and torch.equal(b, torch.arange(6.0))
        a.add_(100)  # the caller owns it: writing to it changes nothing held by snapckpt
        assert torch.equal(b, torch.arange(6.0) + 100)
        assert not os.path.exists(os.path.join(snap_env.ckpt_dir, "step_00000005"))
        assert torch.equal(ck.load(step=10)["model"]["w"], torch.full((12,), -1.0))
