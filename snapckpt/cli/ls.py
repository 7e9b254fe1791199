"""``snapckpt ls DIR``: one row per checkpoint directory of DIR, its state, and the tracker naming it.

Reads DIR only (through :func:`snapckpt.storage.factory.open_storage`): the manifests and file sizes of
committed directories (:mod:`snapckpt.ondisk.manifest`), the part/fail markers of hidden in-flight
``.NAME.partial-RUN`` directories, and the tracker files (``latest``, Megatron's
``latest_checkpointed_iteration.txt``). States: ``committed``, ``incomplete``, ``damaged`` (see
:mod:`snapckpt.cli`). A partial directory a dead save left (:mod:`snapckpt.persister.leftovers`) is no
checkpoint: a warning names it instead of a row.

``--json`` prints one object instead of the table: ``{"dir": DIR as given, "checkpoints": [{"name",
"state", "step" (int or null), "world_size" (int or null), "bytes" (int), "trackers" (list of tracker file
names naming it), "note" (str)}], "warnings": [str], "other_directories": int}``.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from snapckpt._internal.env import runtime_dir
from snapckpt.cli.common import bad_records, checkpoint_dir, did_you_mean, dir_bytes, human_bytes, print_json, table
from snapckpt.errors import CheckpointCorruptError
from snapckpt.ondisk.layout import STEP_DIR_PATTERN, TRACKER
from snapckpt.ondisk.manifest import MANIFEST, SIDECAR, check_sizes, parse_manifest
from snapckpt.persister.leftovers import writer_is_dead
from snapckpt.storage.base import StorageReader
from snapckpt.storage.factory import open_storage
from snapckpt.storage.urls import is_remote_url

__all__ = ["Row", "TRACKERS", "scan", "cmd_ls"]

TRACKERS = (TRACKER, "latest_checkpointed_iteration.txt")
_PARTIAL = ".partial-"
DEAD_QUIET_SECS = 600.0  # a partial directory unchanged this long, of no persister here: a dead save's leftover


@dataclass
class Row:
    """One checkpoint directory as ``ls`` shows it (``nbytes``: bytes of its files)."""

    name: str
    state: str
    step: Optional[int] = None
    world_size: Optional[int] = None
    nbytes: int = 0
    note: str = ""


def _partial_row(path: str, name: str) -> Row:
    dirname, _, run_id = name[1:].rpartition(_PARTIAL)
    row = Row(dirname, "incomplete", nbytes=dir_bytes(path))
    done, failed = [], []
    for marker in open_storage().listdir(os.path.join(path, SIDECAR)):
        kind, _, rest = marker[:-len(".json")].partition("_")
        if not marker.endswith(".json") or kind not in ("part", "fail") or not rest.isdigit():
            continue
        try:
            with open(os.path.join(path, SIDECAR, marker), "rb") as f:
                rec = json.load(f)
            row.step = int(rec["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        (done if kind == "part" else failed).append(int(rest))
    row.note = f"run {run_id}: parts from ranks {done}" + (f", failed ranks {failed}" if failed else "")
    return row


def _committed_row(reader: StorageReader, path: str, name: str) -> Row:
    row = Row(name, "damaged", nbytes=dir_bytes(path))
    try:
        m = parse_manifest(reader.read_bytes(os.path.join(path, MANIFEST)), name)
    except FileNotFoundError:
        row.note = f"{MANIFEST} is missing"
        return row
    except (OSError, CheckpointCorruptError) as e:
        row.note = str(e)
        return row
    row.step, row.world_size = m["step"], m["world_size"]
    row.note = bad_records(m) or ""
    if row.note:
        return row
    row.nbytes = sum(r["nbytes"] for r in m["files"].values())
    try:
        check_sizes(reader, path, m)
    except CheckpointCorruptError as e:
        row.note = str(e)
        return row
    row.state = "committed"
    return row


def scan(d: str, dead: Optional[List[str]] = None) -> Tuple[List[Row], int]:
    """Every checkpoint directory in ``d`` (sorted by step, then name) and how many others were seen. A
    partial directory whose writer is provably dead (:func:`snapckpt.persister.leftovers.writer_is_dead`) is
    no checkpoint: its note goes to ``dead`` instead of a row."""
    reader = open_storage()
    rows, others = [], 0
    for name in reader.listdir(d):
        path = os.path.join(d, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(".") and _PARTIAL in name:
            run_id = name.rpartition(_PARTIAL)[2]
            if dead is not None and writer_is_dead(path, run_id, runtime_dir(), DEAD_QUIET_SECS):
                dead.append(f"{name} ({human_bytes(dir_bytes(path))}) is what a dead save (run {run_id}) left, not "
                            "a checkpoint: the next job saving here removes it, or delete it")
                continue
            rows.append(_partial_row(path, name))
        elif not name.startswith(".") and (os.path.isdir(os.path.join(path, SIDECAR))
                                           or STEP_DIR_PATTERN.fullmatch(name)):
            row = _committed_row(reader, path, name)
            if row.state == "damaged" and not os.path.isdir(path):
                continue  # retired while it was read (retention renames it away): gone, not damaged
            rows.append(row)
        elif not name.startswith("."):
            others += 1
    rows.sort(key=lambda r: (r.step is None, r.step or 0, r.name))
    return rows, others


def _trackers(d: str, rows: List[Row]) -> Tuple[Dict[int, List[str]], List[str]]:
    """``{row index: [tracker names naming it]}`` and notes on trackers that name nothing committed."""
    named: Dict[int, List[str]] = {}
    notes = []
    for tracker in TRACKERS:
        try:
            with open(os.path.join(d, tracker), encoding="utf-8", errors="replace") as f:
                content = f.read().strip()
        except OSError:
            continue
        hits = [i for i, r in enumerate(rows) if r.state != "incomplete" and r.name == content]
        if not hits and content.isdigit():
            hits = [i for i, r in enumerate(rows) if r.state != "incomplete" and r.step == int(content)]
        for i in hits:
            named.setdefault(i, []).append(tracker)
        if hits and not any(rows[i].state == "committed" for i in hits):
            notes.append(f"{tracker} names {content!r}, which is damaged (see its row; `snapckpt verify` "
                         "names the file)")
        elif not hits:
            notes.append(f"{tracker} names {content!r}, which is not a committed checkpoint here")
    return named, notes


def cmd_ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the table of ``args.dir`` and the tracker warnings (or, with ``args.json``, one JSON object);
    returns 0 (a usage error exits 2)."""
    if is_remote_url(args.dir):  # an object store (remote-only mode, or a remote tier)
        from snapckpt.cli.remote import ls_remote
        return ls_remote(args, parser)
    d = checkpoint_dir(parser, args.dir)
    dead: List[str] = []
    rows, others = scan(d, dead)
    named, notes = _trackers(d, rows)
    notes += dead
    if getattr(args, "json", False):
        print_json({"dir": args.dir,
                    "checkpoints": [{"name": r.name, "state": r.state, "step": r.step, "world_size": r.world_size,
                                     "bytes": r.nbytes, "trackers": named.get(i, []), "note": r.note}
                                    for i, r in enumerate(rows)],
                    "warnings": notes, "other_directories": others})
        return 0
    if rows:
        out = [["STEP", "NAME", "STATE", "WORLD", "SIZE", "TRACKER", "NOTE"]]
        for i, r in enumerate(rows):
            out.append(["-" if r.step is None else str(r.step), r.name, r.state,
                        "-" if r.world_size is None else str(r.world_size), human_bytes(r.nbytes),
                        ",".join(named.get(i, [])), r.note])
        print(table(out))
    else:
        print(f"no checkpoint directories in {d}{did_you_mean(d)}")
    for n in notes:
        print(f"warning: {n}")
    if others:
        print(f"({others} other director{'y' if others == 1 else 'ies'} without a {SIDECAR} sidecar not listed)")
    return 0
