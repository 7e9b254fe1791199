"""Optional native loops over many tensors (``tensor_loops.cpp``): built explicitly, only loaded at run time.

The per-tensor passes of a save's quick check and an in-process restore (guards, data pointers, version bumps) are
one torch call per tensor each from Python; for 200,000 small tensors each pass reads every tensor's metadata out
of memory again (the previous pass pushed it out of the caches). :func:`load` gives a module whose
``check(tensors, table, ptrs)`` does them in one C++ loop (records from ``table(tensors, torch.Tensor)``),
``check_ids(tensors, table, ids, variants, ptrs_out)`` checks tensors against records chosen by index (a restarted
process's live tensors against a slot's shape table) and writes their data pointers, ``bump(tensors,
torch.Tensor)`` bumps their version counters (:func:`increment_version`), or ``None``: the Python path then runs
unchanged. Measured gains: docs/performance.md ("Many tensors, one native
loop").

Nothing is compiled on a training thread, nor at import: :func:`build` (``python -m snapckpt._native build``,
``scripts/setup.sh``) compiles the one source file with the system's C++ compiler against the installed torch's
headers (a few seconds: c10's ``TensorImpl`` and Python's C API, no pybind11) into a directory named by the torch
version, the Python ABI and a hash of the source and flags; :func:`load` only imports a library already there. A
torch upgrade or a change of the source gives another directory, so a stale library is never loaded.
``SNAPCKPT_NATIVE=0`` turns the loops off; ``SNAPCKPT_NATIVE_DIR`` moves the cache.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from array import array
from types import ModuleType
from typing import List, Optional

import torch

from snapckpt._internal import env

__all__ = ["build", "load", "library_path", "increment_version", "MODULE"]

MODULE = "snapckpt_tensor_loops"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tensor_loops.cpp")
_lock = threading.Lock()
_loaded: "dict[str, Optional[ModuleType]]" = {}
_keys: "dict[tuple, str]" = {}  # _key() per (source, flags): read and hashed once per process


def _flags() -> List[str]:
    """Compiler flags besides the source and output: torch's C++ standard and ABI, its headers, Python's."""
    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-w", f"-I{inc}", f"-I{sysconfig.get_paths()['include']}", f"-L{lib}", "-lc10"]


def _key() -> str:
    flags = _flags()
    at = (_SOURCE, tuple(flags))
    if at not in _keys:
        h = hashlib.sha256()
        with open(_SOURCE, "rb") as f:
            h.update(f.read())
        h.update("\0".join(flags).encode())
        tag = sys.implementation.cache_tag
        _keys[at] = f"torch-{torch.__version__}-{tag}-{h.hexdigest()[:16]}"
    return _keys[at]


def library_path(directory: Optional[str] = None) -> str:
    """Where :func:`build` puts the library for this torch, Python and source (``directory``: default
    ``SNAPCKPT_NATIVE_DIR``'s)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return os.path.join(directory or env.native_dir(), _key(), MODULE + suffix)


def build(directory: Optional[str] = None, compiler: Optional[str] = None) -> str:
    """Compile ``tensor_loops.cpp`` unless already built; returns the library's path. Written under a temporary
    name and renamed, so a concurrent :func:`load` never sees a partial file.

    Raises:
        RuntimeError: no C++ compiler (``$CXX``, else ``c++``/``g++`` on the PATH), or it failed (its output
            in the message).
    """
    path = library_path(directory)
    if os.path.exists(path) and _intact(path):
        return path
    cxx = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX): the native loops are optional, snapckpt runs without")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    os.close(fd)
    try:
        r = subprocess.run([cxx, _SOURCE, "-o", tmp, *_flags()], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"building {_SOURCE} failed ({cxx}, exit {r.returncode}):\n{r.stderr[-4000:]}")
        # its view of a tensor object is checked in a child first: a torch that lays tensors out otherwise could
        # crash the process that reads them, and that must never be a training process
        r = subprocess.run([sys.executable, "-m", "snapckpt._native", "probe", tmp], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"the library built from {_SOURCE} failed its check against torch {torch.__version__} "
                               f"(exit {r.returncode}; not installed, snapckpt runs without):\n{r.stderr[-2000:]}")
        with open(path + ".sha256.tmp", "w") as f:  # load() imports only a file of this digest: a truncated copy
            f.write(_digest(tmp))                      # (a full disk, a shared home) would crash dlopen (SIGBUS)
        os.replace(path + ".sha256.tmp", path + ".sha256")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _probe(mod: ModuleType) -> bool:
    """Whether the library reads tensors as this torch lays them out (its view of a Python tensor object)."""
    t = torch.arange(12, dtype=torch.float32)[3:]
    if mod.probe(t) != (t.data_ptr(), t.numel(), t.storage_offset()):
        return False
    ts = [t, torch.zeros(2, 3, dtype=torch.float64)]
    table = mod.table(ts, torch.Tensor)
    ptrs = list(map(torch.Tensor.data_ptr, ts))
    out = array("q", bytes(16))
    if not (table is not None and mod.check(ts, table, ptrs) == 0 and mod.check(ts[::-1], table, None) == -1
            and mod.check_ids(ts, table, array("i", [0, 1]), 1, out) == 0 and out.tolist() == ptrs
            and mod.check_ids(ts, table, array("i", [1, 0]), 1, out) == -1):
        return False
    versions = [x._version for x in ts]
    mod.bump(ts, torch.Tensor)  # last: it writes, into what the checks above read right
    return [x._version for x in ts] == [v + 1 for v in versions]


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _intact(path: str) -> bool:
    """Whether the library at ``path`` is the file :func:`build` installed (its sha256 beside it, ``.sha256``)."""
    try:
        with open(path + ".sha256") as f:
            return f.read().strip() == _digest(path)
    except OSError:
        return False


def _import(path: str) -> ModuleType:
    """The extension module in the file ``path`` (any name: :func:`build` checks it under a temporary one)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    loader.exec_module(mod)
    return mod


def load(directory: Optional[str] = None) -> Optional[ModuleType]:
    """The built native loops, or ``None`` (``SNAPCKPT_NATIVE=0``, not built for this torch and source, or failing
    its check): never compiles. Cached per directory for the process.

    Raises:
        ValueError: ``SNAPCKPT_NATIVE`` is set to something else than 0/1/false/true.
    """
    if not env.native():
        return None
    path = library_path(directory)
    with _lock:
        if path in _loaded:
            return _loaded[path]
        mod = None
        if os.path.exists(path) and _intact(path):
            try:
                mod = _import(path)
                if not _probe(mod):
                    mod = None
            except Exception:  # noqa: BLE001 - any library that is not this source's build: the Python path
                mod = None
        _loaded[path] = mod
        return mod


def increment_version(tensors: List[torch.Tensor]) -> None:
    """``torch.autograd.graph.increment_version(tensors)``: bump each tensor's version counter, as an in-place copy
    bumps it (a tensor made under ``torch.inference_mode()`` has none and is skipped), by the native loop when it is
    loaded (one pass that asks for the tensors a few places ahead: 200,000 scattered tensors' counters are cache
    misses), else by torch's call.

    Raises:
        TypeError: an item that is not a tensor (the ones before it bumped).
    """
    mod = load()
    if mod is None:
        torch.autograd.graph.increment_version(tensors)
    else:
        mod.bump(tensors, torch.Tensor)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m snapckpt._native build [DIR]``: build (or find built) the native loops; prints the path."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "probe":  # build()'s check of a library just built, in a child process
        return 0 if _probe(_import(args[1])) else 3
    if not args or args[0] != "build":
        print("usage: python -m snapckpt._native build [DIR]", file=sys.stderr)
        return 2
    try:
        print(build(args[1] if len(args) > 1 else None))
    except RuntimeError as e:
        print(f"snapckpt native loops not built: {e}", file=sys.stderr)
        return 1
    return 0
