"""The optional native loop over many tensors (snapckpt/_native): it passes and refuses what the Python path's checks
pass and refuse (type, dtype, shape, strides, storage offset, requires_grad, inference, a tensor twice, new memory),
an in-process restore and a restarted process's restore through it give the same bytes, version bumps (each once,
by the copy, none by a check) and refusals as without it, and without a built library
(or with ``SNAPCKPT_NATIVE=0``) everything runs the Python path. Builds the library once into the user's cache
(a few seconds; ``scripts/setup.sh`` builds it first), skipped without a C++ compiler."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from _harness import SlotOnFile as _Slot
from snapckpt import _native
from snapckpt._internal import env
from snapckpt.engine import layout_check, plain_restore, slot_restore, span_write
from snapckpt.engine.layout_check import Recheck, signature
from snapckpt.engine.stager import Stager

NAME = "rank_00000.pt"


@pytest.fixture(scope="module")
def native():
    if not env.native():
        pytest.skip("SNAPCKPT_NATIVE=0")
    try:
        _native.build()
    except RuntimeError as e:  # pragma: no cover - a host without a C++ compiler
        pytest.skip(str(e))
    mod = _native.load()
    assert mod is not None
    return mod


def _tensors() -> list:
    g = torch.Generator().manual_seed(0)
    base = torch.rand(40, generator=g)
    return [torch.rand(3, 2, generator=g), torch.randint(0, 9, (5,), generator=g),
            torch.nn.Parameter(torch.rand(4, generator=g)), torch.rand(2, 3, generator=g).t(),  # strides (1, 3)
            base[10:20], torch.zeros(0), torch.rand(1, generator=g).double()]


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _changes() -> list:
    """``(name, change of a tensor list)``: every one the quick check must refuse, and new memory, which it passes
    by recomputing the grouping (the native loop leaves that to the Python path)."""
    def at(i, f):
        return lambda ts: ts[:i] + [f(ts[i])] + ts[i + 1:]
    return [
        ("dtype", at(0, lambda t: t.double())),
        ("shape", at(0, lambda t: t.reshape(2, 3))),
        ("strides", at(3, lambda t: t.contiguous())),
        ("storage offset", at(4, lambda t: t.detach().clone())),
        ("requires_grad", at(2, lambda t: torch.nn.Parameter(t.detach(), requires_grad=False))),
        ("type", at(2, lambda t: t.detach())),
        ("inference", at(0, _inference)),
        ("twice", lambda ts: ts[:1] + ts[:1] + ts[2:]),
        ("count", lambda ts: ts[:-1]),
        ("new memory", lambda ts: [t.detach().clone().requires_grad_(t.requires_grad) if type(t) is torch.Tensor
                                   else t for t in ts[:4]] + ts[4:]),
    ]


def _recheck(tensors: list, with_native: bool) -> Recheck:
    r = Recheck(tensors, signature(tensors), restorable=True)
    if not with_native:
        r.table = None
    return r


def test_the_native_check_passes_and_refuses_what_the_python_check_does(native):
    ts = _tensors()
    assert _recheck(ts, True).native_same(ts) and not _recheck(ts, False).native_same(ts)
    assert _recheck(ts, True).matches(ts) and _recheck(ts, False).matches(ts)
    for name, change in _changes():
        changed = change(list(ts))
        assert not _recheck(ts, True).native_same(changed), name  # the Python path decides
        assert _recheck(ts, True).matches(changed) == _recheck(ts, False).matches(changed), name
        assert (_recheck(ts, True).same_tensors(changed) == _recheck(ts, False).same_tensors(changed)), name
    # a tensor twice among tensors without memory (null data pointers): found after the loop passed
    empty = [torch.zeros(0), torch.zeros(0), torch.rand(2)]
    twice = [empty[0], empty[0], empty[2]]
    r = _recheck(empty, True)
    assert r.table is not None and r.native_same(empty)
    assert not r.native_same(twice) and not r.matches(twice) and not _recheck(empty, False).matches(twice)


def test_the_native_bump_is_torchs_increment_version_and_the_check_bumps_nothing(native, monkeypatch):
    """``bump`` (``_native.increment_version``) bumps what torch's ``increment_version`` bumps: every tensor once
    (views share their base's counter), inference tensors skipped inside inference mode and out; an item that is not
    a tensor raises TypeError. The checks change no version."""
    def versions(ts):  # an inference tensor has no version counter
        return [-1 if t.is_inference() else t._version for t in ts]

    def both(make, inside: bool = False):
        got = []
        for with_native in (True, False):
            with monkeypatch.context() as mp:
                if not with_native:
                    mp.setenv("SNAPCKPT_NATIVE", "0")
                ts = make()
                before = versions(ts)
                if inside:
                    with torch.inference_mode():
                        _native.increment_version(ts)
                else:
                    _native.increment_version(ts)
                got.append([a - b for a, b in zip(versions(ts), before)])
        assert got[0] == got[1]
        return got[0]

    base = torch.rand(6)
    assert both(lambda: [t.detach() for t in _tensors()]) == [1] * 7
    assert both(lambda: [base[:2], base[2:], torch.rand(2)]) == [2, 2, 1]  # one counter for base's views
    assert both(lambda: [_inference(torch.rand(2)), torch.rand(2)]) == [0, 1]
    assert both(lambda: [_inference(torch.rand(2)), torch.rand(2)], inside=True) == [0, 1]
    with pytest.raises(TypeError):
        native.bump([torch.rand(2), 3], torch.Tensor)
    ts = [t.detach() for t in _tensors()]
    before = versions(ts)
    r = _recheck(ts, True)
    assert r.native_same(ts) and r.matches(ts) and versions(ts) == before


def _restore(tmp_path, state: dict, with_native: bool, change=None):
    """Save ``state`` three times, change it (training went on; ``change``: then into another state), restore in
    process with or without the native records; returns ``((read back, spans read, spans) or None, the live
    tensors' version increments, the saved values, the live state)``."""
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / f"slot{int(with_native)}", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):
        p = s.save(st, state, step)
    assert (p.layout.recheck.table is not None) is True
    if not with_native:
        p.layout.recheck.table = None
    saved = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.add_(1)
    live = change(state) if change else state
    versions = {k: v._version for k, v in live.items()}
    found = slot_restore.find(st, s.m, NAME, 3, live)
    if found is not None:
        found.run()
        # what the test compares (the found copies hold views of the mapping, closed here)
        found = (found.back is not None, found.read_by_file, len(found.back[1].pos) if found.back else 0)
    s.m.close()
    return found, {k: v._version - versions[k] for k, v in live.items()}, saved, live


@pytest.mark.parametrize("large", [False, True])  # every tensor read back (the bump in the check), or one by torch
def test_an_in_process_restore_gives_the_same_bytes_and_bumps_with_the_native_check_or_without(tmp_path, native,
                                                                                               large):
    def state() -> dict:
        g = torch.Generator().manual_seed(1)
        s = {f"t{i}": torch.rand(1 + i % 37, generator=g) for i in range(3 * span_write._BATCH + 5)}
        if large:
            s["big"] = torch.rand(span_write.SMALL_NBYTES // 4 + 3, generator=g)
        return s
    runs = {}
    for with_native in (True, False):
        found, bumps, saved, live = _restore(tmp_path, state(), with_native)
        by_file, read, spans = found
        assert by_file and read == spans > 0
        for k, v in live.items():
            assert torch.equal(v, saved[k]), k
        runs[with_native] = bumps
    assert runs[True] == runs[False] and set(runs[True].values()) == {1}  # each version bumped once


def test_a_restore_into_tensors_of_another_dtype_shape_or_memory_goes_as_without_the_native_check(tmp_path, native):
    def state() -> dict:
        g = torch.Generator().manual_seed(2)
        return {f"t{i}": torch.rand(2 + i % 5, generator=g) for i in range(40)}
    changes = {
        "dtype": lambda s: {**s, "t3": s["t3"].double()},
        "shape": lambda s: {**s, "t3": s["t3"].resize_(s["t3"].numel() - 1)},
        "strides": lambda s: {**s, "t3": torch.rand(2, s["t3"].numel()).t()[:, 0]},
        "memory": lambda s: {k: v.clone() for k, v in s.items()},
    }
    for name, change in changes.items():
        got = []
        for with_native in (True, False):
            found, bumps, saved, live = _restore(tmp_path, state(), with_native, change)
            got.append((found and found[:3], bumps))
            if found is not None:
                assert all(torch.equal(v, saved[k].to(v.dtype)) for k, v in live.items()), name
        assert got[0] == got[1], name


def test_without_a_built_library_or_with_the_knob_off_the_python_path_runs(tmp_path, monkeypatch):
    assert _native.load(str(tmp_path)) is None  # nothing built there: nothing compiled either
    assert not any(tmp_path.iterdir())
    path = _native.library_path(str(tmp_path))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a library")
    assert _native.load(str(tmp_path)) is None
    real = _native.load
    monkeypatch.setattr(layout_check._native, "load", lambda: real(str(tmp_path)))
    ts = _tensors()
    r = Recheck(ts, signature(ts))
    assert r.table is None and not r.native_same(ts) and r.matches(ts)
    assert not r.matches(ts[:1] + ts[:1] + ts[2:])
    monkeypatch.setenv("SNAPCKPT_NATIVE", "0")
    assert real() is None
    monkeypatch.setenv("SNAPCKPT_NATIVE", "2")
    with pytest.raises(ValueError, match="SNAPCKPT_NATIVE"):
        real()


def test_a_foreign_library_at_the_path_is_not_loaded(tmp_path):
    """An extension module of the right name that is not this source's build (no probe()) at the library's path:
    load() answers None (the Python path), it does not raise into the save's quick check."""
    import subprocess
    import sysconfig
    path = _native.library_path(str(tmp_path))
    os.makedirs(os.path.dirname(path))
    src = tmp_path / "m.c"
    src.write_text('#include <Python.h>\nstatic PyModuleDef m = {PyModuleDef_HEAD_INIT, "snapckpt_tensor_loops", 0, -1, 0};\n'
                   "PyMODINIT_FUNC PyInit_snapckpt_tensor_loops(void) { return PyModule_Create(&m); }\n")
    cc = os.environ.get("CC") or "cc"
    try:
        subprocess.run([cc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(src), "-o", path],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:  # pragma: no cover - a host without a C compiler
        pytest.skip(f"no C compiler: {e}")
    with open(path + ".sha256", "w") as f:  # as build() writes it: the import and the probe are what refuse it
        f.write(_native._digest(path))
    assert _native.load(str(tmp_path)) is None


def test_a_truncated_library_is_not_loaded(tmp_path, native):
    """A copy of the built library cut short (a full disk, an interrupted copy of a shared home): dlopen of it died
    of SIGBUS inside load(), on the first save (found by a break-it trial). Now load() checks the file against the
    digest build() wrote beside it and answers None (the Python path)."""
    import shutil
    built = _native.library_path()
    path = _native.library_path(str(tmp_path))
    os.makedirs(os.path.dirname(path))
    shutil.copyfile(built + ".sha256", path + ".sha256")
    with open(built, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read()[:20000])
    assert _native.load(str(tmp_path)) is None
    shutil.copyfile(built, path)  # the whole file: loaded
    assert _native.load(str(tmp_path)) is None  # (answers are cached per directory and process)
    assert _native.load(os.path.dirname(os.path.dirname(built))) is not None


@pytest.mark.parametrize("with_native", [True, False])
def test_an_in_process_restore_bumps_each_version_once_and_only_when_it_copies(tmp_path, native, with_native):
    """``find`` changes no version (a restore found on this rank is not copied when another rank refuses the
    step); ``run`` bumps each exactly once, also when the slot file was replaced after it was mapped (``preadv``
    cannot read it: torch copies every tensor from the mapping, and bumps them). The native check used to bump in
    ``find``, when every tensor was to be read back: +1 without a copy there, +2 with torch's copy here."""
    import shutil

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.rand(1 + i % 37, generator=g) for i in range(3 * span_write._BATCH + 5)}
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / "slot", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    for step in (1, 2, 3):
        p = s.save(st, state, step)
    if not with_native:
        p.layout.recheck.table = None
    saved = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.add_(1)
    versions = {k: v._version for k, v in state.items()}
    found = slot_restore.find(st, s.m, NAME, 3, state)
    assert found is not None and found.back is not None
    assert {k: v._version for k, v in state.items()} == versions  # found, not copied: nothing bumped
    path = s.m.file.path
    shutil.copyfile(path, f"{path}.new")
    os.replace(f"{path}.new", path)  # another file at the path: the mapping still shows the old one
    found.run()
    assert found.read_by_file == 0
    s.m.close()
    for k, v in state.items():
        assert torch.equal(v, saved[k]), k
        assert v._version == versions[k] + 1, k


def _restart_state(large: bool = False) -> dict:
    """A state a restarted process restores by its slot's shape table: small tensors of a few shapes and kinds
    (Parameters with and without grad, half, int64) in more than two chunks of the table's guards; with ``large``,
    one tensor that torch copies (plain_restore.LARGE_NBYTES or more)."""
    g = torch.Generator().manual_seed(4)
    kinds = [lambda i: torch.rand(3, 2, generator=g), lambda i: torch.nn.Parameter(torch.rand(4, generator=g)),
             lambda i: torch.rand(5, generator=g).half(), lambda i: torch.arange(i % 7 + 1),
             lambda i: torch.nn.Parameter(torch.arange(3), requires_grad=False)]
    state = {"many": {f"p{i}": kinds[i % 5](i) for i in range(2 * plain_restore._GUARD_CHUNK + 11)},
             "step": torch.tensor(3.0), "iteration": 7}
    if large:
        state["big"] = torch.rand(plain_restore.LARGE_NBYTES // 4 + 3, generator=g)
    return state


@functools.lru_cache(maxsize=None)
def _template(large: bool) -> dict:
    """``_restart_state(large)``, made once: the structure every fresh state copies (never changed)."""
    return _restart_state(large)


def _fresh(state):
    """A live state of ``state``'s structure, as a restarted process builds it (zeros, other values)."""
    if isinstance(state, dict):
        return {k: _fresh(v) for k, v in state.items()}
    if isinstance(state, torch.nn.Parameter):
        return torch.nn.Parameter(torch.zeros_like(state), requires_grad=state.requires_grad)
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return 0 if isinstance(state, int) else state


def _restart_tensors(state: dict) -> list:
    """The tensors of a state of :func:`_restart_state`'s structure, in the slot's order."""
    return [*state["many"].values(), state["step"], *([state["big"]] if "big" in state else [])]


def _saved(tmp_path, large: bool = False) -> _Slot:
    """A slot file holding ``_restart_state(large)`` as a job's save left it (step 1)."""
    state = _restart_state(large)
    st = Stager()
    p = st.prepare({NAME: state}, 1)
    s = _Slot(tmp_path / f"restart{int(large)}", (p.total_nbytes + 4095) // 4096 * 4096 + (1 << 20))
    s.save(st, state, 1)
    return s


def _restarted(s: _Slot, monkeypatch, with_native: bool, change=None, large: bool = False):
    """Restore the slot ``s`` (:func:`_saved`) as a restarted process does (``plain_restore.find`` and ``run``) into a
    fresh state of ``_restart_state(large)``'s structure (changed by ``change``), with the native loop or without
    (``SNAPCKPT_NATIVE=0``). Returns ``(outcome, guards ran)``: ``None`` (the general path's), ``("refused",
    message)`` when the copy raised, else ``(spans read by preadv, every live tensor's bytes, version increments,
    the live non-tensor values)``; find itself must change no version."""
    live = _fresh(_template(large))
    if change:
        change(live)
    tensors = _restart_tensors(live)

    def versions():  # one tensor of every storage: views share their base's counter
        return [-1 if t.is_inference() else t._version for t in tensors]
    calls, real = [], plain_restore._guards_pass
    with monkeypatch.context() as mp:
        if not with_native:
            mp.setenv("SNAPCKPT_NATIVE", "0")
        mp.setattr(plain_restore, "_guards_pass", lambda *a: calls.append(1) or real(*a))
        before = versions()
        found = plain_restore.find(s.m, NAME, 1, live)
        assert versions() == before  # found, not copied: nothing bumped
        if found is None:
            return None, bool(calls)
        try:
            found.run()
        except RuntimeError as e:
            return ("refused", str(e)), bool(calls)
        return ((found.read_by_file, [bytes(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors],
                 [a - b for a, b in zip(versions(), before)], live["iteration"]), bool(calls))


@pytest.mark.parametrize("large", [False, True])
def test_a_restarted_restore_gives_the_same_bytes_and_bumps_with_the_native_check_or_without(tmp_path, native,
                                                                                            monkeypatch, large):
    """The control: a fresh state of the saved layout is taken by the native loop (no guards), every small span read
    by preadv, bit for bit as without it, each version bumped once (by the copy, not by find)."""
    s = _saved(tmp_path, large)
    (got, guards), (want, guards_off) = (_restarted(s, monkeypatch, w, large=large) for w in (True, False))
    s.m.close()
    assert not guards and guards_off
    assert got == want and got is not None
    read, data, bumps, iteration = got
    n = len(_restart_state(large)["many"]) + 1
    assert read == n and set(bumps) == {1} and iteration == 7
    saved = _restart_tensors(_restart_state(large))
    assert data == [bytes(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in saved]


def test_a_restarted_restore_refuses_and_takes_what_it_does_without_the_native_check(tmp_path, native, monkeypatch):
    """Each change of the live tensors: the native loop refuses it (the guards then run) and the outcome, a refusal
    (None, the general path's), the copy's error or the copies' bytes and version bumps, is the Python path's."""
    many = lambda s: s["many"]  # noqa: E731
    shared = torch.zeros(6)
    changes = {
        "shape": lambda s: many(s).__setitem__("p5", torch.zeros(2, 3)),
        "dtype": lambda s: many(s).__setitem__("p2", torch.zeros(5, dtype=torch.bfloat16)),
        "not contiguous": lambda s: many(s).__setitem__("p0", torch.zeros(2, 3).t()),
        "negative view": lambda s: many(s).__setitem__("p3", torch.zeros(4, dtype=torch.int64)._neg_view()),
        "one tensor twice in one chunk": lambda s: many(s).__setitem__("p5", many(s)["p0"]),
        "one tensor twice in two chunks": lambda s: many(s).__setitem__("p1000", many(s)["p0"]),
        "requires_grad": lambda s: s.__setitem__("step", torch.zeros((), requires_grad=True)),
        "a storage offset": lambda s: many(s).__setitem__("p0", torch.zeros(10)[2:8].view(3, 2)),
        "two views of one data pointer": lambda s: (many(s).__setitem__("p0", shared.view(3, 2)),
                                                    many(s).__setitem__("p5", shared.view(3, 2))),
        "an inference tensor": lambda s: many(s).__setitem__("p0", _inference(torch.zeros(3, 2))),
    }
    taken = {  # each of a type its records have for the shape (the digest has no Python types)
        "a Tensor for a Parameter": lambda s: many(s).__setitem__("p1", torch.zeros(4)),
        "a Parameter for a Tensor": lambda s: s.__setitem__("step", torch.nn.Parameter(torch.zeros(()))),
    }
    walked_out = {"a subclass": lambda s: many(s).__setitem__("p0", torch.zeros(3, 2).as_subclass(_Sub))}  # not plain
    outcomes = set()
    s = _saved(tmp_path)  # one slot, every restore reads it
    for what, change in {**changes, **taken, **walked_out}.items():
        shared.zero_()
        got, guards = _restarted(s, monkeypatch, True, change)
        shared.zero_()
        want, _ = _restarted(s, monkeypatch, False, change)
        assert guards == (what in changes), what  # the native loop asked the Python path
        assert got == want, what
        outcomes.add("none" if got is None else got[0] if got[0] == "refused" else "copied")
    s.m.close()
    assert outcomes == {"none", "refused", "copied"}


class _Sub(torch.Tensor):
    pass


def test_the_native_check_by_index_refuses_what_it_cannot_vouch_for(native):
    """``check_ids``: each tensor against its index's records (the one of its Python type), its data pointer written
    out; a tensor of a type none of its records has: -2; an index out of range, a tensor object twice (data pointers
    in any order), a null data pointer (no elements), buffers of the wrong size are refused (-1, or ValueError for
    the buffers)."""
    from array import array

    refs = [torch.zeros(3), torch.nn.Parameter(torch.zeros(3)), torch.zeros(2, dtype=torch.float64),
            torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    table = native.table(refs, torch.Tensor)
    ts = [torch.rand(2, dtype=torch.float64), torch.nn.Parameter(torch.rand(3)), torch.rand(3)]
    ids = array("i", [1, 0, 0])
    out = array("q", bytes(8 * len(ts)))
    assert native.check_ids(ts, table, ids, 2, out) == 0 and out.tolist() == [t.data_ptr() for t in ts]
    tensors_only = native.table(refs[::2], torch.Tensor)
    assert native.check_ids(ts, tensors_only, array("i", [1, 0, 0]), 1, out) == -2  # no Parameter record
    assert native.check_ids(ts[::2], tensors_only, array("i", [1, 0]), 1, array("q", bytes(16))) == 0
    assert native.check_ids(ts[::-1], table, ids, 2, out) == -1  # shapes and dtypes not their indices'
    assert native.check_ids(ts, table, array("i", [1, 0, 2]), 2, out) == -1  # out of range
    assert native.check_ids(ts, table, array("i", [1, 0, -1]), 2, out) == -1
    twice = [ts[2], ts[0], ts[2]]
    assert native.check_ids(twice, table, array("i", [0, 1, 0]), 2, out) == -1
    desc = sorted([torch.rand(3) for _ in range(5)], key=torch.Tensor.data_ptr, reverse=True)
    assert native.check_ids(desc, table, array("i", [0] * 5), 2, array("q", bytes(40))) == 0
    assert native.check_ids(desc[:4] + desc[:1], table, array("i", [0] * 5), 2, array("q", bytes(40))) == -1
    empty = native.table([torch.zeros(0)], torch.Tensor)
    assert native.check_ids([torch.zeros(0)], empty, array("i", [0]), 1, array("q", bytes(8))) == -1
    with pytest.raises(ValueError):
        native.check_ids(ts, table, array("i", [1, 0]), 2, out)
    with pytest.raises(ValueError):
        native.check_ids(ts, table, ids, 2, array("q", bytes(8)))
