"""The CUDA path's pure parts, on the CPU: how a paced snapshot copy is cut into pieces, and its option.

The CUDA copies themselves run only on a GPU (tests/gpu_cuda_path.py, through benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import pytest
import torch

from snapckpt.options import CheckpointOptions as Options
from snapckpt.engine.device_copy import split_pieces


def test_split_pieces_covers_every_byte_once_in_order_and_marks_each_source_on_its_last_piece():
    srcs = [torch.arange(n, dtype=torch.int64).view(torch.uint8) % 251 for n in (0, 1, 5, 16)]  # 0/8/40/128 B
    slot = torch.zeros(512, dtype=torch.uint8)
    copies, off = [], 0
    for s in srcs:
        copies.append((s, off))
        off += s.numel() + 3  # gaps between spans stay untouched
    pieces = split_pieces(copies, slot, 16)
    for dst, src, _ in pieces:
        assert 0 < src.numel() <= 16 and dst.numel() == src.numel()
        dst.copy_(src)
    for s, o in copies:
        assert torch.equal(slot[o:o + s.numel()], s)
    assert int((slot != 0).sum()) <= sum(s.numel() for s in srcs)
    owners = [owner for _, _, owner in pieces if owner is not None]
    assert [o.data_ptr() for o in owners] == [s.data_ptr() for s in srcs if s.numel()]  # once each, last piece
    assert len(pieces) == 0 + 1 + 3 + 8  # an empty source has no piece; 40 B in 16 B pieces is 3


def test_cuda_copy_piece_nbytes_is_validated():
    assert Options().cuda_copy_piece_nbytes == 64 << 20
    assert Options(cuda_copy_piece_nbytes=0).cuda_copy_piece_nbytes == 0
    for bad in (-1, 1.5, True, "64M"):
        with pytest.raises(ValueError, match="cuda_copy_piece_nbytes"):
            Options(cuda_copy_piece_nbytes=bad)

