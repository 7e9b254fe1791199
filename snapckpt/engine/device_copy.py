"""The CUDA path of a snapshot: device-to-host copies on a side stream into page-locked shared memory.

A snapshot of CUDA tensors has to cross PCIe into the arena. Two things make that copy cheap for the
training thread:

1. **Registered (pinned) arena slots.** A slot is shared memory mapped into the training process; once
   ``cudaHostRegister`` has page-locked that mapping, a device-to-host ``copy_(..., non_blocking=True)``
   is a DMA at PCIe speed that the host thread does not wait for. Without it the driver stages pageable
   memory through its own pinned buffer, synchronously and at a fraction of the bandwidth. Registration
   costs about as long as touching the pages once, so it is done once per mapping, and undone
   (``cudaHostUnregister``) before the mapping is closed.
2. **A dedicated stream and an event.** The copies are queued on one side stream per device after that
   stream waits for an event recorded on the compute stream at ``save()``: the copies see the state as of
   the save, and the compute stream goes on with the next forward and backward at once. ``fence()``
   (before the optimizer step, the first moment the state changes) synchronizes the copy's event. Each
   source storage is marked with ``record_stream`` so that the caching allocator does not reuse its memory
   before the copy has read it.
3. **Pieces, one at a time** (``overlap=True``, ``Options.cuda_copy_piece_nbytes``). A copy engine serves a
   stream that always has a copy queued before the copies of other streams: measured on an H200, a
   ``loss.item()`` issued while 8 GiB were queued on the side stream returned only after all of them (0.156 s),
   also when at most two 16-64 MiB pieces were queued at a time. So a pacer thread issues the copy piece by
   piece and waits for each piece before the next: the engine goes idle for a moment between two pieces,
   and the training loop's own device-to-host copies go first. The pacer holds a reference to every source
   until its last piece is issued (then ``record_stream``), so a tensor the caller drops after ``save()``
   keeps its memory until it has been read.

CUDA is never initialized here: a job whose state has no CUDA tensor never touches this module's CUDA
calls. References: CUDA Runtime API, ``cudaHostRegister``; PyTorch "CUDA semantics", streams and
``record_stream``.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import Dict, List, Optional, Tuple

import torch

from snapckpt.errors import SnapshotError

__all__ = ["CudaCopier", "has_cuda_sources", "split_pieces"]

log = logging.getLogger(__name__)


def has_cuda_sources(copies: List[Tuple[torch.Tensor, int]]) -> bool:
    """Whether any ``(source tensor, slot offset)`` of a prepared snapshot lives on a CUDA device."""
    return any(src.is_cuda for src, _ in copies)


def split_pieces(copies: List[Tuple[torch.Tensor, int]], slot: torch.Tensor,
                 piece_nbytes: int) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """The paced copy's pieces: ``(slot slice, source slice, source or None)`` of at most ``piece_nbytes``
    bytes each, in order; the third item is the source tensor on its last piece (``record_stream`` is called
    on it once that piece is issued), else ``None``.

    Args:
        copies: ``(source uint8 tensor, slot byte offset)`` pairs. slot: a uint8 tensor over the slot.
        piece_nbytes: bytes per piece, > 0.
    """
    pieces: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []
    for src, off in copies:
        n = src.numel()
        for o in range(0, n, piece_nbytes):
            end = min(n, o + piece_nbytes)
            pieces.append((slot[off + o:off + end], src[o:end], src if end == n else None))
    return pieces


class _PacedCopy:
    """The CUDA copies of one snapshot, issued piece by piece on the pacer thread; ``synchronize()`` returns
    once all of them are done (as ``torch.cuda.Event.synchronize`` of the queued path)."""

    def __init__(self, future: "cf.Future") -> None:
        self._future = future

    def synchronize(self) -> None:
        last = self._future.result()  # the pacer's own error, if it failed to issue a piece
        if last is not None:
            last.synchronize()


def _issue_paced(device: torch.device, stream: "torch.cuda.Stream",
                 pieces: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]) -> Optional["torch.cuda.Event"]:
    """The pacer thread's job: issue ``(slot slice, source slice, source when this is its last piece)`` in
    order on ``stream``, each after the previous one is done; return the last piece's event."""
    last = None
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for dst, src, owner in pieces:
            if last is not None:
                last.synchronize()  # releases the GIL; the engine idles here, and other streams' copies run
            dst.copy_(src, non_blocking=True)
            if owner is not None:
                owner.record_stream(stream)
            last = torch.cuda.Event()
            last.record(stream)
    pieces.clear()  # the references that kept dropped sources alive
    return last


class CudaCopier:
    """Queues the CUDA spans of a snapshot on a side stream per device, into registered slot memory.

    One per :class:`~snapckpt.Checkpointer` (per rank). Not thread-safe: called from the training thread.

    Args:
        piece_nbytes: ``0``: every span's copy is queued at once on the calling thread. ``> 0``: the copy is
            issued in pieces of this many bytes, one at a time, by a pacer thread (see the module docstring).
    """

    def __init__(self, piece_nbytes: int = 0) -> None:
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._registered: Dict[int, int] = {}  # host pointer -> bytes
        self._piece = piece_nbytes
        self._pacer: Optional[cf.ThreadPoolExecutor] = None

    def register(self, slot: torch.Tensor) -> None:
        """Page-lock a slot's mapping (a uint8 CPU tensor over the whole mapping) for DMA; once per mapping.

        A failure (a container with a low ``RLIMIT_MEMLOCK``, say) is logged and the copy falls back to
        pageable memory: slower, still correct.
        """
        ptr, nbytes = slot.data_ptr(), slot.numel()
        if ptr in self._registered or nbytes == 0:
            return
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            log.warning("cudaHostRegister of a %d-byte arena slot failed (CUDA error %d); device-to-host "
                        "snapshot copies use pageable memory (slower). Raise the locked-memory limit "
                        "(ulimit -l) to page-lock the arena", nbytes, code)
            torch.cuda.synchronize()
            return
        self._registered[ptr] = nbytes

    def unregister(self, slot: torch.Tensor) -> None:
        """Undo :meth:`register` (before the mapping is closed); a no-op for a slot never registered."""
        ptr = slot.data_ptr()
        if self._registered.pop(ptr, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def start(self, copies: List[Tuple[torch.Tensor, int]], slot: torch.Tensor):
        """Queue the copies whose source is on a CUDA device; return an object whose ``synchronize()`` returns
        once they are done (a ``torch.cuda.Event``, or the paced copy's handle; ``None`` when there were
        none). CPU sources are left to the caller.

        Args:
            copies: ``(source uint8 tensor, slot byte offset)`` pairs (:class:`~snapckpt.engine.stager.Prepared`).
            slot: the registered uint8 CPU tensor over the slot mapping.

        Raises:
            SnapshotError: sources on more than one CUDA device (one rank, one device).
        """
        cuda = [(src, off) for src, off in copies if src.is_cuda and src.numel()]
        if not cuda:
            return None
        devices = {src.device for src, _ in cuda}
        if len(devices) != 1:
            raise SnapshotError(f"the state of one rank has tensors on several CUDA devices "
                                f"({sorted(str(d) for d in devices)}); snapckpt expects one device per rank")
        (device,) = devices
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        self.register(slot)
        with torch.cuda.device(device):
            saved_at = torch.cuda.Event()
            saved_at.record(torch.cuda.current_stream(device))  # the state as of save()
            stream.wait_event(saved_at)
            if self._piece:
                return self._start_paced(device, stream, cuda, slot)
            with torch.cuda.stream(stream):
                for src, off in cuda:
                    slot[off:off + src.numel()].copy_(src, non_blocking=True)
                    src.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def close(self) -> None:
        """Stop the pacer thread, if one was started, after its current job."""
        if self._pacer is not None:
            self._pacer.shutdown(wait=True)
            self._pacer = None

    def _start_paced(self, device, stream, cuda: List[Tuple[torch.Tensor, int]], slot: torch.Tensor) -> _PacedCopy:
        pieces = split_pieces(cuda, slot, self._piece)
        if self._pacer is None:
            self._pacer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapckpt-cuda-pacer")
        return _PacedCopy(self._pacer.submit(_issue_paced, device, stream, pieces))
