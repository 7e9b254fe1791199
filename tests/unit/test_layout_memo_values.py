"""A plain state whose atomic values alone change between saves (a training loop's step, loss, learning rate) is
found by its LayoutMemo, not walked again, with exactly the key a walk gives; any other change is walked."""
from __future__ import annotations

import collections
import enum
import json
import struct

import pytest
import torch

from _harness import assert_same_state

from snapckpt.engine import plain_values
from snapckpt.engine import stager as stager_mod
from snapckpt.engine.stager import Stager
from snapckpt.formats.plain_layout import LayoutMemo, plain_layout
from snapckpt.persister.slot_index import read_slot

_NAN = struct.unpack("<d", bytes.fromhex("0100000000f87fff"))[0]  # a negative NaN with a payload


class _Int(int):
    pass


class _Str(str):
    pass


class _Color(enum.IntEnum):
    RED = 1


def _exact(a, b):
    """Two keys equal item for item with the same types (``True == 1`` in a list comparison)."""
    return a == b and list(map(type, a)) == list(map(type, b))


def _state(it, loss, name, flag, weights, extra=None):
    """Values at several depths, before and after tensors at several depths (breadth-first order is not
    walking order for either)."""
    model = collections.OrderedDict((k, v) for k, v in weights.items() if k.startswith("w"))
    model._metadata = collections.OrderedDict({"": {"version": it % 3, "note": name}})
    return {"pre": [loss, {"deep": [it, flag, (name, loss)]}, weights["p"]], "model": model, "iteration": it,
            "loss": loss, "name": name, "flag": flag, "none": None, "big": 2 ** 70 + it,
            "opt": {"state": {0: {"m": weights["m"], "step": it}}, "param_groups": [
                {"lr": loss / 10, "betas": (0.9, loss), "params": [0], "nested": {"a": [[name], it]}}]},
            "rng": ("MT", (it, it + 1, -it), None), 1.5: "float key", -0.0: loss, True: flag, **(extra or {})}


_VALUES = [  # (iteration, loss, name, flag)
    (1, 0.5, "run", True),
    (2, -0.0, "rün ✓", False),
    (3, 0.0, "", True),
    (300, float("nan"), "x" * 300, False),
    (-70000, _NAN, "run", True),
    (2 ** 40, float("inf"), "ü\ud800", False),
    (2 ** 40, float("inf"), "ü\ud800", False),  # unchanged
]


def _weights():
    return {**{f"w{i}": torch.full((2,), float(i)) for i in range(20)}, "p": torch.ones(3), "m": torch.zeros(2)}


def test_a_memo_matches_new_values_with_the_walks_tensors_and_key():
    weights = _weights()
    first = _state(*_VALUES[0], weights)
    memo = LayoutMemo.build(first, *plain_layout(first))
    assert memo is not None
    for values in _VALUES:
        state = _state(*values, weights)
        tensors, key = plain_layout(state)
        found = memo.match(state)
        assert found is not None, values
        assert list(map(id, found[0])) == list(map(id, tensors)), values
        assert _exact(found[1], key), values
    assert memo.match(first)[1] is memo.key  # the values of the memo: its own key, no copy
    assert _exact(memo.key, plain_layout(first)[1])  # a match never changes the memo's key


@pytest.mark.parametrize("moved_first", [False, True])
def test_a_memo_finds_an_ordered_dicts_entries_in_its_own_order(moved_first):
    """A level of plain dicts takes their values by ``dict.values`` (faster); an ``OrderedDict`` among them keeps its
    own order, which ``move_to_end`` makes differ from its dict's: a memo made of one such state matches another of
    the same order whose dict's order differs, with the walk's tensors and key."""
    def state(it, moved):
        names = [f"w{i}" for i in range(4)]
        model = collections.OrderedDict((n, torch.full((2,), float(i))) for i, n in enumerate(
            names if moved else names[1:] + names[:1]))
        if moved:
            model.move_to_end("w0")  # the same order as built directly, another order of the dict beneath
        return {"model": model, "opt": {i: {"m": torch.zeros(1), "step": it} for i in range(3)}, "it": it}

    first = state(1, moved_first)
    memo = LayoutMemo.build(first, *plain_layout(first))
    for it, moved in ((2, moved_first), (3, not moved_first)):
        s = state(it, moved)
        tensors, key = plain_layout(s)
        found = memo.match(s)
        assert found is not None
        assert list(map(id, found[0])) == list(map(id, tensors)) and _exact(found[1], key), moved
    other = state(4, moved_first)
    other["model"].move_to_end("w1")
    assert memo.match(other) is None  # another order of the same keys: another structure


@pytest.mark.parametrize("change", [
    lambda s: s.__setitem__("iteration", 7.0),  # int -> float
    lambda s: s.__setitem__("flag", 1),  # bool -> int
    lambda s: s["opt"]["state"][0].__setitem__("step", True),  # int -> bool
    lambda s: s.__setitem__("iteration", _Int(3)),  # an int subclass: not plain
    lambda s: s.__setitem__("iteration", _Color.RED),
    lambda s: s.__setitem__("name", _Str("run")),  # a str subclass: not plain
    lambda s: s.__setitem__("name", None),
    lambda s: s.__setitem__("loss", torch.zeros(1)),  # a tensor where a value was
    lambda s: s["pre"].__setitem__(2, 5),  # a value where a tensor was
    lambda s: s["pre"][1].__setitem__("deep", (1, True, ("run", 0.5))),  # list -> tuple
    lambda s: s.__setitem__("rng", ("MT", (1, 2, 3, 4), None)),  # longer
    lambda s: s.__setitem__("epoch", 1),  # a new key
    lambda s: s.__setitem__(0.0, s.pop(-0.0)),  # a float key's sign
    lambda s: s.__setitem__(1, s.pop(True)),  # True -> 1 as a key
    lambda s: s.__setitem__("alias", s["opt"]["param_groups"]),  # a container met twice
    lambda s: s.__setitem__("twice", s["model"]["w3"]),  # a tensor met twice
    lambda s: setattr(s["model"], "_metadata", None),
])
def test_a_memo_walks_again_on_any_change_but_values(change):
    weights = _weights()
    first = _state(*_VALUES[0], weights)
    memo = LayoutMemo.build(first, *plain_layout(first))
    state = _state(*_VALUES[3], weights)
    assert memo.match(state) is not None
    change(state)
    assert memo.match(state) is None


def test_a_memo_of_a_bare_value_or_tensor_is_not_made():
    for obj in (5, torch.tensor(3.0), torch.zeros(2), "s", None):
        assert LayoutMemo.build(obj, *plain_layout(obj)) is None


class _Saves:
    """A Stager saving ``{"s.pt": state}`` into one slot, counting its walks (``plain_layout`` calls)."""

    def __init__(self, monkeypatch):
        self.stager, self.buf = Stager(), bytearray(1 << 20)
        self.slot = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.walks = 0
        self.keys = []
        real, real_layout = stager_mod.plain_layout, Stager._plain_layout

        def counting(obj):
            self.walks += 1
            return real(obj)

        def layout(stager, name, obj, distinct_tensors=True):
            got = real_layout(stager, name, obj, distinct_tensors)
            self.keys.append(got[1])
            return got

        monkeypatch.setattr(stager_mod, "plain_layout", counting)
        monkeypatch.setattr(Stager, "_plain_layout", layout)

    def save(self, state, step):
        p = self.stager.prepare({"s.pt": state}, step)
        Stager.copy_into(p, self.slot, self.buf)
        assert _exact(self.keys[-1], plain_layout(state)[1])
        for weights_only in (True, False):
            got, files = read_slot(self.buf, self.slot, weights_only=weights_only)
            assert got == step
            _same(files["s.pt"], state)
        return p


_same = assert_same_state


def test_a_loop_whose_values_change_every_save_walks_twice_then_takes_the_memo(monkeypatch):
    s = _Saves(monkeypatch)
    weights = _weights()
    for step, values in enumerate(_VALUES * 2, start=1):
        s.save(_state(*values, weights), step)
        assert s.walks == min(step, 2), step  # the second save's structure is the first's: the memo is made
    assert s.stager.plan_builds == 1


def test_a_type_or_structure_change_walks_and_a_new_memo_is_made_of_the_new_structure(monkeypatch):
    s = _Saves(monkeypatch)
    weights = _weights()
    for step in (1, 2, 3):
        s.save(_state(*_VALUES[step], weights), step)
    assert s.walks == 2
    s.save(_state(*_VALUES[4], weights, extra={"flag": 1}), 4)  # bool -> int
    assert s.walks == 3
    s.save(_state(*_VALUES[5], weights, extra={"flag": 2}), 5)  # the new structure twice: a memo of it
    assert s.walks == 4
    s.save(_state(*_VALUES[0], weights, extra={"flag": 3}), 6)
    assert s.walks == 4
    s.save(_state(*_VALUES[1], weights, extra={"epoch": 1.0}), 7)  # a new key
    s.save(_state(*_VALUES[2], weights, extra={"epoch": 2.0}), 8)
    s.save(_state(*_VALUES[3], weights, extra={"epoch": 3.0}), 9)
    assert s.walks == 6


def _loop_state(values, weights, tensor_in_a_list=False):
    """:func:`_state`, whose list ``"pre"`` holds a tensor only with ``tensor_in_a_list`` (the plain restore's values
    then hold one: none are written)."""
    state = _state(*values, weights)
    if not tensor_in_a_list:
        state["pre"][2] = values[0]
    return state


def _replaced(state):
    dicts, keys = [], []
    assert plain_values.entries(state, [], dicts, keys)
    return [d[k] for d, k in zip(dicts, keys)]


@pytest.mark.parametrize("tensor_in_a_list", [False, True])
def test_a_memo_finds_the_values_a_load_replaces_as_their_walk_does(tensor_in_a_list):
    weights = _weights()
    first = _loop_state(_VALUES[0], weights, tensor_in_a_list)
    memo = LayoutMemo.build(first, *plain_layout(first))
    for values in _VALUES:
        state = _loop_state(values, weights, tensor_in_a_list)
        out = []
        assert memo.match(state, replaced=out) is not None
        assert list(map(id, out)) == list(map(id, _replaced(state))), values  # the same objects, in walking order
        assert plain_values.pack_values(out) == plain_values.pack(state)
        assert (plain_values.pack(state) is None) is tensor_in_a_list
    out = [1]
    assert memo.match(_loop_state(_VALUES[0], weights, not tensor_in_a_list), replaced=out) is None
    assert out == [1]  # no match: nothing appended
    top = [{"a": 1, "t": torch.zeros(1)}, {"b": [2]}]  # no mapping at the top: a load replaces nothing
    out = []
    assert LayoutMemo.build(top, *plain_layout(top)).match(top, replaced=out) is not None and out == []


def test_a_memo_hit_writes_the_values_of_this_save_without_their_walk(monkeypatch):
    """Every in-place change a training loop makes to the values a load replaces (a scalar, a list's item, a dict in
    a list, a new tuple, a value deep in nested dicts, an OrderedDict attribute that is no such value) is in the
    slot's values, bytes equal to a walk's; after the memo is made, no save walks them."""
    s = _Saves(monkeypatch)
    packs = [0]
    real_pack = stager_mod.pack

    def counting(obj):
        packs[0] += 1
        return real_pack(obj)

    monkeypatch.setattr(stager_mod, "pack", counting)
    state = _loop_state(_VALUES[0], _weights())
    changes = [
        lambda: None,
        lambda: state.__setitem__("iteration", 2),  # the second walk: the memo is made
        lambda: state.__setitem__("loss", 0.25),
        lambda: state["opt"]["param_groups"][0].__setitem__("lr", 1e-5),  # a dict in a list: the list is one value
        lambda: state["opt"]["param_groups"][0]["nested"]["a"][0].__setitem__(0, "changed"),
        lambda: state.__setitem__("rng", ("MT", (7, 8, 9), None)),
        lambda: state["opt"]["state"][0].__setitem__("step", 99),
        lambda: state["pre"][1]["deep"].__setitem__(0, 123),
        lambda: state["model"]._metadata[""].__setitem__("version", 2),  # not a replaced value: the key changes
        lambda: None,  # nothing changed
        lambda: state.__setitem__(-0.0, float("nan")),
    ]
    for step, change in enumerate(changes, start=1):
        change()
        p = s.save(state, step)
        index = json.loads(p.tail[-1][1])
        at, nbytes = index["values"]
        written = dict(p.tail)[at][:nbytes]  # the shape table follows the values (index["table"])
        assert written == real_pack(state), step
        assert repr(plain_values.unpack(written)) == repr(_replaced(state)), step  # repr: nan != nan
        assert packs[0] == min(step, 2), step  # walked by the first two saves only
    assert s.walks == 2


def test_a_memo_hit_splits_its_key_as_split_key_does_without_a_pass_over_it(monkeypatch):
    """The skeleton's splice of a memo-hit save takes the key's structure and values from the memo's places (found
    when the memo is made, by the second save, which walks anyway), equal item for item (and type) to
    :func:`split_key` of the key; no save after that calls it (the first match does not either: it is no slower
    than the next ones)."""
    s = _Saves(monkeypatch)
    real_split = stager_mod.split_key
    calls = [0]

    def counting(key):
        calls[0] += 1
        return real_split(key)

    monkeypatch.setattr(stager_mod, "split_key", counting)
    inner = Stager._plain_layout
    hits = []

    def spying(stager, name, obj, distinct_tensors=True):
        got = inner(stager, name, obj, distinct_tensors)
        if got[2]:
            hits.append((got[1], got[4]))
        return got

    monkeypatch.setattr(Stager, "_plain_layout", spying)
    weights = _weights()
    for step, values in enumerate(_VALUES * 2, start=1):
        before = calls[0]
        s.save(_state(*values, weights), step)
        assert step <= 2 or calls[0] == before, step  # the second save: the memo's split, the template's structure
    assert len(hits) == 2 * len(_VALUES) - 2
    for key, (structure, values) in hits:
        want_structure, want_values = real_split(key)
        assert _exact(structure, want_structure)
        assert values == want_values and [type(v) for _, v in values] == [type(v) for _, v in want_values]


def test_the_index_json_of_a_values_only_save_is_reused_while_the_pickle_keeps_its_place_and_size(monkeypatch):
    """The index's "files" JSON (a record per span: megabytes for 200,000 tensors) is the last save's object while
    the pickle's offset and size and the records stay; a value that changes the pickle's size gets a new one, and
    every save loads to its own values (the pickle is read where the index says)."""
    s = _Saves(monkeypatch)
    weights = _weights()
    jsons = []
    for step, name in enumerate(["run", "abc", "xyz", "a longer name", "a longer name", "short"], start=1):
        p = s.save(_loop_state((step, 0.5 + step, name, step % 2 == 0), weights), step)
        jsons.append(p.layout.files_json)
        assert json.loads(p.tail[-1][1])["files"][0]["pkl"] == [p.tail[0][0], len(p.tail[0][1])]
    assert jsons[2] is jsons[1]  # the same size: the same JSON
    assert jsons[3] is not jsons[2] and jsons[4] is jsons[3] and jsons[5] is not jsons[4]
