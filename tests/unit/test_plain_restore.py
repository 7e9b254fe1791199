"""The memory-tier restore of a slot by its plain digest (snapckpt.engine.plain_restore): a process that did not write
the slot (a restart: a fresh Stager) copies it straight into a live state of the saved layout; any difference of
name, structure, value, dtype, shape or step, a slot without a digest, or a live tensor that cannot take bytes
leaves it to the general path (None)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from types import SimpleNamespace

import torch

from snapckpt.engine import plain_restore
from snapckpt.engine.stager import Stager
from snapckpt.formats import plain_digest
from snapckpt.persister.arena import read_header
from snapckpt.persister.slot_index import read_slot

NAME = "rank_00000.pt"


def _slot(nbytes: int = 4 << 20) -> SimpleNamespace:
    buf = bytearray(nbytes)  # what a MappedSlot holds: the buffer, a uint8 tensor over it, its size
    return SimpleNamespace(buf=buf, tensor=torch.frombuffer(buf, dtype=torch.uint8), views={}, nbytes=nbytes,
                           path="slot")


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
        return torch.nn.Parameter(torch.zeros_like(state))
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def _tensors(state) -> list:
    from snapckpt.formats.plain_layout import plain_layout

    return plain_layout(state)[0]


def _find(m, live, step: int = 1, name: str = NAME):
    from snapckpt.formats.plain_layout import plain_layout

    return plain_restore.find(lambda _n, obj: plain_layout(obj), m, name, step, live)


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
    """A live state that differs from the saved one in structure, key, value, dtype or shape gets None, and so does
    a slot of another step or file, or one without a digest (an older slot, or a layout that is not direct)."""
    def changed(change, state_fn=_state):
        state = state_fn()
        m = _save(state)
        live = _zeros_like(state)
        change(live)
        return _find(m, live)

    assert changed(lambda s: None) is not None  # the control
    assert changed(lambda s: s.__setitem__("iteration", 8)) is None  # a value the restore must replace
    assert changed(lambda s: s.__setitem__("iteration", 7.0)) is None  # an equal value of another type
    assert changed(lambda s: s["opt"]["param_groups"][0].__setitem__("lr", 0.2)) is None
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

    # an index without the digest (written before it existed): the entry blanked, still valid JSON
    old = _save(state)
    _, off, n = read_header(old.buf)
    index = bytes(old.buf[off:off + n])
    start = index.index(b'"plain"')
    old.buf[off + start:off + start + 75] = b" " * 75
    assert json.loads(bytes(old.buf[off:off + n]))["step"] == 1
    assert _find(old, _zeros_like(state)) is None
    assert read_slot(old.buf, old.tensor, weights_only=True)[0] == 1  # and the general path reads it
    # a damaged digest
    bad = _save(state)
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
            "from snapckpt.formats import plain_digest as d; from snapckpt.formats.plain_layout import plain_layout\n"
            "from snapckpt.engine.plain_restore import direct_offsets\n"
            "s = {'m': OrderedDict(a=torch.zeros(3, 2), b=torch.zeros(4)), 'x': [1, 2.5, None, 'y', True],"
            " 'd': {i: torch.zeros(1) for i in range(20)}}\n"
            "t, k = plain_layout(s); f = d.Facts(t); o, _ = direct_offsets(f)\n"
            "print(d.digest('r.pt', k, d.tensor_part(f, o.tolist())))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    from snapckpt.formats.plain_layout import plain_layout

    s = {"m": OrderedDict(a=torch.ones(3, 2), b=torch.ones(4)), "x": [1, 2.5, None, "y", True],
         "d": {i: torch.ones(1) for i in range(20)}}
    t, k = plain_layout(s)
    f = plain_digest.Facts(t)
    o, _ = plain_restore.direct_offsets(f)
    assert plain_digest.digest("r.pt", k, plain_digest.tensor_part(f, o.tolist())) == out


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


def test_a_nan_value_keeps_its_sign_in_the_skeleton_and_the_digest():
    """``float.hex`` gives ``'nan'`` for every NaN, but pickle keeps a NaN's sign: a save whose only change is a NaN's
    sign must pickle its skeleton again (not reuse the last one), and a live NaN of the other sign must not match."""
    import math

    nan, neg = float("nan"), -float("nan")
    assert math.copysign(1, neg) == -1
    stager, m, w = Stager(), _slot(), torch.rand(3)
    for step, v in ((1, nan), (2, neg)):  # one Stager: the second save may reuse the first one's skeleton
        Stager.copy_into(stager.prepare({NAME: {"w": w, "loss": v}}, step), m.tensor, m.buf)
    got = read_slot(m.buf, m.tensor, weights_only=True)[1][NAME]["loss"]
    assert math.isnan(got) and math.copysign(1, got) == -1
    assert _find(m, {"w": torch.zeros(3), "loss": nan}, step=2) is None
    assert _find(m, {"w": torch.zeros(3), "loss": -float("nan")}, step=2) is not None  # the control


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
