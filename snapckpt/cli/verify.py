"""``snapckpt verify DIR [STEP]``: re-checksum every file of every committed checkpoint (or of STEP).

Lists the committed checkpoints with :func:`snapckpt.ondisk.manifest.list_committed` (without the quick
size check, so that every damaged file is named here), then checks each file's size and checksum against
its manifest record, one file at a time (:func:`~snapckpt.ondisk.manifest.check_checksums`), through
:func:`snapckpt.storage.factory.open_storage`. Prints ``OK``/``DAMAGED`` per checkpoint; exit 1 on any
damage. A checkpoint whose directory vanishes while it is checked (retention of the job saving there) is
skipped with a note: it is gone, not damaged; one committed again meanwhile (a save after a rewind swapped a new
copy in) is checked again as it now is, its new copy against its own manifest (never a false "damaged").

``--json`` prints one object instead: ``{"dir": DIR as given, "checkpoints": [{"name" (the directory's
name, or the path of a manifest that does not parse), "step" (int or null), "state" ("intact" or
"damaged"), "files" (int), "bytes" (int, as the manifest records), "problems" ([str], one per damaged
file)}], "intact": int, "damaged": int}``; the exit codes are the same.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

from snapckpt.cli.common import bad_records, bar, checkpoint_dir, did_you_mean, fail, report_verified
from snapckpt.errors import CheckpointCorruptError
from snapckpt.ondisk.layout import STEP_DIR_PATTERN
from snapckpt.ondisk.manifest import MANIFEST, Committed, check_checksums, list_committed, parse_manifest
from snapckpt.storage.base import StorageReader
from snapckpt.storage.factory import open_storage
from snapckpt.storage.urls import is_remote_url

__all__ = ["cmd_verify"]


def _verify_one(args: argparse.Namespace, reader: StorageReader, c) -> List[str]:
    """Problems of one committed checkpoint, one per damaged file (empty when intact)."""
    files = c.manifest["files"]
    bad = bad_records(c.manifest)
    if bad:
        return [f"{c.path}: {bad}"]
    progress = bar(args, sum(int(r["nbytes"]) for r in files.values()), f"verify {c.dirname}")
    problems = []
    try:
        for name, rec in sorted(files.items()):
            try:  # one file at a time, so that every damaged file is named
                check_checksums(reader, c.path, {"files": {name: rec}}, progress=progress.update)
            except CheckpointCorruptError as e:
                problems.append(str(e))
            except OSError as e:
                problems.append(f"{os.path.join(c.path, name)} cannot be read: {e}")
    finally:
        progress.close()
    return problems


def cmd_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Verify the committed checkpoints of ``args.dir`` (only ``args.step`` when given).

    Returns 0 when every one is intact, 1 when any is damaged (a manifest that does not parse counts).
    A usage error (no such directory, no committed checkpoint, none of ``args.step``) exits 2.
    """
    if is_remote_url(args.dir):  # an object store (remote-only mode, or a remote tier)
        from snapckpt.cli.remote import verify_remote
        return verify_remote(args, parser)
    d = checkpoint_dir(parser, args.dir)
    reader = open_storage()
    bad_manifests: List[str] = []
    committed = list_committed(reader, d, quick_check=False, problems=bad_manifests,
                               name_pattern=STEP_DIR_PATTERN)
    if args.step is not None:
        chosen = [c for c in committed if c.step == args.step]
        if not chosen:
            fail(parser, f"no committed checkpoint of step {args.step} in {d} (committed steps: "
                         f"{sorted({c.step for c in committed}) or 'none'})")
        bad_manifests = []
    else:
        chosen = committed
        if not chosen and not bad_manifests:
            fail(parser, f"no committed checkpoint in {d}{did_you_mean(d)} (see `snapckpt ls {d}`)")

    def problems_of(c) -> Optional[List[str]]:
        for _ in range(3):  # a step committed again while it is checked: check the copy now in place
            problems = _verify_one(args, reader, c)
            if problems and not os.path.isdir(c.path):
                return None  # retired meanwhile
            now = _recommitted(reader, c) if problems else None
            if now is None:
                return problems
            c = now
        return problems

    return report_verified(args.dir, getattr(args, "json", False), bad_manifests, chosen, problems_of)


def _recommitted(reader: StorageReader, c: Committed) -> Optional[Committed]:
    """The copy of ``c``'s directory committed since ``c`` was listed (another run id or commit time in its
    manifest: the job saving there saved the step again), or ``None`` when it is still ``c``'s commit or its
    manifest cannot be read (then ``c``'s problems stand)."""
    try:
        m = parse_manifest(reader.read_bytes(os.path.join(c.path, MANIFEST)), c.dirname)
    except Exception:
        return None
    ident = [(x.get("run_id"), x.get("created_unix")) for x in (m, c.manifest)]
    return None if ident[0] == ident[1] or m.get("step") != c.step else Committed(c.step, c.dirname, c.path, m)
