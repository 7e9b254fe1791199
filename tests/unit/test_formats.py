"""File specs (snapckpt/formats/specs.py) and the torch.save writer (snapckpt/formats/torch_zip.py), in
process: the spec types' checks, safetensors bytes that ``safetensors`` itself reads, and archives that
stock ``torch.load`` reads and that are byte for byte ``torch.save``'s when no two tensors share a
storage (when some do, the same objects and the same sharing come back)."""
from __future__ import annotations

import collections
import io
import json
import os

import pytest
import torch
from safetensors.torch import load as st_load
from torch.serialization import location_tag

from _harness import assert_same_state

from snapckpt.engine import layout_check
from snapckpt.errors import SnapshotError, UnsafeCheckpointError
from snapckpt.formats import Concat, MemoryOnly, RawBytes, TorchSave, safetensors_file
from snapckpt.formats import torch_zip as Z
from snapckpt.formats.specs import unwrap


def concat_bytes(c: Concat) -> bytes:
    return b"".join(p.reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(p, torch.Tensor) else p for p in c.parts)


# ------------------------------------------------------------------------------------------ specs
def test_raw_bytes_takes_bytes_only():
    assert RawBytes(b"x").data == b"x" and RawBytes(bytearray(b"y")).data == bytearray(b"y")
    for bad in ("text", 3, None, [1]):
        with pytest.raises(TypeError, match="RawBytes needs bytes"):
            RawBytes(bad)


def test_raw_bytes_from_file_keeps_content_and_mode(tmp_path):
    p = tmp_path / "zero_to_fp32.py"
    p.write_bytes(b"#!/usr/bin/env python\n")
    os.chmod(p, 0o751)
    assert RawBytes.from_file(str(p)) == RawBytes(b"#!/usr/bin/env python\n", 0o751)
    os.chmod(p, 0o1751)  # the sticky bit is never written: dropped, not refused
    assert RawBytes.from_file(str(p)).mode == 0o751
    with pytest.raises(FileNotFoundError):
        RawBytes.from_file(str(tmp_path / "missing"))
    with pytest.raises(IsADirectoryError):
        RawBytes.from_file(str(tmp_path))


def test_modes_above_0o777_are_refused_with_the_value_and_the_range():
    assert TorchSave({}, mode=0o777).mode == 0o777 and RawBytes(b"", mode=0).mode == 0
    for make in (lambda m: TorchSave({}, mode=m), lambda m: RawBytes(b"x", m), lambda m: Concat([b"x"], m)):
        for bad, shown in ((0o4755, "0o4755"), (0o1777, "0o1777"), (0o10000, "0o10000"), (-1, "-1"),
                           ("644", "'644'"), (True, "True")):
            with pytest.raises(ValueError, match=rf"0\.\.0o777.* got {shown}$"):
                make(bad)


def test_concat_parts_and_size():
    t = torch.arange(6, dtype=torch.int32)
    c = Concat([b"HE", bytearray(b"AD"), memoryview(b"!"), t])
    assert c.parts[1] == b"AD" and type(c.parts[1]) is bytes and type(c.parts[2]) is bytes
    assert c.nbytes == 5 + 6 * 4 == len(concat_bytes(c))
    with pytest.raises(SnapshotError, match="part 0 .* not contiguous"):
        Concat([torch.zeros(4, 3).t()])
    with pytest.raises(TypeError, match="part 1 must be bytes or a tensor"):
        Concat([b"", "str"])


def test_unwrap_plain_values_and_memory_only():
    spec, persist = unwrap({"w": 1})
    assert spec == TorchSave({"w": 1}) and persist is True
    raw = RawBytes(b"r")
    assert unwrap(raw) == (raw, True)
    assert unwrap(MemoryOnly(MemoryOnly(raw))) == (raw, False)
    spec, persist = unwrap(MemoryOnly([1, 2]))
    assert spec == TorchSave([1, 2]) and persist is False


def test_safetensors_file_is_read_by_safetensors_with_sorted_offsets_and_metadata():
    base = torch.arange(20, dtype=torch.float32)
    tensors = {"z.bias": torch.ones(3, dtype=torch.bfloat16), "a.weight": torch.randn(2, 3),
               "view": base[4:10], "mask": torch.tensor([True, False]), "empty": torch.empty(0, 4)}
    c = safetensors_file(tensors, {"format": "pt"})
    data = concat_bytes(c)
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0 and c.nbytes == len(data)
    header = json.loads(data[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert list(header) == sorted(tensors)  # laid out in sorted name order
    assert header["view"] == {"dtype": "F32", "shape": [6], "data_offsets": header["view"]["data_offsets"]}
    ends = [header[k]["data_offsets"] for k in sorted(tensors)]
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    back = st_load(data)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_safetensors_file_refusals():
    big = torch.arange(8.0)
    with pytest.raises(SnapshotError, match="share memory"):
        safetensors_file({"a": big, "b": big})
    with pytest.raises(SnapshotError, match="not contiguous"):
        safetensors_file({"t": torch.zeros(2, 3).t()})
    with pytest.raises(TypeError, match="dtype"):
        safetensors_file({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        safetensors_file({"a": big}, {"step": 3})
    assert st_load(concat_bytes(safetensors_file({"a": big[:4], "b": big[4:]})))["b"].tolist() == [4, 5, 6, 7]


# ------------------------------------------------------------------------------------------ torch_zip
def _bytes_of(st: torch.UntypedStorage):
    """A bytes-like view (no copy) of CPU storage ``st``, as the writer takes records."""
    return torch.empty(0, dtype=torch.uint8).set_(st).numpy()


def _write(obj) -> bytes:
    """``obj`` as snapckpt writes it: skeleton pickle plus one whole-storage record per storage."""
    tensors = Z.collect_tensors(obj)
    keys, refs, storages = {}, {}, {}
    for t in tensors:
        st = t.untyped_storage()
        key = keys.setdefault(st.data_ptr() or id(t), str(len(keys)))
        storages[key] = st
        refs[id(t)] = Z.TensorRef(key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                                  location_tag(st), st.nbytes() // t.element_size())
    data_pkl, used = Z.pickle_skeleton(obj, refs)
    assert used == sorted(set(used), key=used.index)  # first-use order, each once
    buf = io.BytesIO()
    Z.write_torch_file(buf, data_pkl, [(k, _bytes_of(storages[k]), storages[k].nbytes()) for k in used])
    return buf.getvalue()


def _torch_save(obj) -> bytes:
    """``torch.save`` with zip CRC-32 fields off, the setting snapckpt's writer documents it matches."""
    buf = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


def _distinct_storage_state():
    g = torch.Generator().manual_seed(0)
    return {
        "weight": torch.nn.Parameter(torch.randn(4, 3, generator=g)),
        "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "transposed": torch.randn(3, 5, generator=g).t(),
        "channels_last": torch.randn(1, 2, 3, 3, generator=g).to(memory_format=torch.channels_last),
        "bf16": torch.ones(3, dtype=torch.bfloat16), "f16": torch.zeros(2, dtype=torch.float16),
        "int": torch.arange(5), "bool": torch.tensor([True, False]),
        "complex": torch.randn(2, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0), "scalar": torch.tensor(3.5),
        "nested": [(torch.ones(2), {"k": torch.zeros(1, dtype=torch.int8)})],
        "ordered": collections.OrderedDict(a=torch.arange(3.0), b=(1, 2.5, "s", None, True)),
        "plain": {"step": 7, "lr": 1e-3, "name": "run"},
    }


def test_archive_is_byte_equal_to_torch_save_when_storages_are_distinct():
    state = _distinct_storage_state()
    ours = _write(state)
    assert ours == _torch_save(state)
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert type(back["weight"]) is torch.nn.Parameter and back["weight"].requires_grad
    assert back["frozen"].requires_grad is False
    assert back["transposed"].stride() == state["transposed"].stride()
    assert back["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(back["complex"], state["complex"]) and back["bf16"].dtype == torch.bfloat16
    assert back["plain"] == state["plain"] and back["ordered"]["b"] == (1, 2.5, "s", None, True)


def test_shared_storages_load_equal_to_torch_save_with_the_same_sharing():
    """With views of one storage the archive is not byte-equal (torch.save repeats the storage's
    persistent id at each use, snapckpt's pickle memoizes it), but it loads to the same tensors, sharing
    one storage exactly where torch.save's do."""
    base = torch.arange(12, dtype=torch.float32)
    state = {"base": base, "head": base[:4], "grid": base.view(3, 4), "other": torch.ones(2)}
    ours = torch.load(io.BytesIO(_write(state)), weights_only=True)
    ref = torch.load(io.BytesIO(_torch_save(state)), weights_only=True)
    for k in state:
        assert torch.equal(ours[k], ref[k]) and ours[k].stride() == ref[k].stride(), k
    ptr = {k: v.untyped_storage().data_ptr() for k, v in ours.items()}
    assert ptr["base"] == ptr["head"] == ptr["grid"] != ptr["other"]
    ours["base"][0] = 100.0
    assert ours["head"][0].item() == 100.0


def test_collect_tensors_walks_like_pickle_and_dedups():
    a, b = torch.ones(1), torch.zeros(1)
    assert [id(t) for t in Z.collect_tensors({"x": [a, b, a], "y": (b,), "n": 3})] == [id(a), id(b)]


@pytest.mark.parametrize("make,word", [
    (lambda: torch.zeros(3, 3).to_sparse(), "layout"),
    (lambda: torch.zeros(2, device="meta"), "meta tensor"),
    (lambda: torch.randn(2, dtype=torch.complex64).conj(), "conj"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
    (lambda: type("MyTensor", (torch.Tensor,), {})(), "MyTensor"),
])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_unsupported_tensors_are_refused_with_the_fix(make, word):
    with pytest.raises(SnapshotError, match=word):
        Z.collect_tensors({"bad": make()})


class _Opaque:
    def __init__(self):
        self.fn = lambda: None  # a lambda does not pickle


def test_find_unpicklable_names_the_path_of_the_value():
    state = {"model": {"w": torch.ones(1)}, "opt": [1, {"cfg": _Opaque()}]}
    path, value, err = Z.find_unpicklable(state)
    assert path == "state['opt'][1]['cfg'].fn" and callable(value) and isinstance(err, Exception)
    assert Z.find_unpicklable({"ok": [torch.ones(2), 3]}) is None


class Plain:  # a module-level class: it pickles, but weights_only refuses it
    def __init__(self, v):
        self.v = v


def test_weights_only_refusal_and_memory_tier_unpickle():
    plain = {"w": torch.arange(4.0), "n": 3}
    tensors = Z.collect_tensors(plain)
    t = tensors[0]
    refs = {id(t): Z.TensorRef("0", 0, (4,), (1,), t.dtype, "cpu", 4)}
    pkl, keys = Z.pickle_skeleton(plain, refs)
    assert keys == ["0"] and Z.weights_only_refusal(pkl) is None
    back = Z.unpickle_skeleton(pkl, {"0": t.untyped_storage()}, weights_only=True)
    assert back["n"] == 3 and torch.equal(back["w"], plain["w"])

    unsafe = {"obj": Plain(5)}
    pkl, keys = Z.pickle_skeleton(unsafe, {})
    assert keys == [] and "Plain" in Z.weights_only_refusal(pkl)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False"):
        Z.unpickle_skeleton(pkl, {}, weights_only=True)
    assert Z.unpickle_skeleton(pkl, {}, weights_only=False)["obj"].v == 5


def test_stager_layout_cache_reuses_plan_and_skeleton_only_while_the_structure_is_equal():
    """A later save of the same layout reuses the plan (and the pickled skeleton while the non-tensor values
    are equal), saves its own values, and loads back through the fast unpickler or PyTorch's."""
    from snapckpt.engine.stager import Stager
    from snapckpt.formats.plain_layout import plain_layout
    from snapckpt.persister.slot_index import read_slot

    stager, buf, views = Stager(), bytearray(1 << 20), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)

    def roundtrip(state, step, weights_only=True):
        p = stager.prepare({"s.pt": state}, step)
        p.views = views
        Stager.copy_into(p, slot, buf)
        got, files = read_slot(buf, slot, weights_only=weights_only)
        assert got == step
        return files["s.pt"], p

    base = torch.arange(40.0)

    def state(lr, k):
        return {"m": {f"p{i}": torch.full((3, 2), float(i + k)) for i in range(20)},
                "opt": {"lr": lr, "step": torch.tensor(float(k)), "betas": (0.9, 0.99)},
                "p": torch.nn.Parameter(torch.rand(2)), "t": torch.rand(3, 4).t(), "view": base[8:12]}

    s1 = state(0.1, 0)
    back, p1 = roundtrip(s1, 1)
    assert stager.plan_builds == 1 and back["opt"]["lr"] == 0.1 and back["opt"]["betas"] == (0.9, 0.99)
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad
    assert all(torch.equal(back["m"][k], s1["m"][k]) for k in s1["m"]) and torch.equal(back["t"], s1["t"])
    assert torch.equal(back["view"], base[8:12]) and len(p1.direct) == 22  # m, opt.step, p; not t nor view
    assert len(p1.copies) == len(p1.span_copies) + len(p1.direct) == 24
    s2 = state(0.1, 5)  # fresh tensors, same layout and values: plan and skeleton reused
    back, p2 = roundtrip(s2, 2)
    assert stager.plan_builds == 1 and p2.tail[0][1] is p1.tail[0][1] and back["opt"]["step"].item() == 5.0
    assert all(torch.equal(back["m"][k], s2["m"][k]) for k in s2["m"])
    back, p3 = roundtrip(state(0.2, 6), 3)  # a new lr: same plan, skeleton pickled again
    assert stager.plan_builds == 1 and p3.tail[0] != p1.tail[0] and back["opt"]["lr"] == 0.2
    s4 = state(0.2, 7)
    s4["m"]["p3"] = torch.zeros(2, 3)  # a new shape: a new plan
    back, _ = roundtrip(s4, 4)
    assert stager.plan_builds == 2 and back["m"]["p3"].shape == (2, 3)
    tied = torch.rand(4)
    back, _ = roundtrip({"a": tied, "b": tied}, 5)  # one storage, loaded back shared
    assert back["a"].data_ptr() == back["b"].data_ptr()
    with pytest.raises(UnsafeCheckpointError):  # not plain: PyTorch's weights-only unpickler refuses it
        roundtrip({"obj": Plain(5), "w": torch.rand(2)}, 6)
    back, _ = roundtrip({"obj": Plain(5), "w": torch.rand(2)}, 7, weights_only=False)
    assert back["obj"].v == 5

    # the layout key tells apart what pickles differently
    _, key = plain_layout(s1)
    for other in (dict(s1, opt={**s1["opt"], "lr": 0.11}), dict(s1, opt={**s1["opt"], "betas": [0.9, 0.99]}),
                  {**s1, "m2": s1["m"]}, dict(s1, m={**s1["m"], "p0": s1["m"]["p1"]})):
        assert plain_layout(other)[1] != key
    assert plain_layout({"a": 1})[1] != plain_layout({"a": True})[1] != plain_layout({"a": 1.0})[1]
    assert plain_layout({"a": 0.0})[1] != plain_layout({"a": -0.0})[1]


@pytest.mark.parametrize("name", ["_rebuild_parameter", "_rebuild_tensor_v2"])
def test_fast_unpickler_refuses_build_on_a_global(name):
    """A crafted skeleton: BUILD with slot state ``{"__qualname__": "hijacked"}`` on one of the globals the fast
    unpickler allows. Unrefused, it renames a torch function for the whole process (a later ``torch.save`` of
    a Parameter fails). Right: ``load_plain`` refuses it naming BUILD and the global, the function is
    unchanged, and the fallback (PyTorch's weights-only unpickler) refuses it with UnsafeCheckpointError."""
    from snapckpt.formats.skeleton_unpickler import Refused, load_plain

    def s(text):  # pickle's BINUNICODE
        return b"X" + len(text).to_bytes(4, "little") + text.encode()

    crafted = (b"\x80\x02ctorch._utils\n" + name.encode() + b"\n" + b"N}" + s("__qualname__") + s("hijacked")
               + b"s\x86b0}.")  # GLOBAL, (None, {...}), BUILD, POP, then an empty dict as the result
    fn = getattr(torch._utils, name)
    with pytest.raises(Refused, match=f"BUILD.*torch._utils.{name}"):
        load_plain(crafted, lambda key: None)
    assert fn.__qualname__ == name
    torch.save(torch.nn.Parameter(torch.ones(2)), io.BytesIO())
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        Z.unpickle_skeleton(crafted, {}, weights_only=True)


def _same(a, b, path="state"):
    assert_same_state(a, b, path, strides=True)


def test_layout_memo_finds_the_tensors_in_walking_order_at_any_depth():
    """LayoutMemo.match returns plain_layout's tensors in plain_layout's order, also when tensors sit at several
    depths (its levels meet them breadth-first: a Parameter beside the model dict before the model's tensors)."""
    from snapckpt.formats.plain_layout import LayoutMemo, plain_layout

    state = {"model": {f"w{i}": torch.rand(3, 2) for i in range(4)},
             "opt": {"state": {0: {"exp_avg": torch.rand(4), "step": torch.tensor(3.0)}}, "lr": 0.1},
             "p": torch.nn.Parameter(torch.rand(2)), "last": [torch.rand(1), {"deep": torch.rand(5)}]}
    tensors, key = plain_layout(state)
    memo = LayoutMemo.build(state, tensors, key)
    assert memo is not None
    found, found_key = memo.match(state)
    assert found_key == key
    assert found is not None and len(found) == len(tensors) and all(a is b for a, b in zip(found, tensors))


def test_layout_memo_and_quick_plan_hit_see_every_change_of_a_reused_state():
    """A state saved again and again (the same objects, changed in place between saves) is saved as it is
    now: the memo of its structure (plain_layout.LayoutMemo) and the quick plan-cache check (TensorGuards)
    must miss on each change below, or the loaded state differs from the saved one."""
    from snapckpt.engine.stager import Stager
    from snapckpt.formats.plain_layout import LayoutMemo
    from snapckpt.persister.slot_index import read_slot

    stager, buf, views = Stager(), bytearray(1 << 20), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)

    def roundtrip(state, step):
        p = stager.prepare({"s.pt": state}, step)
        p.views = views
        Stager.copy_into(p, slot, buf)
        assert read_slot(buf, slot, weights_only=True)[0] == step
        return read_slot(buf, slot, weights_only=True)[1]["s.pt"]

    base = torch.arange(40.0)
    od = collections.OrderedDict(w=torch.rand(2), v=torch.rand(3))
    s = {"m": {f"p{i}": torch.rand(3, 2) for i in range(20)}, "od": od, "p": torch.nn.Parameter(torch.rand(2)),
         "opt": {"lr": 0.1, "betas": (0.9, 0.99), "step": 3, "name": "adam", "eps": None, "z": 0.0,
                 "groups": [[1, 2], {"a": torch.rand(2)}]},
         "d1": {"a": torch.rand(1), "b": torch.rand(1)}, "d2": {"c": torch.rand(1)}, "view": base[8:12],
         1: torch.rand(2), "x": torch.rand(4), "y": torch.rand(4), "u": torch.rand(5), "v": torch.rand(5),
         "e1": torch.empty(0), "e2": torch.empty(0)}
    tied = torch.rand(4)
    s["t1"], s["t2"] = tied, tied.view(4)  # two tensors, one storage, the same data pointer
    twice = [("u", "v"), ("t2", "t1"), ("e2", "e1"), ("y2", "y")]  # (key, key of the tensor it became)

    def move_entry(s):
        s["d2"] = {"b": s["d1"].pop("b"), **s["d2"]}  # the same keys and values in the same flat order

    def reinsert(s):
        s["opt"]["lr"] = s["opt"].pop("lr")

    def int_key_to_bool(s):
        s[True] = s.pop(1)

    def tie_storage(s):
        s["x"].set_(s["y"].untyped_storage(), 0, (4,), (1,))

    changes = [
        lambda s: s["m"].__setitem__("p0", torch.rand(3, 2)),  # a new tensor, same layout
        lambda s: s["m"].__setitem__("p1", torch.rand(2, 3)),  # a new shape
        lambda s: s["m"]["p2"].resize_(6),  # the same object resized
        lambda s: setattr(s["m"]["p3"], "data", s["m"]["p3"].data.double()),  # the same object, a new dtype
        lambda s: s["m"]["p4"].t_(),  # new strides
        lambda s: s["p"].requires_grad_(False),
        lambda s: s.__setitem__("view", base[4:8]),  # a new storage offset
        tie_storage,  # two tensors now share a storage
        lambda s: s["m"].__setitem__("extra", torch.rand(1)),
        lambda s: s["m"].pop("p5"),
        lambda s: s["opt"].__setitem__("lr", 0.2),
        lambda s: s["opt"].__setitem__("step", True),
        lambda s: s["opt"].__setitem__("z", -0.0),
        lambda s: s["opt"].__setitem__("name", "adamw"),
        lambda s: s["opt"].__setitem__("eps", 0),
        lambda s: s["opt"].__setitem__("betas", (0.9, 0.999)),
        lambda s: s["opt"]["groups"][0].append(3),
        lambda s: s["opt"]["groups"][0].__setitem__(1, torch.rand(2)),  # an int became a tensor
        lambda s: s["opt"]["groups"][1].__setitem__("a", 5),  # a tensor became an int
        move_entry,
        reinsert,
        int_key_to_bool,
        lambda s: setattr(s["od"], "_metadata", {"w": {"version": 1}}),
        lambda s: s["od"]._metadata["w"].__setitem__("version", 2),
        lambda s: s.__setitem__("m2", s["m"]),  # one container twice
        lambda s: s.pop("m2"),
        # one tensor twice, in place of another (the same keys and types: the memo matches, the plan check must
        # see it), each undone before the next (no memo is made of a state with a tensor twice):
        lambda s: s.__setitem__("u", s["v"]),  # ... of distinct storages
        lambda s: s.__setitem__("u", torch.rand(5)),
        lambda s: s.__setitem__("t2", s["t1"]),  # ... of one storage: the same data pointers as before
        lambda s: s.__setitem__("t2", s["t1"].view(4)),
        lambda s: s.__setitem__("e2", s["e1"]),  # ... without storage (null data pointers)
        lambda s: s.__setitem__("e2", torch.empty(0)),
        lambda s: s.__setitem__("u", torch.nn.Parameter(s["u"].detach().clone(), requires_grad=False)),  # type only
        lambda s: s.__setitem__("y2", s["y"]),  # one tensor twice, under a new key
    ]
    step = 0
    for i, change in enumerate(changes):
        for _ in range(2):  # two equal saves: the second makes the memo, a third would use it
            step += 1
            _same(roundtrip(s, step), s)
        repeats = "m2" in s or any(s.get(a) is s[b] for a, b in twice)  # a container or tensor met twice: no memo
        assert (type(stager._memos["s.pt"].memo) is LayoutMemo) != repeats, i
        change(s)
        step += 1
        back = roundtrip(s, step)
        _same(back, s)
        if change is tie_storage:
            assert back["x"].untyped_storage().data_ptr() == back["y"].untyped_storage().data_ptr()
        assert [back.get(a) is back[b] for a, b in twice] == [s.get(a) is s[b] for a, b in twice], i
    assert back["y2"] is back["y"] and any(lay.recheck for lay in stager._layouts.values())


def test_a_bare_value_or_tensor_saved_again_and_again_is_saved_each_time():
    """A file whose object is a bare value or tensor (no container): its second equal save must not try to make a
    memo of it (len() of an int or a 0-d tensor raised TypeError)."""
    from snapckpt.engine.stager import Stager
    from snapckpt.persister.slot_index import read_slot

    stager, buf = Stager(), bytearray(1 << 16)
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    step = 0
    for obj in (5, "s", None, 1.5, torch.tensor(3.0), torch.arange(3.0)):
        for _ in range(3):
            step += 1
            p = stager.prepare({"s.pt": obj}, step)
            Stager.copy_into(p, slot, buf)
            got = read_slot(buf, slot, weights_only=True)[1]["s.pt"]
            assert type(got) is type(obj) and (torch.equal(got, obj) if type(obj) is torch.Tensor else got == obj)


def test_a_memo_finds_tensors_at_different_depths_in_walking_order():
    """A state whose tensors sit at different depths (a deeper dict before a tensor of the top level) is met in
    another order breadth-first than walked: the memo's match must give the walking order back, or, with every
    shape equal (the same plan), each tensor's values are saved under another's key from the third save on."""
    from snapckpt.engine.stager import Stager
    from snapckpt.formats.plain_layout import LayoutMemo, plain_layout
    from snapckpt.persister.slot_index import read_slot

    stager, buf, views = Stager(), bytearray(1 << 18), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    s = {"m": {f"p{i}": torch.rand(2) for i in range(3)}, "e": torch.rand(2), "l": [{"q": torch.rand(2)}]}
    tensors, key = plain_layout(s)
    got = LayoutMemo.build(s, tensors, key).match(s)[0]
    assert len(got) == len(tensors) == 5 and all(a is b for a, b in zip(got, tensors))
    for step in range(4):  # the third and fourth saves find the tensors by the memo
        p = stager.prepare({"s.pt": s}, step)
        p.views = views
        Stager.copy_into(p, slot, buf)
        _same(read_slot(buf, slot, weights_only=True)[1]["s.pt"], s)
        for t in tensors:
            t.add_(1.0)
    assert type(stager._memos["s.pt"].memo) is LayoutMemo and stager.plan_builds == 1


def test_a_plain_file_keeps_its_pickle_beside_raw_bytes_that_change_every_save():
    """Files saved together (a model, an optimizer, raw JSON as the Hugging Face callback adds): a plain file
    whose structure and values did not change reuses its pickle; a changed one is pickled again."""
    from snapckpt.engine.stager import Stager
    from snapckpt.persister.slot_index import read_slot

    stager, buf = Stager(), bytearray(1 << 20)
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    model = {f"w{i}": torch.rand(2) for i in range(20)}
    opt = {"lr": 0.1, "state": {0: {"m": torch.rand(2)}}}

    def roundtrip(step):
        files = {"model.pt": model, "opt.pt": opt, "state.json": RawBytes(b"{}" * step)}
        p = stager.prepare(files, step)
        Stager.copy_into(p, slot, buf)
        got = read_slot(buf, slot, weights_only=True)[1]
        _same(got["model.pt"], model)
        _same(got["opt.pt"], opt)
        assert got["state.json"] == b"{}" * step
        return [data for _, data in p.tail]

    t1 = roundtrip(1)
    t2 = roundtrip(2)
    assert t2[0] is t1[0] and t2[1] is t1[1] and t2[2] != t1[2]  # both pickles reused, the JSON is new
    opt["lr"] = 0.2
    t3 = roundtrip(3)
    assert t3[0] is t1[0] and t3[1] != t1[1]
    model["w0"] = torch.rand(3)  # a new plan: everything pickled again
    assert roundtrip(4)[0] is not t1[0] and stager.plan_builds == 2


def test_a_quick_check_that_keeps_missing_is_not_remade_every_save(monkeypatch):
    """A layout found by its signature after its quick check missed gets a new check, but not forever: a check
    that keeps missing (something outside the signature changes between saves) stops being made, and the
    layout is still found by its signature (no new plan)."""
    from snapckpt.engine import stager as stager_mod

    made = []
    init = layout_check.Recheck.__init__

    def counting_init(self, *args):
        made.append(1)
        init(self, *args)

    monkeypatch.setattr(layout_check.Recheck, "__init__", counting_init)
    monkeypatch.setattr(layout_check.Recheck, "matches", lambda self, tensors: False)
    stager, buf = stager_mod.Stager(), bytearray(1 << 16)
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    state = {f"w{i}": torch.rand(3) for i in range(5)}
    for step in range(6):
        p = stager.prepare({"s.pt": state}, step)
        stager_mod.Stager.copy_into(p, slot, buf)
    assert stager.plan_builds == 1 and len(made) == layout_check.RECHECKS_KEPT == 2
    assert all(lay.recheck is None for lay in stager._layouts.values())
    monkeypatch.undo()
    other = {f"w{i}": torch.rand(3) for i in range(5)}
    assert stager.prepare({"s.pt": other}, 7).layout is p.layout and stager.plan_builds == 1


def test_a_quick_plan_hit_reads_the_grouping_from_the_data_pointers_and_sees_one_tensor_twice():
    """The plan check of a state saved again reads the data pointers and compares them with the last hit's (no
    grouping recomputed while they are equal); a memo's match leaves the check for one tensor object met twice to
    it (TensorGuards refuses repeated objects: pinned here), so a tensor put in place of another must still be
    seen, also where no storage tells them apart (empty tensors have null data pointers)."""
    from snapckpt.engine import stager as stager_mod
    from snapckpt.persister.slot_index import read_slot

    stager, buf, views = stager_mod.Stager(), bytearray(1 << 18), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)
    grouped = []
    groups = layout_check._groups

    def counting_groups(*args):
        grouped.append(1)
        return groups(*args)

    def roundtrip(state, step):
        p = stager.prepare({"s.pt": state}, step)
        p.views = views
        stager_mod.Stager.copy_into(p, slot, buf)
        return read_slot(buf, slot, weights_only=True)[1]["s.pt"]

    s = {"m": {f"p{i}": torch.rand(3) for i in range(20)}, "e1": torch.empty(0), "e2": torch.empty(0)}
    for step in range(3):  # the third save finds its tensors by the memo and its plan by the quick check
        roundtrip(s, step)
    layout_check._groups = counting_groups
    try:
        _same(roundtrip(s, 3), s)
        assert not grouped and stager.plan_builds == 1  # the same pointers: the grouping is the last hit's
        s["m"]["p0"] = torch.rand(3)
        _same(roundtrip(s, 4), s)
        assert len(grouped) == 1 and stager.plan_builds == 1  # a new pointer: grouped again, the same plan
    finally:
        layout_check._groups = groups
    x, y = torch.empty(0), torch.empty(0)
    guards = layout_check._TensorGuards(x, y, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    assert guards.check(x, y) and not guards.check(x, x) and not guards.check(y, y)
    s["e2"] = s["e1"]
    back = roundtrip(s, 5)
    _same(back, s)
    assert back["e2"] is back["e1"]
    s["e2"] = torch.empty(0)
    for step in range(6, 9):  # the memo and the quick check of this layout again
        roundtrip(s, step)
    builds = stager.plan_builds
    s["m"]["p1"] = s["m"]["p2"]  # a repeat seen before a plan is made for the matched list: one new plan, the walk's
    back = roundtrip(s, 9)
    _same(back, s)
    assert back["m"]["p1"] is back["m"]["p2"] and stager.plan_builds == builds + 1


def _chunked_state(tied: bool) -> dict:
    """20 tensors, in 7 chunks of the quick check at 3 a chunk: two empty ones (null data pointers) in chunks 4
    and 6; with ``tied``, two views of one storage of equal shape in chunks 4 and 5 (a grouping of storages)."""
    base = torch.rand(8)
    return {"m": {f"p{i}": torch.rand(3) for i in range(12)}, "e1": torch.empty(0),
            "t": {"a": base, "x": torch.rand(2), "y": torch.rand(2), "z": torch.rand(2),
                  "b": base.view(8) if tied else torch.rand(8)},
            "e2": torch.empty(0), "last": torch.rand(3)}


def _alias_pattern(state) -> tuple:
    """The walk's key (a tensor object met again is its first index) and which tensors share a storage."""
    from snapckpt.formats.plain_layout import plain_layout

    tensors, key = plain_layout(state)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    return key, [ptrs.index(p) if p else i for i, p in enumerate(ptrs)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("change", [
    "one object in two chunks", "an empty one in two chunks", "a tied view replaced by its base", "a new shape",
    "a new storage offset", "requires_grad", "a new dtype", "nothing"])
def test_a_quick_check_in_chunks_sees_any_change_in_any_chunk_and_a_tensor_met_twice_across_chunks(
        monkeypatch, tied, change):
    """The quick plan check reads the tensors chunk by chunk (each TensorGuards sees repeats within its chunk
    only): a tensor object put in a second place in another chunk (with its own storage, without data, or in
    place of a view of the same storage, where the data pointers and the grouping are the same) is still seen,
    and so is a change of any field of the signature in any chunk; the saved state loads to the live one."""
    from snapckpt.engine import stager as stager_mod
    from snapckpt.persister.slot_index import read_slot

    monkeypatch.setattr(layout_check, "CHUNK", 3)
    stager, buf, views = stager_mod.Stager(), bytearray(1 << 18), {}
    slot = torch.frombuffer(buf, dtype=torch.uint8)

    def roundtrip(state, step):
        p = stager.prepare({"s.pt": state}, step)
        p.views = views
        stager_mod.Stager.copy_into(p, slot, buf)
        back = read_slot(buf, slot, weights_only=True)[1]["s.pt"]
        _same(back, state)
        assert _alias_pattern(back) == _alias_pattern(state), (change, step)
        return p

    s = _chunked_state(tied)
    for step in range(3):  # the third save finds its tensors by the memo and its plan by the quick check
        roundtrip(s, step)
    layout = next(iter(stager._layouts.values()))
    assert layout.recheck is not None and len(layout.recheck.chunks) == 7 and layout.recheck.distinct is not tied
    if change == "one object in two chunks":
        s["t"]["x"] = s["m"]["p1"]
    elif change == "an empty one in two chunks":
        s["e2"] = s["e1"]
    elif change == "a tied view replaced by its base":
        s["t"]["b"] = s["t"]["a"]
    elif change == "a new shape":
        s["last"] = torch.rand(4)
    elif change == "a new storage offset":
        s["m"]["p11"].set_(torch.rand(5).untyped_storage(), 2, (3,), (1,))
    elif change == "requires_grad":
        s["m"]["p7"].requires_grad_(True)
    elif change == "a new dtype":
        s["m"]["p5"] = s["m"]["p5"].double()
    builds = stager.plan_builds
    for step in range(3, 6):  # the changed state, then saved again (its own quick check)
        roundtrip(s, step)
    assert stager.plan_builds == builds + (change != "nothing")


@pytest.mark.parametrize("restorable", [False, True])
def test_the_quick_checks_restore_check_sees_a_tensor_met_twice_in_two_chunks(monkeypatch, restorable):
    """The restore's check of a quick check in chunks (by one TensorGuards of every tensor for a layout the
    in-process restore takes, else chunk by chunk and a sort of the objects) refuses a tensor object met twice
    in two chunks, a count or a shape of another layout, and takes the tensors it was made of."""

    monkeypatch.setattr(layout_check, "CHUNK", 3)
    ts = [torch.rand(2) for _ in range(10)]
    r = layout_check.Recheck(ts, layout_check.signature(ts), restorable)
    assert len(r.chunks) == 4 and (r.whole is None) is not restorable
    assert r.same_tensors(ts) and r.same_tensors([t.clone() for t in ts])
    assert not r.same_tensors(ts[:9] + ts[:1])  # ts[0] in chunks 0 and 3
    assert not r.same_tensors(ts[:9])
    assert not r.same_tensors(ts[:7] + [torch.rand(3)] + ts[8:])
