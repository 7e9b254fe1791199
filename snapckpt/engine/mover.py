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

import bisect
import ctypes
import os
import threading
from collections import deque
from dataclasses import dataclass
from itertools import accumulate, compress, starmap
from operator import not_
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["CHUNK_NBYTES", "MIN_TENSOR_NBYTES", "SPLIT_NBYTES", "copy_chunks", "chunks_of", "move_each", "Split",
           "split_of", "foreach_copy"]

#: bytes one thread copies between two looks at the shared list (8 MiB: ~0.5 ms at this VM's bandwidth)
CHUNK_NBYTES = 8 << 20
#: tensors below this size stay with ``torch._foreach_copy_`` (one Python call per tensor would cost more)
MIN_TENSOR_NBYTES = 1 << 20
_MAX_HELPERS = 7
#: :func:`foreach_copy` splits its tensors under :data:`MIN_TENSOR_NBYTES` among threads from this many bytes in all:
#: a ``torch._foreach_copy_`` of those is one thread's loop (20,000 tensors of 0.2 to 52 KiB, 252 MiB: 42 ms on one
#: thread, 25 ms on two; 2-core VM, 2026-12-05)
SPLIT_NBYTES = 16 << 20

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
        self.job: Optional[list] = None
        self.fn: Callable[..., Any] = _memmove  # what each item of the job is passed to (unpacked)
        self.error: Optional[BaseException] = None  # the job's first error, raised on the calling thread
        self.next = 0
        self.busy = 0  # helpers inside the current job
        self.generation = 0

    def run(self, chunks: list, helpers: int, fn: Optional[Callable[..., Any]] = None) -> None:
        """Call ``fn(*item)`` for each item of ``chunks`` on the calling thread and ``helpers`` helper threads (default
        ``fn``: ``memmove`` of a ``(destination, source, nbytes)`` chunk); return when every item is done.

        Raises:
            The first error of an item (the other items still ran or were left: the caller handles the whole job
            as failed).
        """
        fn = _memmove if fn is None else fn
        helpers = min(helpers, _MAX_HELPERS, len(chunks) - 1)
        if helpers <= 0 or not self.running.acquire(blocking=False):
            for c in chunks:
                fn(*c)
            return
        try:
            self._run(chunks, helpers, fn)
        finally:
            self.running.release()

    def _run(self, chunks: list, helpers: int, fn: Callable[..., Any]) -> None:
        with self.lock:
            while len(self.threads) < helpers:
                t = threading.Thread(target=self._helper, name=f"snapckpt-mover-{len(self.threads)}", daemon=True)
                t.start()
                self.threads.append(t)
            self.job, self.fn, self.error, self.next = chunks, fn, None, 0
            self.generation += 1
            self.wake.notify(helpers)
        self._work(chunks, fn)
        with self.lock:
            self.job = None  # helpers that wake late find no job
            while self.busy:
                self.done.wait()
            error, self.error = self.error, None
        if error is not None:
            raise error

    def _take(self, chunks: List[Tuple[int, int, int]]) -> Optional[Tuple[int, int, int]]:
        with self.lock:
            if self.job is not chunks or self.next >= len(chunks):
                return None
            c = chunks[self.next]
            self.next += 1
            return c

    def _work(self, chunks: list, fn: Callable[..., Any]) -> None:
        while True:
            c = self._take(chunks)
            if c is None:
                return
            try:
                fn(*c)
            except BaseException as e:  # noqa: BLE001 -- raised on the calling thread (run)
                with self.lock:
                    self.error = self.error or e
                    self.next = len(chunks)  # nothing more of a failed job
                return

    def _helper(self) -> None:
        seen = 0
        while True:
            with self.lock:
                while self.job is None or self.generation == seen:
                    self.wake.wait()
                seen, chunks, fn = self.generation, self.job, self.fn
                self.busy += 1
            try:
                self._work(chunks, fn)
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


def _foreach_copy_no_grad(dsts: List[torch.Tensor], srcs: List[torch.Tensor], inference: bool = False) -> None:
    # grad mode is per thread: a Parameter's copy must not enter autograd on a helper either. So is inference mode,
    # outside which an inference tensor (made under it) refuses an in-place copy: a helper takes the caller's
    with torch.inference_mode() if inference else torch.no_grad():
        torch._foreach_copy_(dsts, srcs)


@dataclass(frozen=True)
class Split:
    """How :func:`foreach_copy` divides a list of tensors among threads, from their sizes alone (:func:`split_of`; a
    restore's is made once per layout: :meth:`snapckpt.engine.copy_plan.Sizes.split`).

    Attributes:
        threads: threads in all, the calling one among them.
        large: which tensors (a mask over the list) are copied first, in one call on the calling thread; ``None``:
            none is (every tensor is under :data:`MIN_TENSOR_NBYTES`, or :attr:`parts` is empty).
        small: the mask of the others (``None`` with ``large``).
        parts: ``(start, end)`` of each part of the small tensors (positions in their list) that the threads take in
            turn; ``()``: one ``torch._foreach_copy_`` of every tensor on the calling thread.
    """

    threads: int
    large: Optional[Tuple[bool, ...]] = None
    small: Optional[Tuple[bool, ...]] = None
    parts: Tuple[Tuple[int, int], ...] = ()


def split_of(nbytes: Sequence[int], threads: Optional[int] = None) -> Split:
    """The :class:`Split` of tensors of ``nbytes`` bytes each among ``threads`` threads in all (default
    ``torch.get_num_threads()``): the tensors under :data:`MIN_TENSOR_NBYTES` are cut into parts of about equal bytes
    (about :data:`CHUNK_NBYTES`, at least two per thread) when they hold :data:`SPLIT_NBYTES` or more, else nothing
    is split."""
    n = torch.get_num_threads() if threads is None else threads
    small = list(map(MIN_TENSOR_NBYTES.__gt__, nbytes))
    total = sum(compress(nbytes, small))
    if n < 2 or total < SPLIT_NBYTES:
        return Split(n)
    large = None
    if not all(small):
        large = tuple(map(not_, small))
        nbytes = list(compress(nbytes, small))
    # parts of about CHUNK_NBYTES, at least two per thread: a thread that is not running holds up one part only
    k = min(max(2 * n, total // CHUNK_NBYTES), len(nbytes))
    acc = list(accumulate(nbytes))
    cuts = [0] + [bisect.bisect_left(acc, total * j // k) + 1 for j in range(1, k)] + [len(nbytes)]
    return Split(n, large, tuple(small) if large else None, tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a))


def foreach_copy(dsts: List[torch.Tensor], srcs: List[torch.Tensor], split: Split) -> None:
    """``torch._foreach_copy_(dsts, srcs)`` under ``torch.no_grad()``, or under ``torch.inference_mode()`` on every
    thread when the caller is in it (versions bumped, dtype and device follow
    ``dsts``, as ``Tensor.copy_``), with the tensors under :data:`MIN_TENSOR_NBYTES` split into parts of about equal
    bytes that the calling thread and helper threads take in turn when they hold :data:`SPLIT_NBYTES` or more.

    Each small copy is a loop on one thread inside torch; the large ones stay in one call on the calling thread first,
    each already parallel on torch's intra-op threads (split among threads too they would run nested parallel
    regions). ``torch._foreach_copy_`` releases the GIL while it copies.

    Args:
        split: how, from the tensors' sizes (:func:`split_of` of ``dsts``' sizes in bytes; a layout's, made once, so
            nothing per tensor is read or computed here).

    Raises:
        What ``torch._foreach_copy_`` raises, from whichever thread copied the part.
    """
    if not split.parts:
        _foreach_copy_no_grad(dsts, srcs)
        return
    if split.large is not None:
        _foreach_copy_no_grad(list(compress(dsts, split.large)), list(compress(srcs, split.large)))
        dsts, srcs = list(compress(dsts, split.small)), list(compress(srcs, split.small))
    inference = torch.is_inference_mode_enabled()
    _pool.run([(dsts[a:b], srcs[a:b], inference) for a, b in split.parts], split.threads - 1, _foreach_copy_no_grad)
