"""Property test of a restarted process's plain restore (snapckpt.engine.plain_restore.find, by the digest of
snapckpt.formats.plain_digest and the level walk of snapckpt.formats.plain_levels): random nested states are saved
by a fresh Stager, a live state of the saved structure is built as a restarted process builds it (same structure,
other values), its structure is changed in one of many ways (keys, key types and order, container types, depth, a
tensor replaced or moved, aliasing, shared storage, dtype, shape, strides, scalars' types, unusual keys), and the
restore either refuses (``None``: the general path decides) or leaves the live state equal, bit for bit, to the
saved one in the saved structure. Never silently other values. Seeded: the same cases every run."""
from __future__ import annotations

import random
import struct
from collections import OrderedDict
from types import SimpleNamespace

import torch

from snapckpt.engine import plain_restore
from snapckpt.engine.restore import copy_into
from snapckpt.engine.stager import Stager
from snapckpt.persister.slot_index import read_slot

NAME = "rank_00000.pt"
# keys that compare or print alike: 1 == 1.0 == True, "1" prints as 1 does in a join, NUL and odd characters
KEYS = ["a", "b", "c", 1, 2, "1", "2", 1.5, -0.0, None, "", "x\0y", "x", "y", "\udcff", "é", "a\nb", "0x1.8p+0"]
DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool, torch.bfloat16, torch.complex64, torch.uint8]
SHAPES = [(3,), (3,), (3,), (2, 3), (3, 2), (6,), (), (1, 3), (4,)]


def _slot(nbytes: int = 1 << 20) -> SimpleNamespace:
    buf = bytearray(nbytes)
    return SimpleNamespace(buf=buf, tensor=torch.frombuffer(buf, dtype=torch.uint8), views={}, nbytes=nbytes,
                           path="slot", map_for_reading=lambda upto: None)


def _save(state, stager=None, step: int = 1):
    m = _slot()
    p = (stager or Stager()).prepare({NAME: state}, step)
    Stager.copy_into(p, m.tensor, m.buf)
    # a bytearray grows where a snapshot runs past its end (an arena slot cannot), and m.tensor then views freed
    # memory: such a harness would report wrong values of its own making
    assert len(m.buf) == m.nbytes, "the snapshot does not fit the test's slot"
    return m


def _tensor(rng: random.Random, same: bool):
    """Mostly float32 of 3 elements: tensors that a digest of dtypes and shapes alone cannot tell apart."""
    dtype = torch.float32 if same else rng.choice(DTYPES)
    shape = (3,) if same else rng.choice(SHAPES)
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    bits = torch.randint(0, 256, (max(1, int(torch.Size(shape).numel())) * dtype.itemsize,), dtype=torch.uint8,
                         generator=g)
    if dtype is torch.bool:
        bits &= 1
    return bits.view(dtype)[:torch.Size(shape).numel()].reshape(shape).clone()


def _scalar(rng: random.Random):
    return rng.choice([lambda: rng.randrange(-5, 5), lambda: rng.random(), lambda: rng.random() < 0.5,
                       lambda: rng.choice(["s", "", "\0"]), lambda: None, lambda: 2**70 + rng.randrange(3)])()


def _state(rng: random.Random, depth: int = 0):
    n = rng.randrange(1, 6)
    items = []
    for k in rng.sample(KEYS, n):
        r = rng.random()
        if r < 0.45:
            v = _tensor(rng, rng.random() < 0.7)
        elif r < 0.65 and depth < 4:
            v = _state(rng, depth + 1)
        elif r < 0.8:
            v = _scalar(rng)
        else:
            v = rng.choice([list, tuple])(_scalar(rng) for _ in range(rng.randrange(0, 3)))
        items.append((k, v))
    d = (OrderedDict if rng.random() < 0.3 else dict)(items)
    if type(d) is OrderedDict and rng.random() < 0.3:
        d._metadata = {"": {"version": rng.randrange(3)}}
    return d


def _relive(s):
    """A live state of ``s``'s structure as a restarted process builds it: fresh tensors of other bytes, other
    scalars of the same types, an OrderedDict's attributes kept."""
    if isinstance(s, dict):
        d = type(s)((k, _relive(v)) for k, v in s.items())
        if type(s) is OrderedDict:
            vars(d).update(vars(s))
        return d
    if isinstance(s, list):
        return [_relive(v) for v in s]
    if isinstance(s, tuple):
        return tuple(_relive(v) for v in s)
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    if type(s) is int:
        return s + 1
    if type(s) is float:
        return s + 1.0
    if type(s) is str:
        return s + "!"
    return s


def _dicts(s, out):
    if isinstance(s, dict):
        out.append(s)
        for v in s.values():
            _dicts(v, out)
    return out


def _rebuild(d, items):
    """Replace ``d``'s items in place by ``items`` (keeps the object: its parent still holds it)."""
    d.clear()
    d.update(items)


def _mutate(live, rng: random.Random) -> str:
    """Change ``live``'s structure in one way; the name of the change ("" when none applied)."""
    ds = _dicts(live, [])
    d = rng.choice(ds)
    keys = list(d)
    tens = [(x, k) for x in ds for k in x if isinstance(x[k], torch.Tensor)]
    kind = rng.randrange(22)
    k = rng.choice(keys) if keys else None
    if kind == 0 and keys:  # a key of another type or name (1 -> "1", 1 -> 1.0, 1 -> True ...)
        new = rng.choice([1.0, True, "1", 1, "a", "x\0y", "x", 2.0, False, 0, "0x1.8p+0", 1.5, "b"])
        if new in d and new is not k:
            return ""
        _rebuild(d, [(new if kk is k else kk, v) for kk, v in d.items()])
        return "rename" if not (type(new) is type(k) and new == k) else ""
    if kind == 1 and len(keys) > 1:  # the order of two keys
        i, j = rng.sample(range(len(keys)), 2)
        items = list(d.items())
        items[i], items[j] = items[j], items[i]
        _rebuild(d, items)
        return "order"
    if kind == 2 and d is not live:  # dict <-> OrderedDict: replace the object in its parent
        for p in ds:
            for pk, pv in p.items():
                if pv is d:
                    p[pk] = (dict if type(d) is OrderedDict else OrderedDict)(d)
                    return "dict type"
        return ""
    if kind == 3 and keys:  # a list <-> a tuple, or a value wrapped in one
        v = d[k]
        if type(v) is list:
            d[k] = tuple(v)
        elif type(v) is tuple:
            d[k] = list(v)
        else:
            d[k] = [v]
        return "sequence"
    if kind == 4 and tens:  # a tensor replaced by a number or None
        x, tk = rng.choice(tens)
        x[tk] = rng.choice([0, 0.0, None, True, "t"])
        return "tensor to value"
    if kind == 5 and keys:  # a scalar's type
        v = d[k]
        if isinstance(v, torch.Tensor) or isinstance(v, (dict, list, tuple)):
            return ""
        d[k] = rng.choice([v if type(v) is not int else float(v), 1, 1.0, True, "1", None, b"1"])
        return "scalar type" if type(d[k]) is not type(v) else ""
    if kind == 6 and len(tens) > 1:  # a tensor moved to another key (the old key deleted)
        (x, a), (y, b) = rng.sample(tens, 2)
        y[b] = x.pop(a)
        return "tensor moved"
    if kind == 7 and len(tens) > 1:  # one tensor object at two places (tied)
        (x, a), (y, b) = rng.sample(tens, 2)
        if x[a].shape == y[b].shape and x[a].dtype == y[b].dtype:
            y[b] = x[a]
            return "tied"
        return ""
    if kind == 8 and len(ds) > 1:  # one dict at two places
        inner = rng.choice(ds[1:])
        d2 = rng.choice(ds)
        at = rng.choice(list(d2)) if d2 else None
        if not d2 or d2[at] is inner or any(x is d2 for x in _dicts(inner, [])):
            return ""  # no cycle: a state holding itself is not plain
        d2[at] = inner
        return "dict alias"
    if kind == 9 and len(tens) > 1:  # two tensors over one storage (disjoint or overlapping views)
        (x, a), (y, b) = rng.sample(tens, 2)
        ta, tb = x[a], y[b]
        if ta.dtype != tb.dtype or ta.dim() == 0 or tb.dim() == 0:
            return ""
        gap = rng.choice([0, ta.numel(), ta.numel() + 5])  # 0: overlapping
        base = torch.zeros(gap + tb.numel() + ta.numel(), dtype=ta.dtype)
        x[a] = base[:ta.numel()].view(ta.shape)
        y[b] = base[gap:gap + tb.numel()].view(tb.shape)
        return "overlap" if gap < ta.numel() else "shared storage"
    if kind == 10 and tens:  # another dtype
        x, tk = rng.choice(tens)
        new = rng.choice(DTYPES)
        if new == x[tk].dtype:
            return ""
        x[tk] = torch.zeros(x[tk].shape, dtype=new)
        return "dtype"
    if kind == 11 and tens:  # another shape (often the same element count)
        x, tk = rng.choice(tens)
        t = x[tk]
        new = rng.choice([(t.numel(),), (1, t.numel()), (t.numel(), 1), (), (0,), (t.numel() + 1,)])
        if tuple(t.shape) == new:
            return ""
        x[tk] = torch.zeros(new, dtype=t.dtype)
        return "shape"
    if kind == 12 and tens:  # not contiguous
        x, tk = rng.choice(tens)
        t = x[tk]
        if t.dim() != 2 or 1 in t.shape:
            x[tk] = torch.zeros(t.numel() * 2, dtype=t.dtype)[::2].view(t.shape) if t.dim() <= 1 else t
            return "strided" if t.dim() <= 1 and t.numel() > 1 else ""
        x[tk] = torch.zeros(t.shape[::-1], dtype=t.dtype).t()
        return "strided"
    if kind == 13 and keys:  # a key removed
        del d[k]
        return "key removed"
    if kind == 14:  # a key added
        new = rng.choice(KEYS + [3, "zz"])
        if new in d:
            return ""
        d[new] = rng.choice([torch.zeros(3), 1, {}, [], None])
        return "key added"
    if kind == 15 and keys:  # one level deeper, or a dict flattened one level
        v = d[k]
        if isinstance(v, dict) and len(v) == 1 and rng.random() < 0.5:
            d[k] = next(iter(v.values()))
            return "shallower"
        d[k] = {k: v}
        return "deeper"
    if kind == 16 and tens:  # a zero-element tensor
        x, tk = rng.choice(tens)
        if x[tk].numel() == 0:
            return ""
        x[tk] = torch.zeros(0, dtype=x[tk].dtype)
        return "empty tensor"
    if kind == 17 and len(tens) > 1:  # two tensors swapped between keys: the same structure, other objects
        (x, a), (y, b) = rng.sample(tens, 2)
        if (x[a].dtype, x[a].shape) != (y[b].dtype, y[b].shape):
            return ""
        x[a], y[b] = y[b], x[a]
        return ""  # not a change of structure: must restore
    if kind == 18 and tens:  # a Parameter, or a tensor that requires grad
        x, tk = rng.choice(tens)
        if not x[tk].is_floating_point():
            return ""
        x[tk] = torch.nn.Parameter(x[tk]) if rng.random() < 0.5 else x[tk].requires_grad_()
        return ""  # the same structure (a Parameter is a tensor to the restore)
    if kind == 19 and len(ds) > 1:  # a list held at two places
        lst = [1, 2]
        d[k if keys else "n"] = lst
        d2 = rng.choice(ds)
        for kk in d2:
            if d2[kk] is not lst:
                d2[kk] = lst
                return "list alias"
        return "list"
    if kind == 20 and type(d) is OrderedDict:  # an OrderedDict's attributes
        if vars(d):
            vars(d).clear()
        else:
            d._metadata = {"": {"version": 0}}
        return "od attrs"
    if kind == 21 and tens:  # a tensor moved into a list
        x, tk = rng.choice(tens)
        x[tk] = [x[tk]]
        return "tensor in list"
    return ""


def _equal(a, b) -> bool:
    """``b`` is ``a`` to the bit: container types, key order and key types, values (a float by its bits, a tensor by
    its bytes), an OrderedDict's attribute names (their values are the live ones after any load: copy_into leaves
    them alone)."""
    if type(a) is not type(b) and not isinstance(a, torch.Tensor):
        return False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):  # a live Parameter takes a saved tensor's bytes
        return (a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist())
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return ([(type(k), k) for k in a] == [(type(k), k) for k in b] and all(_equal(a[k], b[k]) for k in a)
                and (type(a) is not OrderedDict or list(vars(a)) == list(vars(b))))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def _check(saved, m, make_live, change: str, step: int = 1) -> str:
    """Restore ``m`` into ``make_live()``: "refused" or "restored" (then bit for bit the saved state, or for
    overlapping live tensors what the general path leaves); AssertionError for anything else."""
    live = make_live()
    found = plain_restore.find(m, NAME, step, live)
    if found is None:
        return "refused"
    found.run()
    if change == "overlap":  # no load can give both tensors their bytes: the fast path must agree with the general
        general = make_live()
        copy_into(general, read_slot(m.buf, m.tensor, weights_only=True)[1][NAME], own=True)
        assert _equal(general, live), f"{change}: the fast path differs from the general path"
    else:
        assert _equal(saved, live), f"{change!r}: restored other values or another structure:\n{saved}\n{live}"
    return "restored"


def _case(seed: int):
    rng = random.Random(seed)
    saved = _state(rng) if seed % 10 else _wide(rng)
    return rng, saved


def _wide(rng: random.Random) -> dict:
    """An optimizer-like state of more than 64 containers a level (plain_levels reads such a level in one pass, and
    plain_values.entries a dict of dicts of tensors in one pass)."""
    n = rng.choice([65, 80])
    state = {}
    for i in range(n):
        d = {"exp_avg": _tensor(rng, True), "exp_avg_sq": _tensor(rng, True)}
        if rng.random() < 0.2:
            d["step"] = rng.choice([_tensor(rng, True), 3, 3.0])
        state[i] = d
    return {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(n))}],
            "model": OrderedDict((f"l{i}", _tensor(rng, rng.random() < 0.8)) for i in range(rng.choice([3, 70])))}


def test_a_changed_structure_is_refused_or_restored_bit_for_bit():
    """500 random states (every 10th a wide one), each changed in one or two ways (or not at all): never other
    values."""
    outcomes = {}
    for seed in range(500):
        rng, saved = _case(seed)
        m = _save(saved)
        mseed = rng.getrandbits(32)

        def make_live(mseed=mseed, saved=saved):
            live = _relive(saved)
            r = random.Random(mseed)
            changes = [_mutate(live, r) for _ in range(1 + (r.random() < 0.2))]  # sometimes two changes
            return live, "overlap" if "overlap" in changes else "+".join(filter(None, changes))

        change = make_live()[1]
        got = _check(saved, m, lambda: make_live()[0], change)
        outcomes.setdefault(change or "none", []).append(got)
    none = outcomes["none"]
    assert none.count("restored") == len(none), outcomes  # not hollow: the fast path takes the saved structure


def test_a_second_save_of_another_structure_by_the_same_stager_is_its_own():
    """A Stager caches the digest while the key structure stays: a state whose structure changed between two saves
    of one Stager is restored only into a live state of the second structure."""
    for seed in range(200):
        rng, first = _case(seed)
        stager = Stager()
        _save(first, stager)
        second = _relive(first)
        change = _mutate(second, random.Random(rng.getrandbits(32)))
        second = _rematerialise(second)
        m = _save(second, stager, step=2)
        assert _check(second, m, lambda: _relive(second), "second", step=2) in ("refused", "restored")
        if change and change not in ("overlap", "tied", "shared storage"):
            assert _check(second, m, lambda: _relive(first), change, step=2) == "refused" or _equal(first, second)


def _rematerialise(s):
    """``s`` with random bytes in its tensors, its aliasing kept (a state as training leaves it)."""
    for t in _tensors_of(s, []):
        if t.numel():
            with torch.no_grad():
                t.copy_(torch.randint(0, 2, t.shape).to(t.dtype))
    return s


def _tensors_of(s, out):
    if isinstance(s, torch.Tensor):
        out.append(s)
    elif isinstance(s, dict):
        for v in s.values():
            _tensors_of(v, out)
    elif isinstance(s, (list, tuple)):
        for v in s:
            _tensors_of(v, out)
    return out


def _values_changed(s, rng: random.Random) -> None:
    """A training step: every tensor's bytes and every scalar replaced in place, the structure and objects kept."""
    for t in _tensors_of(s, []):
        if t.numel():
            with torch.no_grad():
                t.copy_(torch.randint(0, 2, t.shape).to(t.dtype))
    for d in _dicts(s, []):
        for k, v in list(d.items()):
            if type(v) in (int, float, str):
                d[k] = v + type(v)(rng.randrange(1, 9))
            elif type(v) is list:
                v[:] = [x + 1 if type(x) is int else x for x in v]


def test_later_saves_of_one_state_restore_their_own_values():
    """The saves of a training loop (one state object, its values changed between saves, one Stager: its layout
    memo and cached digest are used) each restore their own values into a fresh live state."""
    for seed in range(300):
        rng, state = _case(seed)
        stager = Stager()
        for step in (1, 2, 3):
            if step > 1:
                _values_changed(state, rng)
            m = _save(state, stager, step=step)
            assert _check(state, m, lambda: _relive(state), "none", step=step) == "restored", state


def test_a_structure_changed_in_place_between_saves_of_one_stager_is_its_own():
    """A loop whose state object changes structure in place after the Stager's memo was made (a key added, a type
    changed, ...): the next save's slot restores its own values into a live state of the new structure, and a
    live state of the old structure is refused."""
    outcomes = {}
    for seed in range(400):
        rng, state = _case(seed)
        stager = Stager()
        _save(state, stager, step=1)
        _values_changed(state, rng)
        _save(state, stager, step=2)
        old = _relive(state)
        change = _mutate(state, random.Random(rng.getrandbits(32)))
        _values_changed(state, rng)
        m = _save(state, stager, step=3)
        if change in ("overlap", "tied", "dict alias", "list alias"):
            continue  # _relive does not keep aliasing: those states are checked by the tests above
        got = _check(state, m, lambda: _relive(state), change or "none", step=3)
        outcomes.setdefault(change or "none", []).append(got)
        if change:
            assert _check(state, m, lambda: _relive(old), change, step=3) == "refused" or _equal(old, state)
    assert outcomes["none"].count("restored") == len(outcomes["none"]), outcomes
