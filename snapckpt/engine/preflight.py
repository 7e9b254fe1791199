"""Preflight of a Checkpointer's directories, before the first byte of a snapshot moves (contract 7).

The Checkpointer's constructor runs :func:`preflight_dir` on every rank (the checkpoint directory exists
or can be created, and is writable; the shared-memory directory exists and is a tmpfs), then rank 0 reads
the directory's identity (:func:`dir_identity`), which every memory snapshot is tagged with so that a
deleted and re-created directory never loads another run's snapshots. When the job spans several nodes,
:func:`check_shared_dir` proves that every rank sees the same checkpoint directory (case G7).

Host memory: once a rank's snapshot size is known (``expected_nbytes``, a restart's newest checkpoint, or
the first save), :func:`slot_limit` applies ``host_memory_budget_nbytes`` (how many slots the rank may use)
and :func:`host_memory_shortfall` says, before any page is reserved, when this node's arena (state x slots x
local ranks, plus the peer replica slots) exceeds the free shared memory or ``MemAvailable``, and which
``slots_per_rank`` fits. The persister's reservation raises the hard error
(:meth:`snapckpt.persister.arena.SlotFiles.ensure_size`).
"""
from __future__ import annotations

import errno
import logging
import os
import uuid
from types import GeneratorType
from typing import Any, List, Mapping, Optional, Tuple

import torch

from snapckpt.errors import CheckpointDirError, InsufficientSharedMemoryError, PreflightError
from snapckpt.persister.arena import fs_type, mem_available_bytes
from snapckpt.persister.budget import arena_nbytes, fitting_setting, fmt_nbytes, slots_within

__all__ = ["DIR_ID_XATTR", "check_shared_dir", "dir_identity", "fs_type", "host_memory_shortfall",
           "newest_part_files", "newest_part_nbytes", "preflight_dir", "slot_limit", "tensor_nbytes"]

DIR_ID_XATTR = "user.snapckpt.dir_id"  # random id of a checkpoint directory, an extended attribute of it

log = logging.getLogger(__name__)


def preflight_dir(checkpoint_dir: Optional[str], shm_dir: str, run_id: str, rank: int) -> None:
    """Check the directories of one rank; create ``checkpoint_dir`` if missing.

    Args:
        checkpoint_dir: absolute path of the checkpoint directory (``None``: remote-only mode, ``shm_dir``
            only).
        shm_dir: the shared-memory directory of the arena (a warning when it is not a tmpfs).
        run_id: this launch attempt's run id (names the probe file).
        rank: global rank (names the probe file and the errors).

    Raises:
        CheckpointDirError: ``checkpoint_dir`` is not a directory, is full, or is not writable.
        PreflightError: ``shm_dir`` does not exist.
    """
    d = checkpoint_dir
    if d is not None and os.path.exists(d) and not os.path.isdir(d):
        raise CheckpointDirError(f"checkpoint directory {d!r} exists and is not a directory; pick "
                                 "another path")
    shm = shm_dir
    if not os.path.isdir(shm):
        raise PreflightError(f"shared-memory directory {shm!r} does not exist; point shm_dir= (or "
                             "SNAPCKPT_SHM_DIR) at an existing tmpfs such as /dev/shm")
    if fs_type(shm) not in ("tmpfs", "ramfs", "hugetlbfs", None):
        log.warning("shm_dir %r is on a %s filesystem, not a tmpfs: memory snapshots will be written to "
                    "that disk and will be slow", shm, fs_type(shm))
    if d is None:
        return
    probe = os.path.join(d, f".snapckpt-probe-{run_id}-{rank}")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointDirError(f"checkpoint directory {d!r} cannot be created: the file system is full "
                                     f"(rank {rank}: {e.strerror}); free space or pick another directory") from e
        raise CheckpointDirError(f"checkpoint directory {d!r} cannot be created by rank {rank} "
                                 f"(mkdir: {e.strerror or e}); create it first, or pick a directory under a "
                                 "writable parent") from e
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        try:
            os.unlink(probe)
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise CheckpointDirError(f"checkpoint directory {d!r} is full (rank {rank}: {e.strerror}); "
                                     "free space (older checkpoints, leftover .*.partial-* directories) "
                                     "or pick another directory") from e
        raise CheckpointDirError(f"checkpoint directory {d!r} is not writable by rank {rank}: "
                                 f"{e.strerror or e}; fix its permissions or pick another directory") from e


def newest_part_nbytes(checkpoint_dir: str, rank: int) -> Optional[int]:
    """Bytes of ``rank``'s files in the checkpoint the tracker file ``checkpoint_dir/latest`` names (the
    size of that rank's state when it was last saved), or ``None`` when there is no such checkpoint or it
    cannot be read. A hint only (:attr:`~snapckpt.options.CheckpointOptions.expected_nbytes`): nothing is
    verified here."""
    return sum(n for _, n in newest_part_files(checkpoint_dir, rank)) or None


def tensor_nbytes(state: Any) -> int:
    """Bytes of the tensors' data in ``state`` (``numel * element_size`` each, any device; tensors over the same bytes,
    such as a tied weight's two ``state_dict`` entries, counted once; no data, 0): the size of a snapshot of it but
    for its pickles. Walks dicts (any mapping), lists, tuples, sets and generators (``model.parameters()``), and an
    object with a ``state_dict()`` method (a module, an optimizer) by what that returns; other values count 0, a
    tensor without storage (sparse) too. Other iterators are not advanced (a sampler in the state would lose its
    positions, an endless one would never end). Containers more than 100 levels deep are not walked.

    Raises:
        Exception: what an object's ``state_dict()`` raises."""
    seen: set = set()
    total = 0
    todo = [(state, 0)]
    while todo:
        obj, depth = todo.pop()
        if isinstance(obj, torch.Tensor):
            try:
                ptr = obj.data_ptr()
            except RuntimeError:  # no storage (sparse): the save refuses it
                continue
            nbytes = obj.numel() * obj.element_size()
            key = (obj.device, ptr, nbytes)
            if key[1] and key not in seen:
                seen.add(key)
                total += nbytes
        elif depth > 100:
            continue
        elif isinstance(obj, Mapping):
            todo.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, GeneratorType)):
            todo.extend((v, depth + 1) for v in obj)
        elif callable(getattr(obj, "state_dict", None)) and not isinstance(obj, type):
            todo.append((obj.state_dict(), depth + 1))
    return total


def newest_part_files(checkpoint_dir: str, rank: int) -> List[Tuple[str, int]]:
    """``[(path, nbytes)]`` of ``rank``'s files in the checkpoint the tracker file ``checkpoint_dir/latest``
    names, sorted by name, from its manifest; ``[]`` when there is none or it cannot be read. A hint only
    (nothing is verified here)."""
    import json

    from snapckpt.ondisk.layout import TRACKER
    from snapckpt.ondisk.manifest import MANIFEST

    try:
        with open(os.path.join(checkpoint_dir, TRACKER)) as f:
            name = f.read(4096).strip()
        if not name or "/" in name or name in (".", ".."):
            return []
        with open(os.path.join(checkpoint_dir, name, MANIFEST), "rb") as f:
            files = json.loads(f.read(64 << 20)).get("files", {})
        return [(os.path.join(checkpoint_dir, name, fname), int(r.get("nbytes", 0)))
                for fname, r in sorted(files.items()) if isinstance(r, dict) and r.get("rank") == rank]
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def dir_identity(checkpoint_dir: str) -> str:
    """Rank 0: a random id kept in the extended attribute ``user.snapckpt.dir_id`` of the checkpoint
    directory (created on first use; it goes with the directory, and listings do not show it). ``""``
    where the filesystem has no user xattrs: then memory snapshots are not tied to the directory."""
    d = checkpoint_dir
    try:
        return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
    except OSError as e:
        if e.errno not in (errno.ENODATA, getattr(errno, "ENOATTR", errno.ENODATA)):
            return ""
    value = uuid.uuid4().hex
    try:
        os.setxattr(d, DIR_ID_XATTR, value.encode("ascii"), os.XATTR_CREATE)
        return value
    except FileExistsError:
        return os.getxattr(d, DIR_ID_XATTR).decode("ascii")
    except OSError:
        return ""


def check_shared_dir(checkpoint_dir: str, run_id: str, coord, topology, hosts: list,
                     timeout_secs: float) -> None:
    """Collective, for a job on several nodes: every rank must see the checkpoint directory rank 0 sees
    (case G7: a node-local path by mistake, the same path on different disks, would otherwise surface only
    as parts missing at the first commit). Rank 0 writes a probe file holding a random token, every rank
    reads it back, rank 0 removes it. Costs three coordination rounds; skipped on one node.

    Args:
        checkpoint_dir: absolute path of the checkpoint directory (already created by :func:`preflight_dir`).
        run_id: this launch attempt's run id (names the probe file).
        coord: the job's :class:`~snapckpt.dist.coordination.Coordinator`.
        topology: this rank's :class:`~snapckpt.dist.topology.Topology`.
        hosts: every rank's host identity (``hostname/boot_id``), indexed by rank.
        timeout_secs: timeout of each coordination round, seconds.

    Raises:
        CheckpointDirError: on every rank, when some ranks do not see rank 0's probe (named with their
            nodes), or rank 0 cannot write it.
    """
    if topology.num_nodes <= 1:
        return
    d = checkpoint_dir
    probe = os.path.join(d, f".snapckpt-shared-{run_id}")
    token = uuid.uuid4().hex if coord.rank == 0 else ""
    err = ""
    if coord.rank == 0:
        try:
            with open(probe, "w") as f:
                f.write(token)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            err = f"rank 0 cannot write a probe file in {d!r}: {e.strerror or e}"
    token = coord.all_gather("shared_dir_probe", {"token": token, "err": err}, timeout_secs)[0]
    if token["err"]:
        raise CheckpointDirError(token["err"])
    try:
        with open(probe) as f:
            seen = f.read() == token["token"]
    except OSError:
        seen = False
    seen_all = coord.all_gather("shared_dir_seen", {"seen": seen}, timeout_secs)
    if coord.rank == 0:
        try:
            os.unlink(probe)
        except OSError:
            pass
    blind = [r for r, p in enumerate(seen_all) if not p["seen"]]
    if blind:
        nodes = sorted({hosts[r].split("/")[0] for r in blind})
        raise CheckpointDirError(
            f"checkpoint directory {d!r} is not the same directory on every node: rank(s) "
            f"{', '.join(map(str, blind))} on {', '.join(nodes)} do not see the probe file rank 0 wrote there "
            f"(on {hosts[0].split('/')[0]}); the directory seems node-local. Put checkpoint_dir on a "
            "filesystem every node mounts at the same path (NFS, Lustre, GPFS, a shared volume), or "
            "every commit would wait for parts written on other nodes")
    coord.all_gather("shared_dir_done", {"ok": True}, timeout_secs)


def slot_limit(options, topology, slot_nbytes: int) -> int:
    """How many arena slots this rank may use for a snapshot slot of ``slot_nbytes`` bytes: ``slots_per_rank``
    without a host-memory budget; under ``host_memory_budget_nbytes`` the most that fit the rank's equal share of
    it (:func:`snapckpt.persister.budget.slots_within`). Always a count, never "all": a persister that outlived an
    earlier run of the job holds that run's slots of the rank, more than this run's ``slots_per_rank`` may allow.

    Args:
        options: the :class:`~snapckpt.options.CheckpointOptions`.
        topology: this rank's :class:`~snapckpt.dist.topology.Topology` (local ranks, nodes).
        slot_nbytes: bytes of one slot (the snapshot times ``slot_headroom``).

    Raises:
        InsufficientSharedMemoryError: the budget cannot hold one slot per rank (names both sizes and the
            smallest budget that would).
        ValueError: ``SNAPCKPT_HOST_MEMORY_BUDGET_NBYTES`` or ``SNAPCKPT_REPLICAS`` is malformed.
    """
    budget = options.resolved_host_memory_budget_nbytes
    if budget is None:
        return options.slots_per_rank
    local, replicas = len(topology.local_ranks), options.resolved_replicas(topology.num_nodes)
    k = slots_within(budget, slot_nbytes, local, replicas, options.slots_per_rank)
    if k < 1:
        one = arena_nbytes(slot_nbytes, 1, local, replicas)
        peers = f" + {replicas} peer replica slot(s)" if replicas else ""
        raise InsufficientSharedMemoryError(
            f"host_memory_budget_nbytes={budget} ({fmt_nbytes(budget)}) cannot hold one snapshot slot per rank: "
            f"this node's {local} local rank(s) x (1 slot{peers}) x {fmt_nbytes(slot_nbytes)} need "
            f"{fmt_nbytes(one)}; raise the budget to at least {one}, save less state per rank, or turn peer "
            "replicas off (replicas=0) if they are on; nothing was copied")
    return k


def host_memory_shortfall(options, topology, slot_nbytes: int, slots: int, arena_dir: str) -> Optional[str]:
    """A warning when this node's arena for slots of ``slot_nbytes`` bytes does not fit, else ``None``.

    The arena needs ``slot_nbytes x (slots + replicas) x local ranks`` bytes (each local rank's state taken
    to be this rank's size: the persister knows each rank's own size only once it asked for a slot,
    :meth:`snapckpt.persister.slots.SlotTable.acquire`); what is available is the smaller of the free space of
    ``shm_dir`` and the host's ``MemAvailable``, each plus what the job's arena (``arena_dir``) already holds (it
    is reused).
    The message names both and the setting that fits (:func:`snapckpt.persister.budget.fitting_setting`).

    Args:
        options: the :class:`~snapckpt.options.CheckpointOptions`.
        topology: this rank's :class:`~snapckpt.dist.topology.Topology`.
        slot_nbytes: bytes of one slot.
        slots: slots per rank in use (``slots_per_rank``, or the budget's count).
        arena_dir: the job's arena directory (may not exist yet).
    """
    local, replicas = len(topology.local_ranks), options.resolved_replicas(topology.num_nodes)
    need = arena_nbytes(slot_nbytes, slots, local, replicas)
    shm = options.resolved_shm_dir
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    held = _dir_nbytes(arena_dir)
    free = st.f_bavail * st.f_frsize
    mem = mem_available_bytes()
    available = min(free, mem) + held if mem is not None else free + held
    if need <= available:
        return None
    peers = f" + {replicas} peer replica slot(s)" if replicas else ""
    uneven = (" (every local rank counted at this rank's size; ranks of other sizes, such as pipeline stages, are "
              "counted at their own by the persister, which refuses a save only when their slots do not fit)"
              if local > 1 else "")
    return (f"host memory: this node's snapshot arena needs {fmt_nbytes(need)} ({local} local rank(s) x ({slots} "
            f"slot(s){peers}) x {fmt_nbytes(slot_nbytes)}) but {fmt_nbytes(available)} is available ({shm} has "
            f"{free} bytes free, MemAvailable is {mem} bytes, the arena already holds {held}); "
            + fitting_setting(slot_nbytes, slots, local, replicas, available) + uneven)


def _dir_nbytes(path: str) -> int:
    """Bytes of memory the files directly in ``path`` hold (allocated blocks); 0 when it does not exist."""
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
    except OSError:
        return 0
    return total
