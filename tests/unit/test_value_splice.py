"""A plain state whose non-tensor values alone change between saves: its skeleton is spliced, not pickled again."""
from __future__ import annotations

import collections
import io
import json
import pickle
import struct

import pytest
import torch

from _harness import assert_same_state

from snapckpt.engine import stager as stager_mod
from snapckpt.engine.stager import Stager
from snapckpt.formats import torch_zip as Z
from snapckpt.formats import plain_levels
from snapckpt.formats.plain_digest import digest
from snapckpt.formats.plain_layout import plain_layout
from snapckpt.formats.value_splice import ValueTemplate, encode, split_key
from snapckpt.persister.slot_index import read_slot

_NAN = struct.unpack("<d", bytes.fromhex("0100000000f87fff"))[0]  # a negative NaN with a payload


_same = assert_same_state


def _state(it: int, loss: float, name: str, flag: bool, last, betas: tuple, weights=None) -> dict:
    """A training loop's state: many tensors (one dict of them), a model state dict with ``_metadata``, and values
    of every atomic type; ``weights`` the same tensors every call when given."""
    w = weights or {f"w{i}": torch.full((2,), float(i)) for i in range(20)}
    model = collections.OrderedDict(w)
    model._metadata = collections.OrderedDict({"": {"version": it % 3}})  # as Module.state_dict()
    return {"model": model, "iteration": it, "loss": loss, "name": name, "flag": flag, "last": last,
            "opt": {"state": {0: {"m": w["w0"] * 0, "step": torch.tensor(float(it))}},
                    "param_groups": [{"lr": loss / 10, "betas": betas, "params": [0], "huge": 2 ** 70 + it}]},
            "rng": ("MT", (it, it + 1, -it), None)}


_VALUES = [  # (iteration, loss, name, flag, last, betas)
    (1, 0.5, "run", True, None, (0.9, 0.99)),
    (2, -0.0, "rün ✓", False, None, (0.9, 0.95)),
    (300, float("nan"), "", True, None, (1e-300, -2.5)),
    (-70000, _NAN, "x" * 300, False, None, (float("inf"), float("-inf"))),
    (2 ** 40, 0.0, "run", True, None, (0.0, -0.0)),
]


def _refs(tensors):
    keys, refs, storages = {}, {}, {}
    for t in tensors:
        st = t.untyped_storage()
        key = keys.setdefault(st.data_ptr(), str(len(keys)))
        storages[key] = st
        refs[id(t)] = Z.TensorRef(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, "cpu",
                                  st.nbytes() // t.element_size())
    return refs, storages


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_template_spliced_with_new_values_unpickles_to_the_new_state(weights_only):
    weights = {f"w{i}": torch.full((2,), float(i)) for i in range(20)}
    first = _state(*_VALUES[0], weights=weights)
    tensors, key = plain_layout(first)
    refs, storages = _refs(tensors)
    template = ValueTemplate.build(first, key, lambda shadow: Z.pickle_skeleton(shadow, refs))
    assert template is not None and template.keys == Z.pickle_skeleton(first, refs)[1]
    for values in _VALUES:
        new = _state(*values, weights=weights)
        new["opt"]["state"][0]["m"] = first["opt"]["state"][0]["m"]  # the same tensors, new values
        new["opt"]["state"][0]["step"] = first["opt"]["state"][0]["step"]
        new_tensors, new_key = plain_layout(new)
        assert list(map(id, new_tensors)) == list(map(id, tensors))
        structure, vals = split_key(new_key)
        assert structure == split_key(key)[0]
        pkl = template.splice(vals)
        _same(Z.unpickle_skeleton(pkl, storages, weights_only=weights_only), new)
        buf = io.BytesIO()
        Z.write_torch_file(buf, pkl, [(k, torch.empty(0, dtype=torch.uint8).set_(storages[k]).numpy(),
                                       storages[k].nbytes()) for k in template.keys])
        _same(torch.load(io.BytesIO(buf.getvalue()), weights_only=weights_only), new)


def test_each_value_is_encoded_as_pickle_does_without_a_memo_entry():
    for v in (0, 255, 256, 65536, -1, 2 ** 31, -(2 ** 31) - 1, 2 ** 100, True, False, None, 1.5, -0.0, _NAN, "a",
              "ü\ud800"):
        _, vals = split_key(plain_layout({"v": v})[1])
        op = encode(*vals[0])
        assert pickle.loads(b"\x80\x02" + op + b".") == v or v != v
        if type(v) is float:
            assert op == b"G" + struct.pack(">d", v)
        elif type(v) is not str:
            assert op == pickle.dumps(v, protocol=2)[2:-1]


def test_no_template_of_a_state_that_holds_a_container_twice():
    shared = {"a": 1}
    state = {"x": shared, "y": shared, "t": torch.zeros(1)}
    tensors, key = plain_layout(state)
    refs, _ = _refs(tensors)
    assert ValueTemplate.build(state, key, lambda s: Z.pickle_skeleton(s, refs)) is None


class _Saves:
    """A Stager saving ``{"s.pt": state}`` into one slot, counting the skeleton pickles and what they pickled."""

    def __init__(self, monkeypatch):
        self.stager, self.buf = Stager(), bytearray(1 << 20)
        self.slot = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.pickled = []
        real = stager_mod.pickle_skeleton

        def counting(obj, refs):
            self.pickled.append(obj)
            return real(obj, refs)

        monkeypatch.setattr(stager_mod, "pickle_skeleton", counting)

    def save(self, state, step):
        p = self.stager.prepare({"s.pt": state}, step)
        Stager.copy_into(p, self.slot, self.buf)
        for weights_only in (True, False):
            got, files = read_slot(self.buf, self.slot, weights_only=weights_only)
            assert got == step
            _same(files["s.pt"], state)
        # the torch.save file the persister would write from the slot: data.pkl and the records, as in the index
        index = json.loads(bytes(p.tail[-1][1]))
        # the restart digest (structure and value types) is the one a fresh computation gives
        assert index["plain"] == digest("s.pt", plain_levels.walk(state).structure, p.layout.plain_part)
        entry = index["files"][0]
        pkl = bytes(self.buf[entry["pkl"][0]:sum(entry["pkl"])])
        out = io.BytesIO()
        Z.write_torch_file(out, pkl, [(k, self.buf[off:off + n], n) for k, off, n in entry["records"]])
        for weights_only in (True, False):
            _same(torch.load(io.BytesIO(out.getvalue()), weights_only=weights_only), state)
        return p


def test_a_values_only_change_splices_the_skeleton_and_saves_the_new_values(monkeypatch):
    s = _Saves(monkeypatch)
    weights = {f"w{i}": torch.full((2,), float(i)) for i in range(20)}
    s.save(_state(*_VALUES[0], weights=weights), 1)
    assert len(s.pickled) == 1
    s.save(_state(*_VALUES[1], weights=weights), 2)  # the first values-only change makes the template
    assert len(s.pickled) == 2 and s.pickled[-1]["iteration"] != _VALUES[1][0]  # a copy with markers
    for step, values in enumerate(_VALUES[2:] + _VALUES[:2], start=3):
        s.save(_state(*values, weights=weights), step)  # fresh small tensors each save: the same plan
    assert len(s.pickled) == 2 and s.stager.plan_builds == 1


@pytest.mark.parametrize("change", ["int_to_float", "true_to_1", "str_to_none", "tuple_longer", "new_key",
                                    "list_to_tuple"])
def test_a_type_or_structure_change_pickles_the_state(monkeypatch, change):
    s = _Saves(monkeypatch)
    weights = {f"w{i}": torch.full((2,), float(i)) for i in range(20)}
    s.save(_state(*_VALUES[0], weights=weights), 1)
    s.save(_state(*_VALUES[1], weights=weights), 2)
    s.save(_state(*_VALUES[2], weights=weights), 3)
    assert len(s.pickled) == 2
    state = _state(*_VALUES[3], weights=weights)
    if change == "int_to_float":
        state["iteration"] = 7.0
    elif change == "true_to_1":
        state["flag"] = 1
    elif change == "str_to_none":
        state["name"] = None
    elif change == "tuple_longer":
        state["rng"] = ("MT", (1, 2, 3, 4), None)
    elif change == "new_key":
        state["epoch"] = 1
    else:
        state["opt"]["param_groups"][0]["params"] = (0,)
    s.save(state, 4)
    assert len(s.pickled) == 3 and s.pickled[-1] is state  # the state itself, pickled in full
    s.save(_state(*_VALUES[4], weights=weights), 5)  # back to the template's structure: pickled in full again
    assert len(s.pickled) == 4


def test_a_float_key_with_a_markers_bits_gets_no_template():
    marker0 = struct.unpack(">d", b"\x7f\xfa\x5a\xc3\x00\x00\x00\x00")[0]
    state = {marker0: 1, "t": torch.zeros(1)}
    tensors, key = plain_layout(state)
    refs, _ = _refs(tensors)
    assert ValueTemplate.build(state, key, lambda s: Z.pickle_skeleton(s, refs)) is None


def test_a_string_value_that_is_also_a_key_object_splices_to_the_new_string(monkeypatch):
    """pickle refers back to a string object met before (a key): the spliced value is written in full."""
    s = _Saves(monkeypatch)
    weights = {f"w{i}": torch.rand(2) for i in range(20)}
    for step, tag in enumerate(["w3", "w4", "other", "w3"], start=1):
        tag = next(k for k in weights if k == tag) if tag in weights else tag  # the key's own object
        s.save({"model": weights, "tag": tag, "next": tag, "step": step}, step)
    assert len(s.pickled) == 2


def test_an_int_key_whose_bytes_end_in_a_markers_opcode_right_before_the_real_marker_gets_no_template(monkeypatch):
    """An int dict key is pickled as its little-endian bytes (``LONG1``): bytes ending in a marker's opcode and the
    first three bytes of an index whose last byte is the ``G`` of the real marker right after the key (the marker
    of value 327 here, ``00 00 01 47``) read as that marker, overlapping the real one; the template cut there
    would splice the key short and keep the rest of the real marker's bytes (a pickle that does not load). The
    state is pickled in full instead."""
    key = int.from_bytes(b"G\x7f\xfa\x5a\xc3\x00\x00\x01", "little")
    state = {"w": torch.rand(3), "vals": [0] * 327, "d": {key: 0.5, "after": 0}}
    tensors, k = plain_layout(state)
    refs, _ = _refs(tensors)
    assert ValueTemplate.build(state, k, lambda s: Z.pickle_skeleton(s, refs)) is None
    s = _Saves(monkeypatch)
    for step in (1, 2, 3):  # values-only changes: each saved as it is (read back from the slot and as a file)
        s.save({"w": state["w"], "vals": [step] * 327, "d": {key: 0.5 * step, "after": step}}, step)
