"""Byte progress bars on stderr for long reads (``tqdm`` when installed, else nothing).

Used by the CLI (``verify``, ``inspect``) and by :meth:`snapckpt.Checkpointer.load` when it verifies a
large checkpoint on disk. ``tqdm`` is optional (``pip install '.[cli]'`` in a snapckpt clone); without it, or when the
bar is disabled, a no-op object with the same ``update``/``close`` methods is returned.
"""
from __future__ import annotations

import sys
from typing import Optional

__all__ = ["byte_bar"]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


def byte_bar(total: int, desc: str, enabled: Optional[bool] = None):
    """A progress bar of ``total`` bytes titled ``desc``; ``enabled=None`` means "when stderr is a terminal".

    Returns a ``tqdm`` instance (a context manager with ``update(nbytes)``) or a no-op stand-in.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                leave=False, dynamic_ncols=True)
