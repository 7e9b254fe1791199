"""The memory-tier restore of a slot this process wrote (snapckpt.engine.slot_restore): one copy per tensor when
the slot and the live state are of the saved layout; the general path (None) whenever either differs."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch

from snapckpt.engine import slot_restore
from snapckpt.engine.stager import Stager
from snapckpt.persister.arena import read_header

NAME = "s.pt"


def _slot(nbytes: int = 1 << 20) -> SimpleNamespace:
    buf = bytearray(nbytes)  # what a MappedSlot holds: the buffer, a uint8 tensor over it, the views cache
    return SimpleNamespace(buf=buf, tensor=torch.frombuffer(buf, dtype=torch.uint8), views={})


def _save(stager: Stager, m: SimpleNamespace, state, step: int, name: str = NAME) -> None:
    p = stager.prepare({name: state}, step)
    p.views = m.views
    Stager.copy_into(p, m.tensor, m.buf)


def _state() -> dict:
    return {"model": {f"w{i}": torch.rand(3, 2) for i in range(20)},
            "opt": {"state": {0: {"exp_avg": torch.rand(4), "step": torch.tensor(3.0)}}, "lr": 0.1},
            "p": torch.nn.Parameter(torch.rand(2)), "iteration": 7}


def _copy_of(state: dict) -> dict:
    return {k: (_copy_of(v) if isinstance(v, dict) else v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}


def _assert_equal(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_a_slot_of_the_saved_layout_is_copied_into_the_live_tensors_in_place():
    stager, m, state = Stager(), _slot(), _state()
    _save(stager, m, state, 1)
    saved, live = _copy_of(state), list(state["model"].values())
    for t in live:
        t.add_(1.0)  # training went on
    with torch.no_grad():
        state["p"].mul_(2)
    found = slot_restore.find(stager, m, NAME, 1, state)
    assert found is not None and len(found.dsts) == 23
    found.run()
    _assert_equal(state, saved)
    assert list(state["model"].values()) == live  # in place: the same tensor objects
    assert state["p"].requires_grad and type(state["p"]) is torch.nn.Parameter


def test_a_live_state_of_another_dtype_is_cast_as_copy_into_does():
    stager, m, state = Stager(), _slot(), _state()
    _save(stager, m, state, 1)
    saved = _copy_of(state)
    live = _copy_of(state)
    live["model"] = {k: torch.zeros(3, 2, dtype=torch.float64) for k in live["model"]}
    found = slot_restore.find(stager, m, NAME, 1, live)
    assert found is not None
    found.run()
    assert all(torch.equal(live["model"][k], saved["model"][k].double()) for k in saved["model"])


def test_anything_else_takes_the_general_path():
    """A state or slot that differs from the saved layout in any way is not restored here (None)."""
    def changed(change):
        stager, m, state = Stager(), _slot(), _state()
        _save(stager, m, state, 1)
        live = _copy_of(state)
        change(live)
        return slot_restore.find(stager, m, NAME, 1, live)

    assert changed(lambda s: None) is not None  # the control: an equal state is restored here
    assert changed(lambda s: s.__setitem__("iteration", 8)) is None  # a value the restore must replace
    assert changed(lambda s: s["opt"].__setitem__("lr", 0.2)) is None
    assert changed(lambda s: s.__setitem__("extra", torch.rand(2))) is None  # a tensor the slot lacks
    assert changed(lambda s: s["model"].pop("w3")) is None
    assert changed(lambda s: s["model"].__setitem__("w3", torch.rand(2, 3))) is None  # another shape

    stager, m, state = Stager(), _slot(), _state()
    _save(stager, m, state, 1)
    assert slot_restore.find(stager, m, NAME, 2, state) is None  # the slot holds another step
    assert slot_restore.find(stager, m, "other.pt", 1, state) is None  # another file
    assert slot_restore.find(stager, _slot(), NAME, 1, state) is None  # a mapping this process never wrote
    _save(stager, m, {"x": torch.rand(5)}, 2)  # the slot rewritten with another layout
    assert slot_restore.find(stager, m, NAME, 2, state) is None
    _save(stager, m, state, 3)
    _, off, _n = read_header(m.buf)  # the slot's own index (older ones may lie before it in the buffer)
    m.buf[m.buf.index(b'"records"', off) + 12] ^= 1  # its index no longer what this layout wrote (a fetch, damage)
    assert slot_restore.find(stager, m, NAME, 3, state) is None
    _save(stager, m, state, 3)
    assert slot_restore.find(stager, m, NAME, 3, state) is not None  # the control
    _, off, _n = read_header(m.buf)
    at = json.loads(bytes(m.buf[off:off + _n]))["values"][0]
    m.buf[at + 2] ^= 1  # the plain restore's values (snapckpt.engine.plain_values) no longer the saved ones
    assert slot_restore.find(stager, m, NAME, 3, state) is None


def test_a_live_tensor_put_in_place_of_another_takes_the_general_path():
    """The live state found by the memo of its saves (same keys and types) with one tensor object in two places:
    its layout is not the saved one (the second place is a reference to the first), so it is not restored here,
    whether or not the save's quick check holds (another dtype: the shapes are compared instead)."""
    for dtype in (torch.float32, torch.float64):
        stager, m, state = Stager(), _slot(), _state()
        for step in range(3):  # the second save makes the memo, the third uses it
            _save(stager, m, state, step)
        live = {**state, "model": {k: v.to(dtype) for k, v in state["model"].items()}}
        assert slot_restore.find(stager, m, NAME, 2, live) is not None  # the control
        live["model"]["w1"] = live["model"]["w0"]
        assert slot_restore.find(stager, m, NAME, 2, live) is None, dtype


def test_a_tensor_in_a_list_keeps_copy_into_semantics():
    """copy_into replaces a list (tensors in it are deep copies), it does not copy into its tensors: such a state
    is left to the general path, whether its walk or its memo (made by the second save) finds it."""
    for saves in (1, 3):
        stager, m = Stager(), _slot()
        state = {"w": torch.rand(2), "hist": [torch.rand(2)], "it": 0}
        for step in range(1, saves + 1):
            state["it"] = step
            _save(stager, m, state, step)
        assert slot_restore.find(stager, m, NAME, saves, state) is None, saves
        plain = {"w": torch.rand(2), "betas": [0.9, 0.99], "it": 0}  # a list of values only: restored here
        for step in range(saves + 1, 2 * saves + 1):
            plain["it"] = step
            _save(stager, m, plain, step)
        assert slot_restore.find(stager, m, NAME, 2 * saves, plain) is not None, saves


def test_a_state_its_memo_finds_is_not_walked_for_copy_intos_in_place_check(monkeypatch):
    """Whether copy_into copies every tensor in place is a property of the state's structure: the memo's, found once
    when the memo is made (a save that walks anyway); a restore after a save whose values changed (a new skeleton)
    does not walk the state for it, and still restores the saved bytes and values."""
    calls = [0]
    real = slot_restore._copied_in_place

    def counting(obj, out):
        calls[0] += 1
        real(obj, out)

    monkeypatch.setattr(slot_restore, "_copied_in_place", counting)
    stager, m, state = Stager(), _slot(), _state()
    for step in range(1, 5):  # the second save makes the memo; each save a new iteration (a new skeleton)
        state["iteration"] = step
        _save(stager, m, state, step)
        saved = _copy_of(state)
        for t in state["model"].values():
            t.add_(1.0)  # training went on
        found = slot_restore.find(stager, m, NAME, step, state)
        assert found is not None, step
        found.run()
        _assert_equal(state, saved)
        assert (calls[0] > 0) == (step == 1), step  # the first: no memo yet, its layout's walk
        calls[0] = 0


def test_the_tensors_copied_in_place_are_those_copy_into_copies():
    """slot_restore's walk finds exactly the tensors (and order) that copy_into copies in place."""
    from collections import OrderedDict

    from snapckpt.engine.restore import _gather

    t = [torch.rand(2) for _ in range(8)]
    states = [
        {"a": t[0], "b": {"c": t[1], "d": 3, "e": {"f": t[2]}}, "g": [t[3], {"h": t[4]}], "i": (t[5],)},
        OrderedDict(x=t[0], y=OrderedDict(z=t[1]), w=[0.9, 0.99]),
        {f"p{i}": t[i] for i in range(8)},  # a dict of tensors only: one C-level pass
        {"groups": [{"params": [0, 1], "w": t[6]}], "state": {0: {"m": t[7], "step": 2}}},
        t[0],
    ]
    for s in states:
        want: list = []
        _gather(s, s, want, [], [])
        got: list = []
        slot_restore._copied_in_place(s, got)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_a_live_tensor_put_in_place_of_another_in_another_chunk_of_the_check_takes_the_general_path(monkeypatch):
    """The save's quick check reads the tensors in chunks (layout_check.CHUNK); its guards see a tensor object met twice
    within a chunk only: one met in two chunks is still seen."""
    from snapckpt.engine import layout_check

    monkeypatch.setattr(layout_check, "CHUNK", 3)
    stager, m, state = Stager(), _slot(), _state()
    for step in range(3):  # the second save makes the memo, the third uses it
        _save(stager, m, state, step)
    assert len(next(iter(stager._layouts.values())).recheck.chunks) == 8
    live = {**state, "model": dict(state["model"])}
    assert slot_restore.find(stager, m, NAME, 2, live) is not None  # the control
    live["model"]["w1"] = live["model"]["w15"]
    assert slot_restore.find(stager, m, NAME, 2, live) is None


def test_a_tensor_met_twice_takes_the_general_path():
    """The live state's walk leaves a tensor met twice to this module's check (a memo's match, or plain_layout with
    ``distinct_tensors=False``, which skips the look-up of a dict of many tensors): a live state that holds one tensor
    object at two keys of such a dict, whose key then reads as the saved one, is refused, with or without a memo."""
    for saves in (1, 2):  # one save: no memo yet (the walk); two: the memo's match
        stager, m = Stager(), _slot()
        state = {"model": {f"w{i}": torch.rand(3, 2) for i in range(20)}, "iteration": 7}
        for step in range(1, saves + 1):
            _save(stager, m, state, step)
        live = {"model": {f"w{i}": torch.zeros(3, 2) for i in range(20)}, "iteration": 7}
        assert slot_restore.find(stager, m, NAME, saves, live) is not None  # the control
        live["model"]["w5"] = live["model"]["w3"]
        assert slot_restore.find(stager, m, NAME, saves, live) is None, saves


def test_a_restore_split_among_threads_copies_every_tensor_in_place_parameters_included(monkeypatch):
    """With the small tensors' bytes over ``mover.SPLIT_NBYTES`` the copy is split among the calling thread and a
    helper (``mover.foreach_copy``): every tensor, a Parameter that requires grad among them, gets the saved values in
    place, its version bumped, and grad mode is left as it was. The split is the layout's, made at its first restore
    (not at each): a restore again makes none, one with another thread count makes its own."""
    from snapckpt.engine import mover

    monkeypatch.setattr(mover, "SPLIT_NBYTES", 1)
    parts, made = [], []
    run, split_of = mover._pool.run, mover.split_of
    monkeypatch.setattr(mover._pool, "run", lambda items, helpers, fn: (parts.append(len(items)),
                                                                        run(items, helpers, fn)))
    monkeypatch.setattr(mover, "split_of", lambda nbytes, threads: made.append(threads) or split_of(nbytes, threads))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    stager, m, state = Stager(), _slot(), _state()
    state["model"].update({f"p{i}": torch.nn.Parameter(torch.rand(5, 3)) for i in range(6)})
    _save(stager, m, state, 1)
    saved = _copy_of(state)
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    versions = [t._version for t in state["model"].values()]
    found = slot_restore.find(stager, m, NAME, 1, state)
    assert found is not None and found.back is None
    found.run()
    assert parts == [4] and torch.is_grad_enabled()
    _assert_equal(state, saved)
    assert all(t._version > v for t, v in zip(state["model"].values(), versions))
    assert all(t.requires_grad for k, t in state["model"].items() if k.startswith("p"))

    # (one thread, not three: a third would leave a second helper in the process's pool for the next tests)
    for threads, want, runs in ((2, [2], [4, 4]), (1, [2, 1], [4, 4])):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        with torch.no_grad():
            for t in state["model"].values():
                t.add_(1.0)
        slot_restore.find(stager, m, NAME, 1, state).run()
        _assert_equal(state, saved)
        assert (made, parts) == (want, runs)


def _inference_copy(state: dict, parameter: bool = False) -> dict:
    """A copy of ``state`` made under torch.inference_mode() (``p`` a Parameter again with ``parameter``), its model
    zeroed."""
    with torch.inference_mode():
        live = _copy_of(state)
        if parameter:
            live["p"] = torch.nn.Parameter(live["p"])
        for t in live["model"].values():
            t.zero_()
    return live


def _refused(stager: Stager, m: SimpleNamespace, live: dict):
    """The restore of step 1 into ``live`` (inference tensors) outside inference mode: torch's refusal, nothing
    written. Returns the restore found."""
    before = _copy_of(live)
    found = slot_restore.find(stager, m, NAME, 1, live)
    assert found is not None
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        found.run()
    _assert_equal(live, before)
    return found


def test_a_live_state_made_under_inference_mode_is_refused_before_anything_is_written():
    """Saved from normal tensors, restored into the same layout made under torch.inference_mode() (a model rebuilt
    for evaluation): torch's refusal of their copy_, before any tensor is written (torch's own copy_ writes the
    first, then raises); inside inference mode they are restored."""
    stager, m, state = Stager(), _slot(), _state()
    _save(stager, m, state, 1)
    live = _inference_copy(state)
    found = _refused(stager, m, live)
    with torch.inference_mode():
        found.run()
    _assert_equal(live, _copy_of(state))


def test_a_save_made_inside_inference_mode_then_inference_tensors_restored_outside_it_are_refused():
    """A save taken inside torch.inference_mode() (whose quick check, made there, passes inference tensors outside
    it), a normal state restored, then one of the same layout made under inference mode: refused, nothing written."""
    stager, m, state = Stager(), _slot(), _state()
    with torch.inference_mode():
        _save(stager, m, state, 1)
    slot_restore.find(stager, m, NAME, 1, state).run()  # normal tensors: restored
    _assert_equal(state, _copy_of(state))
    _refused(stager, m, _inference_copy(state, parameter=True))


def test_a_restore_split_among_threads_inside_inference_mode_copies_on_every_thread(monkeypatch):
    """Inference mode is per thread, as grad mode: a live state made under ``torch.inference_mode()`` and restored
    inside it, with the copy split among threads, is copied by the helper in inference mode too (outside it the
    helper's part raised torch's refusal)."""
    from snapckpt.engine import mover

    monkeypatch.setattr(mover, "SPLIT_NBYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    stager, m, state = Stager(), _slot(), _state()
    _save(stager, m, state, 1)
    with torch.inference_mode():
        live = _copy_of(state)
        for t in live["model"].values():
            t.zero_()
        found = slot_restore.find(stager, m, NAME, 1, live)
        assert found is not None
        threads, helper_in, me = set(), threading.Event(), threading.get_ident()
        run = mover._pool.run

        def part(fn):
            def go(d, s, *inference):  # the calling thread waits in its first part until the helper took one
                threads.add(threading.get_ident())
                if threading.get_ident() != me:
                    helper_in.set()
                else:
                    assert helper_in.wait(30)
                fn(d, s, *inference)
            return go

        monkeypatch.setattr(mover._pool, "run", lambda items, helpers, fn: run(items, helpers, part(fn)))
        found.run()
    assert len(threads) == 2, threads
    _assert_equal(live, _copy_of(state))
