"""Helpers shared by the ``snapckpt`` subcommands: the checkpoint-directory argument check, plain-text
tables, byte progress bars and the manifest's per-file record check.

They sit between :mod:`snapckpt.cli.main` (which parses the arguments) and the subcommands
(:mod:`~snapckpt.cli.ls`, :mod:`~snapckpt.cli.verify`, :mod:`~snapckpt.cli.inspect`), which read
checkpoint directories through :func:`snapckpt.storage.factory.open_storage` only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, NoReturn, Optional

from snapckpt._internal.progress import byte_bar
from snapckpt.metrics import human_bytes
from snapckpt.ondisk.manifest import MANIFEST, SIDECAR, record_checksum
from snapckpt.storage.urls import shown_url, url_scheme

__all__ = ["bar", "table", "dir_bytes", "bad_records", "checkpoint_dir", "fail", "human_bytes", "print_json",
           "report_verified"]


def fail(parser: argparse.ArgumentParser, msg: str) -> NoReturn:
    """Exit 2 (a usage error, as ``parser.error``) with ``PROG: error: msg`` on stderr but without argparse's
    usage line: the arguments parsed, and what they name is wrong (a missing directory, a step not committed),
    so the usage line would only push the reason off the screen. With ``--json`` (``parser.json_errors``, set by
    :mod:`snapckpt.cli.main`) also ``{"error": msg, "exit": 2}`` on stdout."""
    if getattr(parser, "json_errors", False):
        print_json({"error": msg, "exit": 2})
    parser.exit(2, f"{parser.prog}: error: {msg}\n")


def print_json(obj: Any) -> None:
    """Write ``obj`` to stdout as one JSON document (``--json``; key order kept, ends with a newline)."""
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def bar(args: argparse.Namespace, total: int, desc: str):
    """A byte progress bar of ``total`` bytes on stderr (tqdm), or a no-op one when ``args.progress`` turns
    it off or tqdm is missing (``None``: shown when stderr is a terminal)."""
    return byte_bar(total, desc, args.progress)


def table(rows: List[List[str]], indent: str = "") -> str:
    """``rows`` (the first is the header) as left-aligned columns two spaces apart, each line ``indent``ed."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def dir_bytes(path: str) -> int:
    """Bytes of the files under ``path``, the sidecar excluded (unreadable files count 0)."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != SIDECAR]
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def bad_records(manifest: Dict[str, Any]) -> Optional[str]:
    """Why the manifest's per-file records are unusable (``None`` when each has ``nbytes`` and a checksum)."""
    for name, rec in manifest["files"].items():
        if not (isinstance(rec, dict) and isinstance(rec.get("nbytes"), int) and record_checksum(rec) is not None):
            return f"manifest record of {name!r} is malformed: {rec!r}"
    return None


def checkpoint_dir(parser: argparse.ArgumentParser, d: str) -> str:
    """``d`` if it is a checkpoint directory (the one holding the step directories and the tracker file).

    Raises:
        SystemExit: (exit code 2, through :func:`fail`) ``d`` is missing, a file, or one checkpoint
            (it holds a manifest) instead of the directory of checkpoints; or a URL this command does not read.
    """
    scheme = url_scheme(d)
    if scheme and not os.path.isdir(d):  # not "no such directory": say what it is and which commands read it
        slash = "" if "://" in d else f", written {scheme}:/ with one slash"
        fail(parser, f"{shown_url(d)!r} is a URL ({scheme}://{slash}): `snapckpt ls` and `snapckpt verify` read an "
                     "object store URL written in full (scheme://bucket/prefix), `snapckpt inspect` only a local "
                     "checkpoint directory (pass its path)")
    if not os.path.isdir(d):
        fail(parser, f"{d}: {'not a directory' if os.path.exists(d) else 'no such directory'} (pass the "
                     "checkpoint directory: the one that holds the step directories and the tracker file)")
    if os.path.exists(os.path.join(d, MANIFEST)):
        fail(parser, f"{d} is one checkpoint, not a checkpoint directory: pass its parent "
                     f"{os.path.dirname(os.path.abspath(d))}")
    return d


def nested_checkpoint_dirs(d: str, limit: int = 3) -> List[str]:
    """Up to ``limit`` sub-directories of ``d`` that are themselves checkpoint directories (a step directory in
    them holds a manifest): what a user who passed a run's parent directory meant (``runs/x`` for
    ``runs/x/checkpoints``). Reads two levels of names and one ``stat`` per step directory; unreadable ones are
    passed over."""
    found: List[str] = []
    try:
        children = sorted(e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False))
    except OSError:
        return found
    for child in children:
        try:
            steps = [e.path for e in os.scandir(child) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        if any(os.path.exists(os.path.join(s, MANIFEST)) for s in steps):
            found.append(child)
            if len(found) == limit:
                break
    return found


def did_you_mean(d: str) -> str:
    """`` (did you mean <x>?)`` naming :func:`nested_checkpoint_dirs` of ``d``, or ``""``."""
    nested = nested_checkpoint_dirs(d)
    return f" (did you mean {' or '.join(nested)}?)" if nested else ""


def report_verified(target: str, as_json: bool, unreadable: List[str], committed: List[Any],
                    problems_of: Callable[[Any], Optional[List[str]]]) -> int:
    """Check and print ``snapckpt verify``'s result (local directory or URL alike); return its exit code.

    Args:
        target: the directory or URL as the user gave it.
        unreadable: checkpoints whose manifest cannot be used (each reported as damaged).
        committed: the committed checkpoints to check (``.dirname``, ``.step``, ``.manifest``).
        problems_of: checks one checkpoint's files; returns its problems (empty: intact; ``None``: its
            directory vanished while it was checked, retired by the job saving there: skipped with a note).

    Returns:
        1 when any checkpoint is damaged, else 0.
    """
    results = [{"name": p, "step": None, "state": "damaged", "files": 0, "bytes": 0, "problems": [p]}
               for p in unreadable]
    if not as_json:
        for p in unreadable:
            print(f"DAMAGED  {p}")
    for c in committed:
        problems = problems_of(c)
        if problems is None:  # gone, not damaged
            if not as_json:
                print(f"{c.dirname}: deleted or renamed while it was verified (retention of the job saving "
                      "there, or by hand); skipped")
            continue
        files = c.manifest["files"]
        nbytes = sum(r["nbytes"] for r in files.values() if isinstance(r, dict) and isinstance(r.get("nbytes"), int))
        results.append({"name": c.dirname, "step": c.step, "state": "damaged" if problems else "intact",
                        "files": len(files), "bytes": nbytes, "problems": problems})
        if not as_json:
            verdict = "DAMAGED" if problems else "OK"
            print(f"{verdict:<8} step {c.step}  {c.dirname}  ({len(files)} file(s), {human_bytes(nbytes)})")
            for p in problems:
                print(f"    {p}")
    damaged = sum(r["state"] == "damaged" for r in results)
    if as_json:
        print_json({"dir": target, "checkpoints": results, "intact": len(results) - damaged, "damaged": damaged})
    else:
        print(f"{len(results)} checkpoint(s): {len(results) - damaged} intact, {damaged} damaged")
    return 1 if damaged else 0
