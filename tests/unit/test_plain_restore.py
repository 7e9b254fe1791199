"""The memory-tier restore of a slot by its plain digest (snapckpt.engine.plain_restore): a process that did not write
the slot (a restart: a fresh Stager) copies it straight into a live state of the saved layout, whatever its
non-tensor values (the saved ones are set, as the general path sets them); any difference of name, structure, value
type, dtype, shape or step, a slot without a digest or its values, or a live tensor that cannot take bytes leaves
it to the general path (None)."""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from snapckpt.engine import plain_restore, plain_values
from snapckpt.engine.stager import Stager
from snapckpt.formats import plain_digest, plain_levels
from snapckpt.persister.arena import read_header
from snapckpt.persister.slot_index import read_slot

NAME = "rank_00000.pt"


def _slot(nbytes: int = 4 << 20) -> SimpleNamespace:
    buf = bytearray(nbytes)  # what a MappedSlot holds: the buffer, a uint8 tensor over it, its size
    return SimpleNamespace(buf=buf, tensor=torch.frombuffer(buf, dtype=torch.uint8), views={}, nbytes=nbytes,
                           path="slot", map_for_reading=lambda upto: None)


def _save(state, step: int = 1, name: str = NAME, m=None) -> SimpleNamespace:
    m = m if m is not None else _slot()
    p = Stager().prepare({name: state}, step)
    Stager.copy_into(p, m.tensor, m.buf)
    return m


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": OrderedDict((f"layers.{i}.w", torch.rand(3, 2, generator=g)) for i in range(20)),
            "opt": {"state": {0: {"exp_avg": torch.rand(4, generator=g), "step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
            "p": torch.nn.Parameter(torch.rand(2, generator=g)), "half": torch.rand(5, generator=g).half(),
            "ids": torch.arange(7), "iteration": 7, "name": "gpt"}


def _zeros_like(state):
    """A live state of the same structure, as a restarted process builds it (fresh tensors, other values)."""
    if isinstance(state, dict):
        return type(state)((k, _zeros_like(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    if isinstance(state, torch.nn.Parameter):
        return torch.nn.Parameter(torch.zeros_like(state), requires_grad=state.requires_grad)
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def _tensors(state) -> list:
    from snapckpt.formats.plain_layout import plain_layout

    return plain_layout(state)[0]


def _find(m, live, step: int = 1, name: str = NAME):
    return plain_restore.find(m, name, step, live)


def test_a_restarted_process_copies_the_slot_into_its_live_state_bit_exactly():
    state = _state()
    m = _save(state)
    live = _zeros_like(state)
    objects = _tensors(live)
    versions = [t._version for t in objects]
    found = _find(m, live)
    assert isinstance(found, plain_restore.PlainCopies) and len(found.small) == len(objects)
    found.run()
    for a, b in zip(_tensors(state), _tensors(live)):  # bit-exact, dtypes kept (half, int64)
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert _tensors(live) == objects and all(a is b for a, b in zip(_tensors(live), objects))  # in place
    assert all(t._version > v for t, v in zip(objects, versions))  # as an in-place copy bumps them
    assert type(live["p"]) is torch.nn.Parameter and live["p"].requires_grad and live["p"].grad_fn is None


def test_a_live_state_made_under_inference_mode_is_refused_before_anything_is_written():
    """A restart that builds its state under torch.inference_mode() and loads outside it: torch's refusal of
    copy_ into those tensors ("Inplace update to inference tensor outside InferenceMode"), raised before a byte is
    written (preadv and memmove write by address, past torch's check); inside inference mode they are restored."""
    state = _state()
    m = _save(state)
    with torch.inference_mode():
        live = _zeros_like(state)
    found = _find(m, live)
    assert isinstance(found, plain_restore.PlainCopies) and found.small
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        found.run()
    assert not any(t.any() for t in _tensors(live))  # nothing written
    with torch.inference_mode():
        found = _find(m, live)
        found.run()
    for a, b in zip(_tensors(state), _tensors(live)):
        assert torch.equal(a, b)


def test_large_tensors_are_copied_by_torch_and_small_ones_by_bytes():
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.rand(plain_restore.LARGE_NBYTES // 4 + 3, generator=g),
             "small": {f"b{i}": torch.rand(i + 1, generator=g) for i in range(40)},
             "big2": torch.rand(512, 600, generator=g)}
    m = _save(state, m=_slot(8 << 20))
    live = _zeros_like(state)
    found = _find(m, live)
    assert found is not None and found.large_dsts == [live["big"], live["big2"]] and len(found.small) == 40
    found.run()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(state), _tensors(live)))


def test_a_dict_of_many_tensors_is_restored():
    state = {"params": {f"p{i}": torch.full((3,), float(i)) for i in range(300)}}
    m = _save(state)
    live = _zeros_like(state)
    found = _find(m, live)
    assert found is not None
    found.run()
    assert all(torch.equal(live["params"][k], state["params"][k]) for k in state["params"])


def test_anything_else_takes_the_general_path():
    """A live state that differs from the saved one in structure, key, value type, dtype or shape gets None, and so
    does a slot of another step or file, or one without a digest or values (an older slot, or a layout that is not
    direct)."""
    def changed(change, state_fn=_state):
        state = state_fn()
        m = _save(state)
        live = _zeros_like(state)
        change(live)
        return _find(m, live)

    assert changed(lambda s: None) is not None  # the control
    assert changed(lambda s: s.__setitem__("iteration", 8)) is not None  # another value: the restore sets the saved
    assert changed(lambda s: s.__setitem__("iteration", 7.0)) is None  # an equal value of another type
    assert changed(lambda s: s.__setitem__("iteration", True)) is None  # a bool is not an int
    assert changed(lambda s: s.__setitem__("iteration", None)) is None
    assert changed(lambda s: s.__setitem__("name", b"gpt")) is None  # bytes: not a plain value
    assert changed(lambda s: s.__setitem__("p", None)) is None  # None where a tensor was
    assert changed(lambda s: s.__setitem__("iteration", torch.tensor(7))) is None  # a tensor where an int was
    assert changed(lambda s: s["opt"]["param_groups"][0].__setitem__("betas", [0.9, 0.99])) is None  # list for tuple
    assert changed(lambda s: s.__setitem__("iteration", np.int64(7))) is None  # a numpy scalar: not plain
    assert changed(lambda s: s["opt"]["param_groups"][0]["params"].append(2)) is None  # a list's length
    assert changed(lambda s: s["opt"]["param_groups"][0].__setitem__("lr2", 0.1)) is None  # a dict's keys
    assert changed(lambda s: s["model"].move_to_end("layers.0.w")) is None  # the key order
    assert changed(lambda s: s["model"].__setitem__("layers.3.w", torch.zeros(2, 3))) is None  # a shape
    assert changed(lambda s: s["model"].__setitem__("layers.3.w", torch.zeros(3, 2).double())) is None  # a dtype
    assert changed(lambda s: s.__setitem__("half", torch.zeros(5))) is None
    assert changed(lambda s: s["model"].__setitem__("layers.99.w", torch.zeros(3, 2))) is None  # a key the slot lacks
    assert changed(lambda s: s["model"].pop("layers.3.w")) is None
    assert changed(lambda s: s.__setitem__("model", dict(s["model"]))) is None  # a container's type
    assert changed(lambda s: s.__setitem__("extra", {})) is None  # structure
    # a live tensor that cannot take bytes: not contiguous, or a view with its negative bit set
    assert changed(lambda s: s["model"].__setitem__("layers.3.w", torch.zeros(2, 3).t())) is None
    assert changed(lambda s: s.__setitem__("ids", torch.zeros(7, dtype=torch.int64)._neg_view())) is None
    c = {"z": torch.rand(3, dtype=torch.complex64), "w": torch.rand(2)}
    assert changed(lambda s: None, lambda: c) is not None  # complex tensors restore here
    assert changed(lambda s: s.__setitem__("z", torch.zeros(3, dtype=torch.complex64).conj()), lambda: c) is None

    state = _state()
    m = _save(state)
    assert _find(m, _zeros_like(state), step=2) is None  # the slot holds another step
    assert _find(m, _zeros_like(state), name="other.pt") is None  # another file
    assert _find(_slot(), _zeros_like(state)) is None  # no snapshot at all

    # an index without the digest (written before it existed), or with a digest but without the values (written
    # by the rule that hashed values): the entries blanked, still valid JSON
    for blank in ("plain", "values"):
        old = _save(state)
        _, off, n = read_header(old.buf)
        index = bytes(old.buf[off:off + n])
        start = index.index(b'"%s"' % blank.encode())
        end = index.index(b",", index.index(b"]", start) if blank == "values" else start) + 1
        old.buf[off + start:off + end] = b" " * (end - start)
        assert blank not in json.loads(bytes(old.buf[off:off + n]))
        assert _find(old, _zeros_like(state)) is None
        assert read_slot(old.buf, old.tensor, weights_only=True)[0] == 1  # and the general path reads it
    # a damaged digest
    bad = _save(state)
    _, off, n = read_header(bad.buf)
    start = bytes(bad.buf[off:off + n]).index(b'"plain"')
    bad.buf[off + start + 9] = ord("0") if bad.buf[off + start + 9] != ord("0") else ord("1")
    assert _find(bad, _zeros_like(state)) is None


def test_a_slot_whose_tensors_are_not_each_their_own_span_has_no_digest():
    base = torch.rand(10)
    tied = {"a": base[:5], "b": base[5:], "w": torch.rand(3)}  # two views of one storage: one span
    m = _save(tied)
    _, off, n = read_header(m.buf)
    assert b'"plain"' not in bytes(m.buf[off:off + n])
    assert _find(m, {"a": torch.zeros(5), "b": torch.zeros(5), "w": torch.zeros(3)}) is None
    several = _slot()
    p = Stager().prepare({"a.pt": {"w": torch.rand(2)}, "b.pt": {"w": torch.rand(2)}}, 1)  # two files
    Stager.copy_into(p, several.tensor, several.buf)
    _, off, n = read_header(several.buf)
    assert b'"plain"' not in bytes(several.buf[off:off + n])


def test_tensors_in_lists_keep_copy_into_semantics():
    """copy_into replaces a list (its tensors become copies), so a state with a tensor in a list is left to it."""
    state = {"w": torch.rand(2), "hist": [torch.rand(2)]}
    m = _save(state)
    assert _find(m, _zeros_like(state)) is None


def test_the_digest_is_the_same_in_another_process():
    """The digest hashes no object identity: a fresh interpreter computes the same one for an equal state."""
    code = ("import torch; from collections import OrderedDict\n"
            "from snapckpt.formats import plain_digest as d, plain_levels\n"
            "from snapckpt.formats.plain_layout import plain_layout\n"
            "from snapckpt.engine.plain_restore import direct_offsets\n"
            "s = {'m': OrderedDict(a=torch.zeros(3, 2), b=torch.zeros(4)), 'x': [1, 2.5, None, 'y', True],"
            " 'd': {i: torch.zeros(1) for i in range(20)}}\n"
            "t, k = plain_layout(s); f = d.Facts(t); o, _ = direct_offsets(f)\n"
            "print(d.digest('r.pt', plain_levels.walk(s).structure, d.tensor_part(f, o.tolist())))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    from snapckpt.formats.plain_layout import plain_layout

    s = {"m": OrderedDict(a=torch.ones(3, 2), b=torch.ones(4)), "x": [1, 2.5, None, "y", True],
         "d": {i: torch.ones(1) for i in range(20)}}
    t, k = plain_layout(s)
    f = plain_digest.Facts(t)
    o, _ = plain_restore.direct_offsets(f)
    assert plain_digest.digest("r.pt", plain_levels.walk(s).structure, plain_digest.tensor_part(f, o.tolist())) == out


def test_the_offsets_rule_is_the_stagers():
    state = _state()
    p = Stager().prepare({NAME: state}, 1)
    offsets, _ = plain_restore.direct_offsets(plain_digest.Facts(_tensors(state)))
    assert offsets.tolist() == [d[0] for d in p.layout.direct_dst]


def test_live_tensors_sharing_bytes_take_the_general_path():
    """Live tensors that share bytes (a view beside its base, tied weights) match a slot saved from separate tensors,
    but the result then depends on the copies' order: copy_into copies in walking order, the plain restore the large
    tensors first. Such a state is left to the general path, so both give the same bytes."""
    from snapckpt.engine.restore import copy_into

    g = torch.Generator().manual_seed(2)
    n = plain_restore.LARGE_NBYTES // 4 + 16
    state = {"head": torch.rand(4, generator=g), "body": torch.rand(n, generator=g)}
    m = _save(state, m=_slot(8 << 20))

    def live():
        body = torch.zeros(n)
        return {"head": body[:4], "body": body}  # a small view of a large tensor, walked first

    assert _find(m, live()) is None
    general = live()
    copy_into(general, read_slot(m.buf, m.tensor, weights_only=True)[1][NAME], own=True)
    assert torch.equal(general["head"], state["body"][:4])  # the large copy, made last, wins
    separate = {"head": torch.zeros(4), "body": torch.zeros(n)}
    assert _find(m, separate) is not None  # the control: the same layout without shared bytes


def test_a_nan_value_keeps_its_sign_in_the_skeleton_and_the_restore():
    """``float.hex`` gives ``'nan'`` for every NaN, but pickle keeps a NaN's sign: a save whose only change is a NaN's
    sign must pickle its skeleton (and its values) again, not reuse the last ones, and the restore into a live state
    of any float there sets the saved NaN, sign included."""
    import math

    nan, neg = float("nan"), -float("nan")
    assert math.copysign(1, neg) == -1
    stager, m, w = Stager(), _slot(), torch.rand(3)
    for step, v in ((1, nan), (2, neg)):  # one Stager: the second save may reuse the first one's skeleton
        Stager.copy_into(stager.prepare({NAME: {"w": w, "loss": v}}, step), m.tensor, m.buf)
    got = read_slot(m.buf, m.tensor, weights_only=True)[1][NAME]["loss"]
    assert math.isnan(got) and math.copysign(1, got) == -1
    for live in ({"w": torch.zeros(3), "loss": nan}, {"w": torch.zeros(3), "loss": 0.5}):  # another value: the saved
        found = _find(m, live, step=2)
        assert found is not None
        found.run()
        assert math.isnan(live["loss"]) and math.copysign(1, live["loss"]) == -1


def test_the_shared_bytes_check_tells_touching_ranges_from_overlapping_ones():
    """plain_restore._shared on byte ranges (start, nbytes): small ranges near a large one (within LARGE_NBYTES
    before it, which makes them candidates) overlap it only when they cross its start or lie inside it."""
    big = plain_restore.LARGE_NBYTES
    base = 10 * big

    def shared(*ranges):
        ptrs = torch.tensor([p for p, _ in ranges], dtype=torch.int64)
        nbytes = torch.tensor([n for _, n in ranges], dtype=torch.int64)
        large = nbytes >= big
        return plain_restore._shared(ptrs, nbytes, large, large.logical_not())

    assert not shared((base, big), (base - 64, 64), (base + big, 64))  # ending at its start, starting at its end
    assert not shared((base, big), (base - big + 1, 8), (base + 4 * big, 2 * big))  # near; another large far off
    assert shared((base, big), (base - 8, 16))  # crossing its start
    assert shared((base, big), (base + big - 64, 64))  # inside, at its end
    # past the end of the large range that starts last before it, inside an earlier, longer one
    assert shared((base, 3 * big), (base + big, big), (base + 2 * big + 8, 8))
    assert not shared((base, big), (base, big))  # two large tensors alone: their copies keep the walking order


def _rich(seed: int, it: int, lr: float, word: str, flag: bool, nan_bits: int, version: int) -> dict:
    """A state of many dtypes and non-tensor value kinds; the arguments change values, never the structure."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16") if hasattr(torch, n)]
    bits = torch.randint(0, 256, (len(dtypes), 48), dtype=torch.uint8, generator=g)
    bits[dtypes.index(torch.bool)] &= 1  # a bool byte is 0 or 1
    typed = {str(d): bits[i].view(d).clone() for i, d in enumerate(dtypes)}  # random bit patterns, NaNs included
    model = OrderedDict((f"layers.{i}.w", torch.rand(3, 2, generator=g)) for i in range(20))
    model._metadata = {"": {"version": version}}  # copy_into leaves an OrderedDict's attributes alone
    shared = ["warmup", it]  # one list at two keys: one list after a load
    return {"model": model, "typed": typed, "iteration": it, "neg_zero": -0.0 if flag else 0.0,
            "nan": struct.unpack("<d", struct.pack("<Q", nan_bits))[0], "big": 2**70 + it, "none": None,
            "flag": flag, "word": word, "a": shared, "b": shared, "rng": random.Random(seed).getstate(),
            "sched": {"last_epoch": it, "_last_lr": [lr], "base_lrs": [0.1], "name": word,
                      "nested": OrderedDict(deep={"x": it, "t": torch.rand(2, generator=g)})},
            "opt": {"state": {0: {"step": float(it), "exp_avg": torch.rand(4, generator=g)}},
                    "param_groups": [{"lr": lr, "betas": (0.9, lr), "params": [0], "foreach": None, "tag": word}]}}


def _same(a, b, pairs: dict) -> bool:
    """``a`` and ``b`` are the same to the bit: types, values (a float by its bits, a tensor by its bytes), dict
    order, an OrderedDict's attributes, and which containers are one object (``pairs``: id in ``a`` -> id in ``b``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple, dict)):
        if pairs.setdefault(id(a), id(b)) != id(b):
            return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist())
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        same = list(a) == list(b) and all(_same(a[k], b[k], pairs) for k in a)
        return same and (type(a) is not OrderedDict or _same(dict(vars(a)), dict(vars(b)), {}))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, pairs) for x, y in zip(a, b))
    return a == b


def test_a_restart_with_other_values_restores_the_saved_ones_bit_for_bit_as_the_general_path():
    """A restarted loop's state has the saved structure but its own step counter, learning rate, RNG state...: the
    plain restore takes it, and leaves it exactly as the general path (skeleton unpickled, copy_into) leaves it:
    tensors of every dtype bit for bit, every non-tensor value the saved one with its type (a NaN's payload,
    -0.0, a bool, a 71-bit int, a string, None, a tuple, the RNG tuple), a list at two keys one list, the live
    OrderedDict's attributes untouched."""
    from snapckpt.engine.restore import copy_into

    saved = _rich(0, 1234, 0.03, "saved", True, 0xFFF8_0000_0000_1234, 1)
    m = _save(saved)

    def live():
        return _rich(1, 0, 1.0, "live!", False, 0x7FF8_0000_0000_0001, 2)

    fast = live()
    found = _find(m, fast)
    assert found is not None
    found.run()
    general = live()
    copy_into(general, read_slot(m.buf, m.tensor, weights_only=True)[1][NAME], own=True)
    assert _same(fast, general, {})
    assert fast["iteration"] == 1234 and fast["sched"]["_last_lr"] == [0.03] and fast["word"] == "saved"
    assert fast["a"] is fast["b"] and fast["a"] == ["warmup", 1234] and fast["rng"] == random.Random(0).getstate()
    assert struct.pack("<d", fast["nan"]).hex() == struct.pack("<Q", 0xFFF8_0000_0000_1234).hex()
    assert fast["model"]._metadata == {"": {"version": 2}} and fast["flag"] is True
    assert _same(fast["typed"], saved["typed"], {}) and _same(fast["model"], saved["model"], {}) is False  # metadata
    assert all(torch.equal(fast["model"][k], saved["model"][k]) for k in saved["model"])


def test_a_later_save_with_other_values_writes_its_own_values():
    """One Stager saving a state whose values change every save (a step counter): each save's slot holds that
    save's values, and a process that did not save it restores them."""
    stager, m, w = Stager(), _slot(), torch.rand(3)
    for step in (1, 2, 3):
        Stager.copy_into(stager.prepare({NAME: {"w": w, "iteration": step, "lr": [0.1 * step]}}, step), m.tensor,
                         m.buf)
    live = {"w": torch.zeros(3), "iteration": 0, "lr": [0.0]}
    found = _find(m, live, step=3)
    assert found is not None
    found.run()
    assert live["iteration"] == 3 and live["lr"] == [0.1 * 3] and torch.equal(live["w"], w)


def test_a_slot_with_damaged_values_takes_the_general_path():
    state = _state()
    m = _save(state)
    _, off, n = read_header(m.buf)
    at, nbytes = json.loads(bytes(m.buf[off:off + n]))["values"]
    assert _find(m, _zeros_like(state)) is not None  # the control
    m.buf[at:at + nbytes] = b"\x00" * nbytes
    assert _find(m, _zeros_like(state)) is None


def test_values_are_plain_values_only():
    """The values' pickle loads plain values (an OrderedDict the one global) and refuses any other global; a state
    whose replaced values hold a tensor (copy_into replaces a list of tensors by copies) has none."""
    import collections
    import pickle

    values = [1, 2.5, "s", None, True, (1, [2]), OrderedDict(a=1), [{"k": -0.0}]]
    back = plain_values.unpack(pickle.dumps(values, protocol=4))
    assert back == values and type(back[6]) is OrderedDict and type(back[5]) is tuple and type(back[4]) is bool
    assert plain_values.unpack(pickle.dumps([collections.Counter(a=1)])) is None
    assert plain_values.unpack(pickle.dumps((1, 2))) is None  # not a list
    assert plain_values.unpack(b"garbage") is None
    assert plain_values.pack({"w": torch.zeros(1), "hist": [torch.zeros(1)]}) is None
    assert plain_values.pack({"w": torch.zeros(1), "hist": ({"t": torch.zeros(1)},)}) is None
    m = _save({"w": torch.rand(2), "hist": [torch.rand(2)]})
    _, off, n = read_header(m.buf)
    assert b'"plain"' not in bytes(m.buf[off:off + n])
    cyclic: dict = {"w": torch.zeros(1)}
    cyclic["self"] = cyclic
    assert plain_values.pack(cyclic) is None  # deeper than 100 dicts: no plain restore


_DECLINED = object()


def _by_table(m, live, monkeypatch, step: int = 1):
    """What the shape table's path alone gives: PlainCopies when it takes ``live``, ``_DECLINED`` when it leaves it
    to the tensor-by-tensor check (which is stubbed out here)."""
    with monkeypatch.context() as mp:
        mp.setattr(plain_restore, "_find", lambda *a, **k: _DECLINED)
        return _find(m, live, step)


def _table_state() -> dict:
    """Every kind of tensor the table path takes: 2-D, 0-D, half, int64, a Parameter (and an int one, which cannot
    require grad), an OrderedDict, a dict of many tensors (walked by C calls), complex."""
    g = torch.Generator().manual_seed(3)
    return {"model": OrderedDict((f"l{i}.w", torch.rand(3, 2, generator=g)) for i in range(4)),
            "many": {f"p{i}": torch.rand(i % 3 + 1, generator=g) for i in range(40)},
            "step": torch.tensor(3.0), "half": torch.rand(5, generator=g).half(), "ids": torch.arange(7),
            "p": torch.nn.Parameter(torch.rand(2, generator=g)),
            "ip": torch.nn.Parameter(torch.arange(3), requires_grad=False),
            "z": torch.rand(3, dtype=torch.complex64, generator=g), "iteration": 7}


def test_the_shape_table_takes_a_live_state_of_the_saved_layout_bit_exactly(monkeypatch):
    """The control of the table's mutation tests: a live state of the saved layout is taken by the table's path
    alone, restored bit for bit with versions bumped, and the tensors' share of the digest it derives from the table
    is the one the live tensors give."""
    from snapckpt.formats.plain_layout import plain_layout

    state = _table_state()
    m = _save(state)
    _, off, n = read_header(m.buf)
    at = json.loads(bytes(m.buf[off:off + n]))["table"]
    table = plain_digest.read_table(bytes(m.buf[at[0]:at[0] + at[1]]))
    live = _zeros_like(state)
    tensors = plain_layout(live)[0]
    part, offsets, nbytes, all_small = plain_restore._table_part(table)
    facts = plain_digest.Facts(tensors)
    want_offsets, want_nbytes = plain_restore.direct_offsets(facts)
    assert part == plain_digest.tensor_part(facts, want_offsets.tolist())
    assert list(offsets) == want_offsets.tolist() and list(nbytes) == want_nbytes.tolist()
    assert all_small
    versions = [t._version for t in tensors]
    found = _by_table(m, live, monkeypatch)
    assert isinstance(found, plain_restore.PlainCopies)
    found.run()
    for a, b in zip(_tensors(state), _tensors(live)):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert all(t._version > v for t, v in zip(tensors, versions))
    assert live["iteration"] == 7 and type(live["p"]) is torch.nn.Parameter and live["p"].requires_grad


def test_the_shape_table_misses_every_change_of_the_live_tensors(monkeypatch):
    """Mutation tests of the table's shortcut: each change of a live tensor that its check must see (shape with the
    same element count, dtype, strides, a negative or conjugate view, a tensor object met twice, in the dict of many
    tensors or elsewhere, requires_grad or type) makes the table's path decline, and the tensor-by-tensor check then
    decides as it always did (None, or the same copies)."""
    def changed(change):
        state = _table_state()
        m = _save(state)
        live = _zeros_like(state)
        change(live)
        return _by_table(m, live, monkeypatch), _find(m, live)

    fast, full = changed(lambda s: None)
    assert isinstance(fast, plain_restore.PlainCopies) and full is not None  # the control
    refused = {
        "shape": lambda s: s["model"].__setitem__("l1.w", torch.zeros(2, 3)),
        "shape in the dict of many": lambda s: s["many"].__setitem__("p4", torch.zeros(1, 2)),
        "dtype": lambda s: s.__setitem__("half", torch.zeros(5, dtype=torch.bfloat16)),
        "dtype in the dict of many": lambda s: s["many"].__setitem__("p0", torch.zeros(1, dtype=torch.float64)),
        "not contiguous": lambda s: s["model"].__setitem__("l2.w", torch.zeros(2, 3).t()),
        "negative view": lambda s: s.__setitem__("ids", torch.zeros(7, dtype=torch.int64)._neg_view()),
        "conjugate view": lambda s: s.__setitem__("z", torch.zeros(3, dtype=torch.complex64).conj()),
        "one tensor twice in the dict of many": lambda s: s["many"].__setitem__("p3", s["many"]["p0"]),
        "a tensor of the dict of many elsewhere too": lambda s: s.__setitem__("step", s["many"]["p2"]),
        # not the tensors: the structure, which the digest holds (the table has the tensors' share only)
        "a key": lambda s: s["model"].__setitem__("l9.w", s["model"].pop("l3.w")),
        "a key of the dict of many": lambda s: s["many"].__setitem__("q", s["many"].pop("p39")),
        "a value's type": lambda s: s.__setitem__("iteration", 7.0),
        "a tensor for a value": lambda s: s.__setitem__("iteration", torch.zeros(())),
    }
    for what, change in refused.items():
        fast, full = changed(change)
        assert fast is _DECLINED and full is None, what
    declined = {  # the table's check is stricter than the copy needs: the tensor-by-tensor check takes these
        "requires_grad": lambda s: s.__setitem__("step", torch.zeros((), requires_grad=True)),
        "a Parameter without requires_grad": lambda s: s.__setitem__("p", torch.nn.Parameter(torch.zeros(2), False)),
        "another stride of a size-1 dim": lambda s: s["many"].__setitem__("p0", torch.zeros(5)[::5]),
    }
    for what, change in declined.items():
        fast, full = changed(change)
        assert fast is _DECLINED and isinstance(full, plain_restore.PlainCopies), what
    taken = {  # as by the tensor-by-tensor check (the digest has no Python types)
        "a contiguous view into a larger storage": lambda s: s["model"].__setitem__(
            "l3.w", torch.zeros(10)[2:8].view(3, 2)),
        "a Tensor for a Parameter": lambda s: s.__setitem__("p", torch.zeros(2)),
        "a Parameter for a Tensor": lambda s: s.__setitem__("step", torch.nn.Parameter(torch.zeros(()))),
    }
    for what, change in taken.items():
        fast, full = changed(change)
        assert isinstance(fast, plain_restore.PlainCopies) and isinstance(full, plain_restore.PlainCopies), what


def test_a_damaged_or_missing_shape_table_leaves_the_live_tensors_to_their_own_check(monkeypatch):
    """The table is trusted only through the digest: a changed shape, dtype or index in it, or bytes that are no
    table, make its path decline, and the tensor-by-tensor check restores as before; a slot written without a
    table (an older Stager's, or a state of more distinct shapes than TABLE_MAX_SHAPES) is read that way too."""
    state = _table_state()

    def damaged(edit):
        m = _save(state)
        _, off, n = read_header(m.buf)
        at, nbytes = json.loads(bytes(m.buf[off:off + n]))["table"]
        data = edit(bytes(m.buf[at:at + nbytes]))
        assert len(data) == nbytes
        m.buf[at:at + nbytes] = data
        return _by_table(m, _zeros_like(state), monkeypatch), _find(m, _zeros_like(state))

    head_end = lambda d: d.index(b"\n")  # noqa: E731
    edits = {
        "a size": lambda d: d.replace(b"[3,2]", b"[2,3]", 1),
        "a dtype": lambda d: d.replace(b'"torch.float16"', b'"torch.bfloat1"', 1),
        "a kind index": lambda d: d.replace(b"[[0,", b"[[1,", 1),
        "a tensor's index": lambda d: d[:head_end(d) + 1] + bytes([d[head_end(d) + 1] ^ 1]) + d[head_end(d) + 2:],
        "an index out of range": lambda d: d[:head_end(d) + 1] + b"\xff" * 4 + d[head_end(d) + 5:],
        "not a table": lambda d: b"\x00" * len(d),
        # a table of one shape whose bytes are past int64 (every tensor's index 0): no tensor has it
        "sizes past int64": lambda d: (b'{"kinds":["torch.float32"],"shapes":[[0,[99999999999,99999999999]]]}'
                                       .ljust(head_end(d)) + b"\n" + bytes(len(d) - head_end(d) - 1)),
        "a size of 2**63 - 1": lambda d: (b'{"kinds":["torch.float32"],"shapes":[[0,[9223372036854775807]]]}'
                                          .ljust(head_end(d)) + b"\n" + bytes(len(d) - head_end(d) - 1)),
    }
    for what, edit in edits.items():
        fast, full = damaged(edit)
        assert fast is _DECLINED and isinstance(full, plain_restore.PlainCopies), what
    monkeypatch.setattr(plain_digest, "TABLE_MAX_SHAPES", 3)
    m = _save(state)
    _, off, n = read_header(m.buf)
    index = json.loads(bytes(m.buf[off:off + n]))
    assert "plain" in index and "table" not in index
    assert _find(m, _zeros_like(state)) is not None


def test_a_walk_that_leaves_repeats_to_the_caller_gives_the_same_layout():
    """``plain_layout(obj, distinct_tensors=False)`` skips the look-up of a dict of many tensors among the tensors
    met elsewhere: without repeats it gives the full walk's tensors and key; with a repeat it lists the tensor twice,
    which the caller's check must refuse (the guards do: see the mutation tests above)."""
    from snapckpt.formats.plain_layout import has_repeats, plain_layout

    state = _table_state()
    full, lite = plain_layout(state), plain_layout(state, distinct_tensors=False)
    assert lite[1] == full[1] and len(lite[0]) == len(full[0]) and all(map(lambda a, b: a is b, lite[0], full[0]))
    state["many"]["p5"] = state["many"]["p1"]
    full, lite = plain_layout(state), plain_layout(state, distinct_tensors=False)
    assert not has_repeats(full[0]) and has_repeats(lite[0]) and lite[1] != full[1]


def test_the_guards_check_chunk_by_chunk_and_refuse_an_object_met_in_two_chunks():
    """The table's guards are made once per distinct run of references (a state of one shape: one TensorGuards for
    every chunk) and check each chunk; a tensor object in two chunks, which no one chunk's check sees, is refused,
    as is a wrong shape in the last, partial chunk."""
    n = 3 * plain_restore._GUARD_CHUNK + 7
    tensors = [torch.zeros(3) for _ in range(n)]
    table = plain_digest.read_table(plain_digest.shape_table(tensors, plain_digest.Facts(tensors)))
    assert plain_restore._guards_pass(table, tensors)
    twice = list(tensors)
    twice[plain_restore._GUARD_CHUNK + 1] = twice[0]
    assert not plain_restore._guards_pass(table, twice)
    last = list(tensors)
    last[-1] = torch.zeros(4)
    assert not plain_restore._guards_pass(table, last)
    params = [torch.nn.Parameter(t) if i % 3 == 0 else t for i, t in enumerate(tensors)]
    assert plain_restore._guards_pass(table, params)


def _in_child(body: str) -> "subprocess.CompletedProcess":
    """Run ``body`` in a child Python with ``torch``, this module as ``t`` and ``plain_restore`` imported (a crash
    there, an abort or a segmentation fault, would otherwise end pytest itself)."""
    code = ("import sys, torch, warnings; warnings.simplefilter('ignore')\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "import test_plain_restore as t\n"
            "from snapckpt.engine import plain_restore\n" + body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_live_nested_tensor_takes_the_general_path_without_aborting_the_process():
    """A nested tensor is a ``torch.Tensor`` to the structure walk, so a live one where the saved state held a plain
    tensor passes the digest (derived from the slot's shape table); ``TensorGuards``' check of it throws a C++
    error that aborts the process (torch 2.13: it reads the strides a nested tensor does not have), and Facts'
    field reads raise. The restore refuses it (None) before either, by table or tensor by tensor. In a child
    process: an abort would end pytest itself."""
    out = _in_child(
            "nested = lambda: torch.nested.nested_tensor([torch.zeros(3)])\n"
            "saved = {'w': torch.rand(1, 3), 'v': torch.rand(1, 3), 'i': 1}\n"
            "m = t._save(saved)\n"
            "print(plain_restore.find(m, t.NAME, 1, {'w': torch.zeros(1, 3), 'v': nested(), 'i': 2}))\n"
            "plain_restore._TensorGuards = None  # tensor by tensor\n"
            "print(plain_restore.find(m, t.NAME, 1, {'w': nested(), 'v': torch.zeros(1, 3), 'i': 2}))\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None"], out.stdout


def test_a_live_tensor_over_no_memory_takes_the_general_path_without_crashing_the_process():
    """A ZeroTensor or a functional wrapper is a ``torch.Tensor`` of the saved dtype and shape whose data pointer is
    0 (its dispatch keys pass ``TensorGuards``, its fields the tensor-by-tensor check): copying the span there was a
    segmentation fault. The restore refuses it (None), by table or tensor by tensor; the general path's copy_ names
    it. In a child process: a crash would end pytest itself."""
    out = _in_child(
            "saved = {'w': torch.rand(3), 'v': torch.rand(3), 'i': 1}\n"
            "m = t._save(saved)\n"
            "for guards in (True, False):\n"
            "    if not guards:\n"
            "        plain_restore._TensorGuards = None  # tensor by tensor\n"
            "    for x in (torch._efficientzerotensor(3), torch._to_functional_tensor(torch.zeros(3))):\n"
            "        found = plain_restore.find(m, t.NAME, 1, {'w': torch.zeros(3), 'v': x, 'i': 2})\n"
            "        if found is not None:\n"
            "            found.run()\n"
            "        print(found)\n")
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["None"] * 4, out.stdout
