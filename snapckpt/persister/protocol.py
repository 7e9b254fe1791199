"""Control messages between a training process and the node persister.

One JSON object per line over an ``AF_UNIX`` stream socket, request then response, never a pickle and
never tensor data (tensor bytes travel through the arena). Every request has an ``op`` and a fixed set of
typed fields (:data:`REQUESTS`); a record with a missing, extra or mistyped field is refused before it is
acted on. A response is ``{"ok": true, ...}`` or ``{"ok": false, "error": <error record>}``.

Errors cross the process boundary as records ``{"type", "message", "errno", "filename"}`` and are rebuilt
by :func:`error_from_record` with their original type when it is an ``OSError`` (``errno`` picks the
subclass, e.g. ``PermissionError``) or a class of :mod:`snapckpt.errors`; anything else becomes a
:class:`~snapckpt.errors.PersistError` carrying the original type's name. ``ENOSPC`` and ``EDQUOT`` become
:class:`~snapckpt.errors.DiskFullError` (an ``OSError`` too) with the cause and the fix in its message.
"""
from __future__ import annotations

import builtins
import json
import os
from typing import Any, Dict

from snapckpt import errors as _errors
from snapckpt._internal.compat import add_note

__all__ = ["PROTOCOL_VERSION", "REQUESTS", "OPERATOR_OPS", "MAX_MESSAGE_NBYTES", "encode", "decode", "validate_request", "error_record",
           "error_from_record", "ProtocolError"]

MAX_MESSAGE_NBYTES = 1 << 20

_INT, _STR, _BOOL, _FLOAT, _LIST, _DICT = int, str, bool, (int, float), list, dict

#: The version of :data:`REQUESTS`, sent in ``hello``: one more at every change of a request's fields. A rank and
#: a persister of different versions (snapckpt upgraded while the job's persister lived on) refuse each other
#: with :class:`~snapckpt.errors.ProtocolVersionError` at ``hello``, not with a field error at some later request.
PROTOCOL_VERSION = 2

REQUESTS: Dict[str, Dict[str, Any]] = {
    "hello": {"protocol": _INT, "token": _STR, "job": _STR, "run_id": _STR, "rank": _INT, "world_size": _INT,
              "local_ranks": _LIST, "committer": _BOOL, "pid": _INT, "checkpoint_dir": _STR,
              "slots_per_rank": _INT, "keep_last": _INT, "commit_timeout_secs": _FLOAT,
              "flush_on_crash": _BOOL, "fsync": _BOOL, "dir_id": _STR, "remote_dir": _STR,
              "peer_timeout_secs": _FLOAT},
    # slots: how many of its slots the rank may use: slots_per_rank, or fewer under its host-memory budget
    # (persister/budget.py); 0 (all) only from ranks of this version older than that (SlotTable.usable)
    "acquire": {"step": _INT, "nbytes": _INT, "slots": _INT},
    "reserve": {"nbytes": _INT, "slots": _INT},
    # hold: the rank starts (True) or ends reading a checkpoint; reservations wait meanwhile (slots.ReserveHolds)
    "reserve_hold": {"hold": _BOOL},
    "ready": {"slot": _INT, "step": _INT, "index_offset": _INT, "index_nbytes": _INT, "dirname": _STR,
              "persistable": _BOOL, "persist": _BOOL,
              "tracker_name": _STR, "tracker_content": _STR},
    # a streamed DISK save (engine/stager.py): the rank has written the slot's pickles and index and starts
    # copying the spans below data_end, publishing the slot's watermark; "ready" follows once the copy is done.
    # Sent without waiting for the answer (client.post): a persister that cannot stream writes at "ready"
    "stream": {"slot": _INT, "step": _INT, "index_offset": _INT, "index_nbytes": _INT, "data_end": _INT,
               "dirname": _STR, "tracker_name": _STR, "tracker_content": _STR},
    "abort": {"slot": _INT},
    "fail": {"step": _INT, "dirname": _STR, "type": _STR, "message": _STR},
    "persist": {"step": _INT},
    # seq: the rank's snapshot the save handed over (the "seq" of its ready's answer; -1: not known), which
    # tells a save of a step and directory from another save of them (Scheduler.result)
    "status": {"step": _INT, "dirname": _STR, "seq": _INT},
    # status, answered once the save is no longer pending or after wait_secs (seconds), whichever comes first
    "await": {"step": _INT, "dirname": _STR, "seq": _INT, "wait_secs": _FLOAT},
    "held": {},
    # the peer channel (persister/channel.py): listen for peers, take the run's secret, its replica target
    # nodes (persister/replication.py; [] without replicas) and every node's address, this node's index and
    # the committer's (commit notices: persister/commit_notices.py); list what this persister can serve,
    # fetch this rank's snapshot from a peer into its arena
    "replica_listen": {"addr": _STR},
    "replica_peers": {"secret": _STR, "targets": _LIST, "nodes": _LIST, "node": _INT, "committer_node": _INT},
    "holdings": {},
    "fetch": {"step": _INT, "run_id": _STR, "addr": _STR, "port": _INT},
    "ping": {},
    "bye": {},
    # sent (unanswered) by a client that gives up on a request that timed out, just before it closes the
    # connection: its process lives on and reconnects, so the close is neither a clean end nor a crash
    "abandon": {},
    # Operator requests (``snapckpt ps`` / ``snapckpt stop``), each alone on its own connection instead of
    # after a hello, authenticated the same way: the job key and the secret token of the runtime directory.
    "info": {"token": _STR, "job": _STR},
    "stop": {"token": _STR, "job": _STR},
}
#: Requests a connection may send without a hello (then the connection is closed after the answer).
OPERATOR_OPS = ("info", "stop")


class ProtocolError(_errors.PersisterError):
    """A malformed control message."""


def version_mismatch(rank_version: Any, persister_version: Any, pid: Any) -> _errors.ProtocolVersionError:
    """The error for a ``hello`` between a rank and a persister of different protocol versions (a version
    ``None``: that side sent none, an older snapckpt; ``pid``: the persister's, ``None`` where unknown)."""
    def say(v: Any) -> str:
        return "an older snapckpt (no protocol version)" if v is None else f"protocol version {v}"
    who = "the job's persister" + (f" (pid {pid})" if pid is not None else "")
    return _errors.ProtocolVersionError(
        f"this training process runs {say(rank_version)}, {who} {say(persister_version)}: snapckpt was upgraded "
        "(or another environment used) while the persister of this job lived on. Stop it with `snapckpt stop "
        "<checkpoint_dir>` (it writes what it holds first), or wait for it to exit "
        "(persister_idle_timeout_secs), then start the job again; nothing was written by this connection")


def encode(obj: Dict[str, Any]) -> bytes:
    """Serialize one message to a JSON line (bytes)."""
    data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_MESSAGE_NBYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_NBYTES}")
    return data


def decode(line: bytes) -> Dict[str, Any]:
    """Parse one JSON line into a dict; :class:`ProtocolError` if it is not a JSON object."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nesting
        raise ProtocolError(f"control message is not JSON: {str(e)[:200]}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("control message is not a JSON object")
    return obj


def validate_request(msg: Dict[str, Any]) -> str:
    """Check a request against :data:`REQUESTS`; return its op.

    Raises:
        snapckpt.errors.ProtocolVersionError: a ``hello`` of another :data:`PROTOCOL_VERSION` (or none).
        ProtocolError: an unknown op, a missing, extra or mistyped field.
    """
    op = msg.get("op")
    schema = REQUESTS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ProtocolError(f"unknown op {op!r}")
    if op == "hello" and msg.get("protocol") != PROTOCOL_VERSION:
        raise version_mismatch(msg.get("protocol"), PROTOCOL_VERSION, os.getpid())
    fields = set(msg) - {"op"}
    if fields != set(schema):
        raise ProtocolError(f"op {op!r}: fields {sorted(fields)} != expected {sorted(schema)}")
    for name, typ in schema.items():
        value = msg[name]
        if isinstance(value, bool) and typ is not _BOOL:
            raise ProtocolError(f"op {op!r}: field {name!r} must be {typ}, got a bool")
        if not isinstance(value, typ):
            raise ProtocolError(f"op {op!r}: field {name!r} must be {typ}, got {type(value).__name__}")
    return op


def error_record(exc: BaseException) -> Dict[str, Any]:
    """Describe an exception as a JSON-safe record."""
    rec: Dict[str, Any] = {"type": type(exc).__name__, "message": str(exc), "errno": None, "filename": None}
    if isinstance(exc, OSError):
        rec["errno"] = exc.errno
        rec["message"] = exc.strerror or str(exc)
        rec["filename"] = exc.filename if isinstance(exc.filename, str) else None
    return rec


def error_from_record(rec: Dict[str, Any], *, context: str = "") -> Exception:
    """Rebuild an exception from :func:`error_record` output, with ``context`` added as a note."""
    typ = rec.get("type", "")
    msg = rec.get("message", "")
    exc: Exception
    errno_ = rec.get("errno")
    hint = _DISK_FULL_HINTS.get(errno_) if errno_ is not None else None
    if errno_ in _DISK_FULL and hint:  # the cause and the fix in the message itself, once however often relayed
        msg = msg if hint in msg else f"{msg}; {hint}"
        exc = _errors.DiskFullError(*((errno_, msg, rec["filename"]) if rec.get("filename") else (errno_, msg)))
        hint = None
    elif errno_ is not None:
        exc = OSError(errno_, msg, rec.get("filename")) if rec.get("filename") else OSError(errno_, msg)
    elif hasattr(_errors, typ) and isinstance(getattr(_errors, typ), type):
        exc = getattr(_errors, typ)(msg)
    elif isinstance(getattr(builtins, typ, None), type) and issubclass(getattr(builtins, typ), Exception):
        try:
            exc = getattr(builtins, typ)(msg)
        except Exception:  # a builtin with an unusual constructor
            exc = _errors.PersistError(f"{typ}: {msg}")
    else:
        exc = _errors.PersistError(f"{typ}: {msg}")
    if context:
        add_note(exc, context)
    if hint:
        add_note(exc, hint)
    return exc


_FULL = ("the previous checkpoint is intact and nothing of this save is left where a loader looks; "
         "{what}, then save again")
_DISK_FULL = (28, 122)  # ENOSPC, EDQUOT: rebuilt as DiskFullError
#: Notes added to storage errors that reach the trainer (the cause and the fix; errno values as Linux; the
#: two of _DISK_FULL become DiskFullError).
_DISK_FULL_HINTS = {
    28: "ENOSPC: the filesystem holding the checkpoint directory is full; " + _FULL.format(
        what="free space there or keep fewer checkpoints (keep_last; save_total_limit under the Trainer)"),
    122: "EDQUOT: your disk quota on the checkpoint filesystem is used up; " + _FULL.format(
        what="free space or raise the quota, or keep fewer checkpoints (keep_last)"),
    27: "EFBIG: a file-size limit stopped the write (ulimit -f / RLIMIT_FSIZE of the process that started the "
        "persister, or the filesystem's maximum file size); " + _FULL.format(
            what="raise the limit (ulimit -f unlimited) before starting the job"),
    13: "EACCES: the persister (it runs as the user who started the job) may not write in the checkpoint "
        "directory; " + _FULL.format(what="give that user write access to checkpoint_dir, or choose another "
                                          "checkpoint_dir"),
    1: "EPERM: the filesystem refused the operation (an immutable or append-only file or directory, or a "
       "filesystem that refuses renames); " + _FULL.format(what="check the attributes (lsattr) and the mount of "
                                                                "checkpoint_dir, or choose another checkpoint_dir"),
    30: "EROFS: the filesystem holding the checkpoint directory is mounted read-only; " + _FULL.format(
        what="remount it read-write or point checkpoint_dir at a writable filesystem"),
    5: "EIO: the storage reported an I/O error (a failing disk, a lost network filesystem); the snapshot is "
       "still held in memory; " + _FULL.format(what="check the device and the kernel log (dmesg) or move "
                                                    "checkpoint_dir"),
}


def ok(**fields: Any) -> Dict[str, Any]:
    """A success response."""
    return {"ok": True, **fields}


def fail(exc: BaseException) -> Dict[str, Any]:
    """A failure response carrying ``exc``."""
    return {"ok": False, "error": error_record(exc)}
