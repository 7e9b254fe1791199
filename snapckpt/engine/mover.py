"""Copy large CPU tensors into an arena slot with libc ``memmove`` in chunks that threads take in turn.

``torch.Tensor.copy_`` (and ``torch._foreach_copy_``, a loop of them on the CPU) copies each tensor in its own
OpenMP parallel region: every region needs every intra-op thread to run before the next one starts. On a host whose
cores are shared (other processes, the persister, a data loader) a worker thread that is not running holds up each
region until the scheduler runs it, a few ms per region on this 2-core VM: a 0.5 GiB state of 64 tensors took 190 ms
with torch's two threads against 57 ms for the same bytes by ``memmove`` (docs/performance.md). Here the bytes
of all large tensors are cut into chunks of :data:`CHUNK_NBYTES`, and the calling thread and up to
``torch.get_num_threads() - 1`` helper threads take the next chunk until none is left: a helper that is not running
only leaves its chunks to the others, and no thread waits for another until the end. ``memmove`` (a ``ctypes``
foreign call) releases the GIL while it copies.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from itertools import starmap
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["CHUNK_NBYTES", "MIN_TENSOR_NBYTES", "copy_chunks", "chunks_of", "move_each"]

#: bytes one thread copies between two looks at the shared list (8 MiB: ~0.5 ms at this VM's bandwidth)
CHUNK_NBYTES = 8 << 20
#: tensors below this size stay with ``torch._foreach_copy_`` (one Python call per tensor would cost more)
MIN_TENSOR_NBYTES = 1 << 20
_MAX_HELPERS = 7

_memmove = ctypes.memmove


def _memmove_holding_gil():
    """libc's ``memmove`` called without releasing the GIL (``ctypes.PyDLL``), or ``ctypes.memmove`` where the
    process's symbols cannot be looked up that way."""
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError, TypeError):  # pragma: no cover - a platform without dlopen(NULL)
        return ctypes.memmove
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_void_p
    return fn


_memmove_gil = _memmove_holding_gil()


def chunks_of(dsts: Sequence[int], srcs: Sequence[torch.Tensor]) -> List[Tuple[int, int, int]]:
    """``(destination address, source address, nbytes)`` chunks of at most :data:`CHUNK_NBYTES` covering each
    contiguous CPU tensor of ``srcs`` copied to the address at the same place in ``dsts``."""
    out = []
    for dp, t in zip(dsts, srcs):
        sp, n = t.data_ptr(), t.numel() * t.element_size()
        out.extend((dp + o, sp + o, min(CHUNK_NBYTES, n - o)) for o in range(0, n, CHUNK_NBYTES))
    return out


class _Pool:
    """Helper threads (daemons, started on first use) that take chunks of the current job with the caller."""

    def __init__(self) -> None:
        self.running = threading.Lock()  # one job at a time; another caller meanwhile copies alone
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.done = threading.Condition(self.lock)
        self.threads: List[threading.Thread] = []
        self.job: Optional[List[Tuple[int, int, int]]] = None
        self.next = 0
        self.busy = 0  # helpers inside the current job
        self.generation = 0

    def run(self, chunks: List[Tuple[int, int, int]], helpers: int) -> None:
        """Copy ``chunks`` on the calling thread and ``helpers`` helper threads; return when every chunk is done."""
        helpers = min(helpers, _MAX_HELPERS, len(chunks) - 1)
        if helpers <= 0 or not self.running.acquire(blocking=False):
            for c in chunks:
                _memmove(*c)
            return
        try:
            self._run(chunks, helpers)
        finally:
            self.running.release()

    def _run(self, chunks: List[Tuple[int, int, int]], helpers: int) -> None:
        with self.lock:
            while len(self.threads) < helpers:
                t = threading.Thread(target=self._helper, name=f"snapckpt-mover-{len(self.threads)}", daemon=True)
                t.start()
                self.threads.append(t)
            self.job, self.next, self.generation = chunks, 0, self.generation + 1
            self.wake.notify(helpers)
        self._work(chunks)
        with self.lock:
            self.job = None  # helpers that wake late find no job
            while self.busy:
                self.done.wait()

    def _take(self, chunks: List[Tuple[int, int, int]]) -> Optional[Tuple[int, int, int]]:
        with self.lock:
            if self.job is not chunks or self.next >= len(chunks):
                return None
            c = chunks[self.next]
            self.next += 1
            return c

    def _work(self, chunks: List[Tuple[int, int, int]]) -> None:
        while True:
            c = self._take(chunks)
            if c is None:
                return
            _memmove(*c)

    def _helper(self) -> None:
        seen = 0
        while True:
            with self.lock:
                while self.job is None or self.generation == seen:
                    self.wake.wait()
                seen, chunks = self.generation, self.job
                self.busy += 1
            try:
                self._work(chunks)
            finally:
                with self.lock:
                    self.busy -= 1
                    if not self.busy:
                        self.done.notify_all()


_pool = _Pool()


def _after_fork() -> None:
    global _pool
    _pool = _Pool()  # the helper threads did not survive the fork


os.register_at_fork(after_in_child=_after_fork)


def move_each(moves: List[Tuple[int, int, int]]) -> None:
    """``memmove`` each ``(destination address, source address, nbytes)`` of ``moves`` in order, on the calling thread.

    For many small tensors (under :data:`MIN_TENSOR_NBYTES`) whose addresses are known: a ``ctypes`` call per tensor
    costs less than ``Tensor.copy_``'s dispatch and iterator per tensor inside ``torch._foreach_copy_`` (20,000
    tensors of 0.2 to 52 KiB, 252 MiB: 37 ms against 45 ms on this 2-core VM). The calls keep the GIL (one release
    per tiny copy would let any busy Python thread take it each time, and each return wait for it), so this is for a
    copy on the thread that waits for it anyway, not for a background one."""
    deque(starmap(_memmove_gil, moves), maxlen=0)


def copy_chunks(chunks: List[Tuple[int, int, int]], threads: Optional[int] = None) -> None:
    """Copy ``chunks`` (:func:`chunks_of`) with ``threads`` threads in all (default ``torch.get_num_threads()``, the
    intra-op threads the process allows), the calling thread among them; returns when all bytes are copied.
    The caller keeps both sides alive and unchanged meanwhile, and no chunk may overlap another's destination."""
    n = torch.get_num_threads() if threads is None else threads
    _pool.run(chunks, max(0, n - 1))
