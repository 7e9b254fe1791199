"""The breadth-first structure of a plain state (snapckpt.formats.plain_levels), which the restart digest hashes: equal
for states of one structure whatever their values; different for any change of container type or length, key (its
value or type), value type or aliasing; None for what is not plain. And the plain restore that uses it puts every
tensor and value where the general path puts it, also where the breadth-first and the walking order differ."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from snapckpt.engine import plain_restore
from snapckpt.engine.restore import copy_into
from snapckpt.engine.stager import Stager
from snapckpt.formats.plain_levels import walk
from snapckpt.persister.slot_index import read_slot

from test_plain_restore import NAME, _save, _zeros_like


def _state(step: int = 7, lr: float = 0.1) -> dict:
    return {"opt": {"state": {0: {"exp_avg": torch.rand(3), "step": torch.tensor(1.0)}, 1: {"exp_avg": torch.rand(2)}},
                    "param_groups": [{"lr": lr, "params": [0, 1]}]},
            "model": OrderedDict((f"l{i}", torch.rand(2, 2)) for i in range(20)),
            "top": torch.rand(4), "step": step, "name": "gpt", "nothing": None, 1.5: True, -0.0: "z"}


def test_states_of_one_structure_have_one_description_whatever_their_values():
    a, b = walk(_state()), walk(_state(step=9, lr=0.5))
    assert a is not None and a.structure == b.structure
    assert a.n_tensors == 2 + 1 + 20 + 1


@pytest.mark.parametrize("change", [
    lambda s: s.update(step=7.0),  # int -> float
    lambda s: s.update(step=True),  # int -> bool
    lambda s: s.update(name=None),
    lambda s: s.update(top=3),  # a tensor -> a value
    lambda s: s["opt"].update(param_groups=tuple(s["opt"]["param_groups"])),  # list -> tuple
    lambda s: s["opt"]["param_groups"][0]["params"].append(2),  # a length inside a list
    lambda s: s.update(model=dict(s["model"])),  # OrderedDict -> dict
    lambda s: s["opt"]["state"].update({True: s["opt"]["state"].pop(1)}),  # key 1 -> True
    lambda s: s["opt"]["state"].update({"1": s["opt"]["state"].pop(1)}),  # key 1 -> "1"
    lambda s: s.update({0.0: s.pop(-0.0)}),  # key -0.0 -> 0.0
    lambda s: s.update(extra=1),
    lambda s: s.update(model=OrderedDict(reversed(s["model"].items()))),  # the keys' order
    lambda s: setattr(s["model"], "_metadata", {"": {"version": 1}}),  # an OrderedDict's attributes
])
def test_any_change_of_structure_or_type_changes_the_description(change):
    s = _state()
    change(s)
    assert walk(s).structure != walk(_state()).structure


def test_keys_holding_a_nul_are_not_read_as_other_keys():
    """Keys are hashed "\\0"-joined when none holds a NUL: two keys that join alike are told apart."""
    assert walk({"a\0b": 1, "c": 1}).structure != walk({"a": 1, "b\0c": 1}).structure


def test_an_int_key_too_long_for_repr_is_described_and_restored():
    """An int key of more than 4,300 digits has no ``repr`` (ValueError): it was an exception out of the Stager's save
    and out of a restarted load; now it is described by its hex, apart from a string key of that text and from
    another int, and a restart restores such a state."""
    big = 10 ** 5000
    assert walk({big: 1}).structure != walk({big + 1: 1}).structure
    assert walk({big: 1}).structure != walk({hex(big): 1}).structure
    assert walk({big: 1, 2: 1}).structure != walk({big: 1, "2": 1}).structure
    saved = {big: 3, "t": torch.rand(2), "d": {big: torch.rand(3)}}
    m = _save(saved)
    live = {big: 0, "t": torch.zeros(2), "d": {big: torch.zeros(3)}}
    found = plain_restore.find(m, NAME, 1, live)
    assert found is not None
    found.run()
    assert live[big] == 3 and torch.equal(live["t"], saved["t"]) and torch.equal(live["d"][big], saved["d"][big])
    assert plain_restore.find(m, NAME, 1, {big + 1: 0, "t": torch.zeros(2), "d": {big: torch.zeros(3)}}) is None


def test_a_container_held_twice_differs_from_two_equal_ones_and_is_walked_once():
    shared = [1, 2]
    aliased, separate = {"a": shared, "b": shared}, {"a": [1, 2], "b": [1, 2]}
    assert walk(aliased).structure != walk(separate).structure
    cyclic: dict = {"x": 1}
    cyclic["self"] = cyclic
    assert walk(cyclic) is not None  # a container holding itself: met again, not walked again


@pytest.mark.parametrize("state", [
    [torch.zeros(1)],  # not a mapping at the top
    {"a": object()},
    {"a": torch.Size([2])},  # a tuple subclass
    {type("S", (str,), {})("k"): 1},  # a str subclass key
    {(1, 2): 1},  # a tuple key
])
def test_what_is_not_plain_has_no_description(state):
    assert walk(state) is None


def test_a_state_nested_deeper_than_100_levels_has_none():
    deep: dict = {}
    node = deep
    for _ in range(120):
        node["d"] = {}
        node = node["d"]
    assert walk(deep) is None


def test_the_restore_puts_tensors_and_values_as_the_general_path_where_breadth_first_order_differs():
    """Top-level tensors come before the nested ones breadth-first, after them when walking: the restore still pairs
    each live tensor with its own span and each value with its own entry, bit for bit as copy_into."""
    saved = _state()
    m = _save(saved)
    fast, general = _zeros_like(_state(step=0, lr=1.0)), _zeros_like(_state(step=0, lr=1.0))
    found = plain_restore.find(m, NAME, 1, fast)
    assert found is not None
    found.run()
    _, files = read_slot(m.buf, m.tensor, weights_only=False)
    copy_into(general, files[NAME], own=True)
    assert repr(fast) == repr(general) == repr(saved)


def test_a_mapping_held_twice_restores_its_values_but_not_its_tensors():
    """entries walks a mapping held twice twice: its values are set twice (the same ones), its tensors would be
    copied twice, so such a state is the general path's."""
    cfg = {"lr": 0.1}
    saved = {"w": torch.rand(3), "a": cfg, "b": cfg}
    m = _save(saved)
    live_cfg = {"lr": 1.0}
    live = {"w": torch.zeros(3), "a": live_cfg, "b": live_cfg}
    found = plain_restore.find(m, NAME, 1, live)
    assert found is not None
    found.run()
    assert live["a"] == live["b"] == {"lr": 0.1} and torch.equal(live["w"], saved["w"])
    sub = {"t": torch.rand(2)}
    m = _save({"a": sub, "b": sub})
    live_sub = {"t": torch.zeros(2)}
    assert plain_restore.find(m, NAME, 1, {"a": live_sub, "b": live_sub}) is None


def test_the_stager_writes_no_digest_for_a_state_without_a_description(monkeypatch):
    """The Stager hashes the same description (plain_levels.walk): a state it cannot describe gets no digest."""
    from snapckpt.formats import plain_levels

    monkeypatch.setattr(plain_levels, "walk", lambda obj: None)
    p = Stager().prepare({NAME: {"w": torch.rand(2)}}, 1)
    assert b'"plain"' not in bytes(p.tail[-1][1])


def _entries_by_hand(obj, tensors, dicts, keys):
    """copy_into's walk, one entry at a time (the reference for plain_values.entries)."""
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, dict):
            _entries_by_hand(v, tensors, dicts, keys)
        else:
            dicts.append(obj)
            keys.append(k)


@pytest.mark.parametrize("state", [
    {i: {"exp_avg": torch.rand(1), "step": torch.nn.Parameter(torch.rand(1))} for i in range(5)},  # all tensors
    {0: {}, 1: {"a": torch.rand(1)}, 2: OrderedDict(b=torch.rand(1))},  # empty and ordered ones among them
    {0: {"a": torch.rand(1)}, 1: {"lr": 0.1, "b": torch.rand(1)}},  # one with a value: entry by entry
    {0: {"a": torch.rand(1)}, 1: {"d": {"c": torch.rand(1)}}},  # one nesting deeper
])
def test_entries_of_a_dict_of_dicts_are_the_entry_by_entry_walk(state):
    from snapckpt.engine import plain_values

    shared = {"x": torch.rand(1)}
    for s in (state, {"s": state, "shared1": shared, "shared2": shared}):
        got, want = ([], [], []), ([], [], [])
        assert plain_values.entries(s, *got)
        _entries_by_hand(s, *want)
        assert all(list(map(id, g)) == list(map(id, w)) for g, w in zip(got[:2], want[:2])) and got[2] == want[2]


def test_a_shape_table_with_an_index_out_of_range_is_refused_past_the_first_reduction_chunk():
    """read_table checks every index (reduced 32,000 at a time): one out of range anywhere refuses the table."""
    from array import array

    from snapckpt.formats import plain_digest

    head = b'{"kinds":["torch.float32"],"shapes":[[0,[2]],[0,[3]]]}\n'
    ok = array("i", [0, 1] * 40_000)
    assert plain_digest.read_table(head + ok.tobytes()).ids == ok
    for bad in (2, -1):
        ids = array("i", ok)
        ids[70_001] = bad
        assert plain_digest.read_table(head + ids.tobytes()) is None
