"""Environment knobs: the only module that reads ``os.environ`` (nothing happens at import time).

Knobs:
- ``SNAPCKPT_SHM_DIR``: default shared-memory directory for the arena (default ``/dev/shm``).
- ``SNAPCKPT_RUNTIME_DIR``: where sockets, locks and tokens live (default ``$XDG_RUNTIME_DIR`` or ``/tmp``).
- ``SNAPCKPT_REMOTE_DIR``: default remote tier URL (``s3://bucket/run1``), the ``remote_dir`` option.
- ``SNAPCKPT_REMOTE_BLOCK_NBYTES``: multipart part size of remote uploads and block size of downloads
  (bytes, at least 5 MiB, S3's smallest part; default 16 MiB).
- ``SNAPCKPT_PEER_TIMEOUT_SECS``: default of the ``peer_timeout_secs`` option (default 10): how long a
  node persister's liveness lease may go unrenewed before a commit waiting for its ranks is abandoned.
- ``SNAPCKPT_REPLICAS``: default of the ``replicas`` option: how many other nodes hold a copy of each node's
  memory snapshots (0 turns the peer-memory tier off; unset: 1 when the job spans several nodes).
- ``SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES``: default of the ``host_memory_budget_nbytes`` option: bytes of
  host memory a node's arena may hold (its ranks' slots and the peer replicas); unset: no budget.
- ``SNAPCKPT_REPLICA_ADDR``: the address this node's persister listens on for its peers (default: the
  address this host uses to reach ``MASTER_ADDR``, the rendezvous host).
- ``SNAPCKPT_LOG_LEVEL``: log level of the persister process (default ``INFO``).
- ``SNAPCKPT_STREAM_PERSIST``: ``0`` (default) or ``1``: whether a DISK save of CPU tensors is streamed, its
  persister writing the slot while the rank still copies into it (:meth:`snapckpt.engine.stager.Stager.copy_into`).
  It shortens the time to durable when the copy is a large share of the write (a slow copy on a loaded node, a
  fast disk) and lengthens the save's blocking time, the copy sharing the cores with the writer: measured on
  2 cores, docs/performance.md. ``0`` hands the slot over once the copy is complete.
- ``SNAPCKPT_NATIVE``: ``1`` (default) or ``0``: whether the optional native loops over many tensors
  (:mod:`snapckpt._native`) are used when they were built (``python -m snapckpt._native build``); ``0`` keeps the
  Python path. Nothing is ever compiled at run time.
- ``SNAPCKPT_NATIVE_DIR``: where the native loops are built and looked for (default
  ``$XDG_CACHE_HOME/snapckpt/native``, else ``~/.cache/snapckpt/native``).
- ``TORCHELASTIC_RESTART_COUNT`` (set by torchrun, not by users): the launch attempt, part of every
  coordination key so that a restarted attempt never reads an earlier attempt's records (contract 12).
- ``SNAPCKPT_FAULT_WRITE_DELAY_SECS``: fault injection for tests: the persister sleeps this long before
  each record it writes (a slow persister). Read by the persister process only.
- ``SNAPCKPT_FAULT_POINT``: fault injection for tests: named points where a process SIGKILLs (or
  SIGSTOPs) itself, with rank/step/occurrence selectors (syntax in :mod:`snapckpt._internal.faultpoints`).
- ``SNAPCKPT_FAULT_STORAGE``: fault injection for tests: a JSON plan that makes the persister's storage
  fail in one phase (open, write, fsync, part marker, manifest, rename, tracker) with an errno
  (:class:`snapckpt._testing.faulty_storage.FaultyStorage`).
"""
from __future__ import annotations

import difflib
import os
from typing import List

#: Every ``SNAPCKPT_*`` variable the library reads (the list above).
KNOBS = ("SNAPCKPT_SHM_DIR", "SNAPCKPT_RUNTIME_DIR", "SNAPCKPT_REMOTE_DIR", "SNAPCKPT_REMOTE_BLOCK_NBYTES",
         "SNAPCKPT_PEER_TIMEOUT_SECS", "SNAPCKPT_REPLICAS", "SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES",
         "SNAPCKPT_REPLICA_ADDR", "SNAPCKPT_LOG_LEVEL", "SNAPCKPT_STREAM_PERSIST", "SNAPCKPT_NATIVE",
         "SNAPCKPT_NATIVE_DIR", "SNAPCKPT_FAULT_WRITE_DELAY_SECS", "SNAPCKPT_FAULT_POINT", "SNAPCKPT_FAULT_STORAGE")
#: ``SNAPCKPT_*`` variables of the project's own scripts and benchmarks, not settings of the library.
TOOL_VARIABLES = ("SNAPCKPT_WHEELHOUSE", "SNAPCKPT_BENCH_FSYNC")


def unknown_knobs() -> List[str]:
    """A sentence per ``SNAPCKPT_*`` variable set in the environment that snapckpt does not read (a misspelled
    setting silently does nothing: ``SNAPCKPT_REMOTEDIR`` would train without a remote tier), naming the closest
    known one; empty when there is none."""
    out = []
    for name in sorted(os.environ):
        if name.startswith("SNAPCKPT_") and name not in KNOBS and name not in TOOL_VARIABLES:
            close = difflib.get_close_matches(name, KNOBS, n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"the environment variable {name} is not a snapckpt setting and is ignored{hint}; "
                       f"the settings are {', '.join(KNOBS[:10])}")
    return out

def shm_dir() -> str:
    """Default directory for shared-memory arena files."""
    return os.environ.get("SNAPCKPT_SHM_DIR") or "/dev/shm"


def runtime_dir() -> str:
    """Default parent directory for the persister's socket, lock and token (short path: AF_UNIX limit)."""
    return os.environ.get("SNAPCKPT_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"


def remote_dir() -> str:
    """Default remote tier URL (``SNAPCKPT_REMOTE_DIR``; empty: no remote tier)."""
    return os.environ.get("SNAPCKPT_REMOTE_DIR", "").strip()


def remote_block_nbytes() -> int:
    """Part size of remote uploads, bytes (``SNAPCKPT_REMOTE_BLOCK_NBYTES``; default 16 MiB, at least 5 MiB)."""
    raw = os.environ.get("SNAPCKPT_REMOTE_BLOCK_NBYTES", "")
    if not raw:
        return 16 << 20
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < (5 << 20):
        raise ValueError(f"SNAPCKPT_REMOTE_BLOCK_NBYTES={raw!r} must be an integer number of bytes, at least 5 MiB "
                         "(5242880, S3's smallest part), or unset for the default, 16 MiB (16777216)")
    return value


DEFAULT_PEER_TIMEOUT_SECS = 10.0


def peer_timeout_secs() -> float:
    """Default ``peer_timeout_secs`` (``SNAPCKPT_PEER_TIMEOUT_SECS``, else 10), seconds.

    Raises:
        ValueError: the variable is set but not a positive number of seconds.
    """
    raw = os.environ.get("SNAPCKPT_PEER_TIMEOUT_SECS", "").strip()
    if not raw:
        return DEFAULT_PEER_TIMEOUT_SECS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"SNAPCKPT_PEER_TIMEOUT_SECS={raw!r} must be a positive number of seconds "
                         "(or unset for the default, 10)")
    return value


def replicas() -> "int | None":
    """``SNAPCKPT_REPLICAS`` as an int, ``None`` when unset.

    Raises:
        ValueError: set but not a non-negative integer.
    """
    raw = os.environ.get("SNAPCKPT_REPLICAS", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"SNAPCKPT_REPLICAS={raw!r} must be a non-negative integer (0 turns peer replicas off)")
    return int(raw)


def host_memory_budget_nbytes() -> "int | None":
    """``SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES`` as an int (bytes), ``None`` when unset.

    Raises:
        ValueError: set but not a positive integer.
    """
    raw = os.environ.get("SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES", "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ValueError(f"SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES={raw!r} must be a positive integer number of bytes "
                         "(68719476736 for 64 GiB), or unset for no budget")
    return int(raw)


def replica_addr() -> str:
    """``SNAPCKPT_REPLICA_ADDR`` (empty: derive it from ``MASTER_ADDR``)."""
    return os.environ.get("SNAPCKPT_REPLICA_ADDR", "").strip()


def master_addr() -> str:
    """``MASTER_ADDR``, the rendezvous host torchrun and most launchers set (empty when unset)."""
    return os.environ.get("MASTER_ADDR", "").strip()


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def stream_persist() -> bool:
    """``SNAPCKPT_STREAM_PERSIST`` (default false).

    Raises:
        ValueError: set to anything but ``0``/``1``/``true``/``false`` (any case).
    """
    raw = os.environ.get("SNAPCKPT_STREAM_PERSIST", "").strip().lower()
    if raw in ("1", "true"):
        return True
    if raw in ("", "0", "false"):
        return False
    raise ValueError(f"SNAPCKPT_STREAM_PERSIST={raw!r} must be 0 or 1 (or false/true), or unset for the default, 0")


def log_level() -> str:
    """Log level name for the persister process (``SNAPCKPT_LOG_LEVEL``, any case; default ``INFO``).

    Raises:
        ValueError: the variable is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL.
    """
    raw = os.environ.get("SNAPCKPT_LOG_LEVEL", "")
    level = raw.strip().upper() or "INFO"
    if level not in _LOG_LEVELS:
        raise ValueError(f"SNAPCKPT_LOG_LEVEL={raw!r} must be one of {', '.join(_LOG_LEVELS)} (any case), or unset "
                         "for the default, INFO")
    return level


def fault_write_delay_secs() -> float:
    """Seconds the persister sleeps before each record it writes (fault injection; default 0)."""
    raw = os.environ.get("SNAPCKPT_FAULT_WRITE_DELAY_SECS", "")
    if not raw:
        return 0.0
    value = float(raw)
    if value < 0:
        raise ValueError(f"SNAPCKPT_FAULT_WRITE_DELAY_SECS={raw!r} must be >= 0")
    return value


def fault_point() -> str:
    """The fault-point spec (``SNAPCKPT_FAULT_POINT``; empty: no point armed)."""
    return os.environ.get("SNAPCKPT_FAULT_POINT", "")


def fault_storage() -> str:
    """The storage fault plan, JSON (``SNAPCKPT_FAULT_STORAGE``; empty: storage never fails on purpose)."""
    return os.environ.get("SNAPCKPT_FAULT_STORAGE", "")


def launch_attempt() -> str:
    """The launcher's attempt number: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (``"0"`` on the first
    attempt and when not under torchrun). Non-digits are refused: the value names store keys."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "") or "0"
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={raw!r} must be a non-negative integer")
    return raw


def native() -> bool:
    """``SNAPCKPT_NATIVE`` (default true): whether built native loops may be used.

    Raises:
        ValueError: set to anything but ``0``/``1``/``true``/``false`` (any case).
    """
    raw = os.environ.get("SNAPCKPT_NATIVE", "").strip().lower()
    if raw in ("", "1", "true"):
        return True
    if raw in ("0", "false"):
        return False
    raise ValueError(f"SNAPCKPT_NATIVE={raw!r} must be 0 or 1 (or false/true), or unset for the default, 1")


def native_dir() -> str:
    """Directory of built native loops (``SNAPCKPT_NATIVE_DIR``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    raw = os.environ.get("SNAPCKPT_NATIVE_DIR", "").strip()
    if raw:
        return raw
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "snapckpt", "native")
