"""``snapckpt ls URL`` and ``snapckpt verify URL [STEP]`` for a remote-only checkpoint location
(``Checkpointer("s3://bucket/run1")``) or a remote tier: the same rows and verdicts as for a directory, read
from the object store through :class:`~snapckpt.storage.remote.RemoteStore` (credentials from the standard
places, as the Checkpointer reads them).

A prefix with a manifest object is ``committed`` (every object it lists has its size) or ``damaged``; one
with only the upload marker is ``incomplete`` (an upload in flight, or interrupted: the next persister of
the job removes it).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

from snapckpt.cli.common import bad_records, fail, human_bytes, print_json, report_verified, table
from snapckpt.errors import CheckpointCorruptError, RemoteStorageError
from snapckpt.ondisk.layout import STEP_DIR_PATTERN
from snapckpt.ondisk.manifest import MANIFEST, SIDECAR, parse_manifest
from snapckpt.storage.remote import REMOTE_MARKER, RemoteStore

__all__ = ["ls_remote", "verify_remote"]

TRACKERS = ("latest", "latest_checkpointed_iteration.txt")


def _store(parser: argparse.ArgumentParser, url: str) -> RemoteStore:
    """The store of ``url``; exit 2 when the URL cannot be used, or names one checkpoint (its prefix holds a
    manifest or an upload marker) instead of the checkpoint directory: ``ls`` said "no checkpoints" and
    ``verify`` "no committed checkpoint" of a checkpoint that was there, as ``ls DIR`` of a step directory
    does not."""
    try:
        store = RemoteStore(url, role="URL")
    except RemoteStorageError as e:
        fail(parser, str(e))
    try:
        one = store.fs.exists(store._path(MANIFEST)) or store.fs.exists(store._path(REMOTE_MARKER))
    except Exception:  # the listing that follows names why the store cannot be read
        one = False
    if one:
        fail(parser, f"{store.url} is one checkpoint, not a checkpoint directory: pass its parent "
                     f"{store.url.rsplit('/', 1)[0]}")
    return store


def _rows(store: RemoteStore) -> List[Dict[str, Any]]:
    rows = []
    for name in store._dirs():
        if name.startswith("."):
            continue
        row: Dict[str, Any] = {"name": name, "state": "damaged", "step": None, "world_size": None, "bytes": 0,
                               "trackers": [], "note": ""}
        side = store.listdir(f"{store.url}/{name}/{SIDECAR}")
        if "manifest.json" not in side:
            if "remote.json" not in side and not STEP_DIR_PATTERN.fullmatch(name):
                continue  # not snapckpt's
            parts = sorted(int(n[5:-5]) for n in side if n.startswith("part_") and n[5:-5].isdigit())
            row.update(state="incomplete", note="no manifest: an upload in flight or interrupted"
                       + (f"; parts from ranks {parts}" if parts else ""))
            try:
                row["step"] = int(json.loads(store.read_bytes(f"{store.url}/{name}/{REMOTE_MARKER}"))["step"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            rows.append(row)
            continue
        try:
            m = parse_manifest(store.read_bytes(f"{store.url}/{name}/{MANIFEST}"), name)
            row.update(step=m["step"], world_size=m["world_size"])
            row["note"] = bad_records(m) or ""
            if not row["note"]:
                row["bytes"] = sum(r["nbytes"] for r in m["files"].values())
                store.check_sizes(name, m)
                row["state"] = "committed"
        except (OSError, CheckpointCorruptError) as e:
            row["note"] = str(e)
        rows.append(row)
    rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["name"]))
    return rows


def ls_remote(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``snapckpt ls URL``: as ``ls DIR`` (the same table and ``--json`` object); exit 0, 2 when the store
    cannot be used (the message names the URL and the cause)."""
    store = _store(parser, args.dir)
    try:
        rows = _rows(store)
        notes = []
        for tracker in TRACKERS:
            try:
                content = store.read_bytes(f"{store.url}/{tracker}").decode("utf-8", "replace").strip()
            except FileNotFoundError:
                continue
            hits = [r for r in rows if r["state"] == "committed" and r["name"] == content]
            for r in hits:
                r["trackers"].append(tracker)
            if not hits:
                notes.append(f"{tracker} names {content!r}, which is not a committed checkpoint here")
    except Exception as e:
        fail(parser, _unlistable(args.dir, e))
    if getattr(args, "json", False):
        print_json({"dir": args.dir, "checkpoints": rows, "warnings": notes, "other_directories": 0})
        return 0
    if rows:
        out = [["STEP", "NAME", "STATE", "WORLD", "SIZE", "TRACKER", "NOTE"]]
        out += [["-" if r["step"] is None else str(r["step"]), r["name"], r["state"],
                 "-" if r["world_size"] is None else str(r["world_size"]), human_bytes(r["bytes"]),
                 ",".join(r["trackers"]), r["note"]] for r in rows]
        print(table(out))
    else:
        print(f"no checkpoints under {args.dir}")
    for n in notes:
        print(f"warning: {n}")
    return 0



def _unlistable(url: str, e: BaseException) -> str:
    """The message of a store that cannot be listed: the cause, then what to check (as the API's probe says); a
    :class:`RemoteStorageError` (a missing bucket) already names both."""
    if isinstance(e, RemoteStorageError):
        return str(e)
    return (f"{url}: cannot be listed: {type(e).__name__}: {str(e)[:300]}; check the URL, the endpoint "
            "(AWS_ENDPOINT_URL for an S3-compatible server), the network and the credentials")

def verify_remote(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``snapckpt verify URL [STEP]``: every object of every committed checkpoint (or of STEP) streamed back
    and checked against its manifest record; the same output and exit codes as ``verify DIR`` (1 on any
    damage, 2 when the store cannot be used or nothing is committed)."""
    store = _store(parser, args.dir)
    problems_all: List[str] = []
    try:
        committed = store.list_committed(problems_all)
    except Exception as e:
        fail(parser, _unlistable(args.dir, e))
    if args.step is not None:
        committed = [c for c in committed if c.step == args.step]
        problems_all = []
        if not committed:
            fail(parser, f"no committed checkpoint of step {args.step} under {args.dir}")
    elif not committed and not problems_all:
        fail(parser, f"no committed checkpoint under {args.dir} (see `snapckpt ls {args.dir}`)")

    def check(dirname: str, manifest: Dict[str, Any]) -> List[str]:
        problems = []
        for name, rec in sorted(manifest["files"].items()):
            try:
                store.verify_object(dirname, name, rec)
            except CheckpointCorruptError as e:
                problems.append(str(e))
            except OSError as e:
                problems.append(f"{store.display(dirname, name)} cannot be read: {type(e).__name__}: {e}")
        return problems

    def problems_of(c) -> Optional[List[str]]:
        m = c.manifest
        for _ in range(3):  # the job saving there may retire the prefix or upload the step again meanwhile
            problems = check(c.dirname, m)
            if not problems:
                return problems
            store.fs.invalidate_cache()  # the listing's sizes and ETags: an object uploaded again reads as expired
            try:
                now = parse_manifest(store.read_bytes(f"{store.url}/{c.dirname}/{MANIFEST}"), c.dirname)
            except FileNotFoundError:
                return None  # its manifest went first: retired (or being uploaded again), not damaged
            except Exception:
                return problems
            if [now.get("run_id"), now.get("created_unix")] == [m.get("run_id"), m.get("created_unix")]:
                return problems
            m = now  # uploaded again since the listing: check the copy now committed
        return problems

    return report_verified(args.dir, getattr(args, "json", False), problems_all, committed, problems_of)
