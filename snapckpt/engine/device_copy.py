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

CUDA is never initialized here: a job whose state has no CUDA tensor never touches this module's CUDA
calls. References: CUDA Runtime API, ``cudaHostRegister``; PyTorch "CUDA semantics", streams and
``record_stream``.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from snapckpt.errors import SnapshotError

__all__ = ["CudaCopier", "has_cuda_sources"]

log = logging.getLogger(__name__)


def has_cuda_sources(copies: List[Tuple[torch.Tensor, int]]) -> bool:
    """Whether any ``(source tensor, slot offset)`` of a prepared snapshot lives on a CUDA device."""
    return any(src.is_cuda for src, _ in copies)


class CudaCopier:
    """Queues the CUDA spans of a snapshot on a side stream per device, into registered slot memory.

    One per :class:`~snapckpt.Checkpointer` (per rank). Not thread-safe: called from the training thread.
    """

    def __init__(self) -> None:
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._registered: Dict[int, int] = {}  # host pointer -> bytes

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

    def start(self, copies: List[Tuple[torch.Tensor, int]], slot: torch.Tensor) -> Optional["torch.cuda.Event"]:
        """Queue the copies whose source is on a CUDA device; return an event that completes with them
        (``None`` when there were none). CPU sources are left to the caller.

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
            with torch.cuda.stream(stream):
                for src, off in cuda:
                    slot[off:off + src.numel()].copy_(src, non_blocking=True)
                    src.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done
