"""The ``snapckpt`` command line: look at a checkpoint directory without a training job.

Commands (``DIR`` is the checkpoint directory given to the ``Checkpointer``, the one holding
``step_00000100/`` and ``latest``)::

    snapckpt ls DIR                     one row per checkpoint directory: step, name, state, world size,
                                        total bytes, and which one a tracker file names
    snapckpt verify DIR [STEP]          re-checksum every file of every committed checkpoint (or of STEP)
                                        against its manifest; OK/DAMAGED per checkpoint, naming each bad
                                        file and why
    snapckpt inspect DIR STEP [--trust] every rank file of STEP: flattened keys (``model.layer.weight``),
              [--rank R]                shapes, dtypes, bytes of each ``torch.save`` archive, and the
                                        tensors of each ``.safetensors`` file (from its header); other
                                        formats (DCP ``.distcp`` shards, JSON) are listed, not opened

States shown by ``ls``:

- ``committed``: the manifest parses and every file it lists has the recorded size (a loader picks it);
- ``incomplete``: a hidden in-flight directory ``.NAME.partial-RUN`` (a save in progress, or one that
  crashed); loaders never look at it, the next persister of the job removes it;
- ``damaged``: a ``.snapckpt`` sidecar (or a ``step_NNNNNNNN`` directory) whose manifest is missing,
  unparseable or lacks fields, or a file that is missing or of the wrong size (loaders skip it, with a
  warning). ``verify`` counts each as damaged, and also catches flipped bytes.

Other directories without a ``.snapckpt`` sidecar are not snapckpt's and are only counted.

Exit codes: 0 success (``verify``: every checkpoint intact); 1 ``verify`` found damage, or ``inspect``
could not read a file (damaged, or refused by ``weights_only=True``: the usual case for DeepSpeed, Trainer
and Megatron checkpoints, which pickle config objects; ``--trust`` if you trust them); 2 usage error (no
such DIR, DIR is a file, no committed checkpoint of STEP, no files of rank R, bad arguments).

``inspect`` loads with ``torch.load(..., weights_only=True, mmap=True)``: tensor data is not read, and
no pickled code runs. A file holding other Python objects (an ``argparse.Namespace``, a config class) is
refused; ``--trust`` loads it with ``weights_only=False``, which runs its pickle and can execute
arbitrary code: pass it only for checkpoints you trust.

Progress bars (``tqdm`` when installed: ``pip install snapckpt[cli]``) go to stderr, shown when stderr
is a terminal or with ``--progress``; ``--no-progress`` turns them off. The CLI needs the core only; it
never imports a training framework.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapckpt.errors import CheckpointCorruptError
from snapckpt.ondisk.layout import STEP_DIR_PATTERN, TRACKER
from snapckpt._internal.progress import byte_bar
from snapckpt.ondisk.manifest import (MANIFEST, SIDECAR, check_checksums, check_sizes, list_committed, parse_manifest,
                       record_checksum)
from snapckpt.storage.base import StorageReader
from snapckpt.storage.factory import open_storage

__all__ = ["main"]

TRACKERS = (TRACKER, "latest_checkpointed_iteration.txt")
_PARTIAL = ".partial-"


# --------------------------------------------------------------------------------------- helpers
def _bar(args: argparse.Namespace, total: int, desc: str):
    """A byte progress bar on stderr (tqdm), or a no-op one when disabled or tqdm is missing."""
    return byte_bar(total, desc, args.progress)


def _table(rows: List[List[str]], indent: str = "") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _dir_bytes(path: str) -> int:
    """Bytes of the files under ``path``, the sidecar excluded."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != SIDECAR]
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _bad_records(manifest: Dict[str, Any]) -> Optional[str]:
    """Why the manifest's per-file records are unusable (``None`` when each has ``nbytes`` and a checksum)."""
    for name, rec in manifest["files"].items():
        if not (isinstance(rec, dict) and isinstance(rec.get("nbytes"), int) and record_checksum(rec) is not None):
            return f"manifest record of {name!r} is malformed: {rec!r}"
    return None


def _checkpoint_dir(parser: argparse.ArgumentParser, d: str) -> str:
    if not os.path.isdir(d):
        parser.error(f"{d}: {'not a directory' if os.path.exists(d) else 'no such directory'} (pass the "
                     "checkpoint directory: the one that holds the step directories and the tracker file)")
    if os.path.exists(os.path.join(d, MANIFEST)):
        parser.error(f"{d} is one checkpoint, not a checkpoint directory: pass its parent "
                     f"{os.path.dirname(os.path.abspath(d))}")
    return d


# -------------------------------------------------------------------------------------------- ls
@dataclass
class Row:
    """One checkpoint directory as ``ls`` shows it."""

    name: str
    state: str
    step: Optional[int] = None
    world_size: Optional[int] = None
    nbytes: int = 0
    note: str = ""


def _partial_row(path: str, name: str) -> Row:
    dirname, _, run_id = name[1:].rpartition(_PARTIAL)
    row = Row(dirname, "incomplete", nbytes=_dir_bytes(path))
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
    row = Row(name, "damaged", nbytes=_dir_bytes(path))
    try:
        m = parse_manifest(reader.read_bytes(os.path.join(path, MANIFEST)), name)
    except FileNotFoundError:
        row.note = f"{MANIFEST} is missing"
        return row
    except (OSError, CheckpointCorruptError) as e:
        row.note = str(e)
        return row
    row.step, row.world_size = m["step"], m["world_size"]
    row.note = _bad_records(m) or ""
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


def scan(d: str) -> Tuple[List[Row], int]:
    """Every checkpoint directory in ``d`` (sorted by step, then name) and how many others were seen."""
    reader = open_storage()
    rows, others = [], 0
    for name in reader.listdir(d):
        path = os.path.join(d, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(".") and _PARTIAL in name:
            rows.append(_partial_row(path, name))
        elif not name.startswith(".") and (os.path.isdir(os.path.join(path, SIDECAR))
                                           or STEP_DIR_PATTERN.fullmatch(name)):
            rows.append(_committed_row(reader, path, name))
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
    d = _checkpoint_dir(parser, args.dir)
    rows, others = scan(d)
    named, notes = _trackers(d, rows)
    if rows:
        table = [["STEP", "NAME", "STATE", "WORLD", "BYTES", "TRACKER", "NOTE"]]
        for i, r in enumerate(rows):
            table.append(["-" if r.step is None else str(r.step), r.name, r.state,
                          "-" if r.world_size is None else str(r.world_size), str(r.nbytes),
                          ",".join(named.get(i, [])), r.note])
        print(_table(table))
    else:
        print(f"no checkpoint directories in {d}")
    for n in notes:
        print(f"warning: {n}")
    if others:
        print(f"({others} other director{'y' if others == 1 else 'ies'} without a {SIDECAR} sidecar not listed)")
    return 0


# ---------------------------------------------------------------------------------------- verify
def _verify_one(args: argparse.Namespace, reader: StorageReader, c) -> List[str]:
    """Problems of one committed checkpoint, one per damaged file (empty when intact)."""
    files = c.manifest["files"]
    bad = _bad_records(c.manifest)
    if bad:
        return [f"{c.path}: {bad}"]
    bar = _bar(args, sum(int(r["nbytes"]) for r in files.values()), f"verify {c.dirname}")
    problems = []
    try:
        for name, rec in sorted(files.items()):
            try:  # one file at a time, so that every damaged file is named
                check_checksums(reader, c.path, {"files": {name: rec}}, progress=bar.update)
            except CheckpointCorruptError as e:
                problems.append(str(e))
            except OSError as e:
                problems.append(f"{os.path.join(c.path, name)} cannot be read: {e}")
    finally:
        bar.close()
    return problems


def cmd_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    d = _checkpoint_dir(parser, args.dir)
    reader = open_storage()
    bad_manifests: List[str] = []
    committed = list_committed(reader, d, quick_check=False, problems=bad_manifests,
                               name_pattern=STEP_DIR_PATTERN)
    if args.step is not None:
        chosen = [c for c in committed if c.step == args.step]
        if not chosen:
            parser.error(f"no committed checkpoint of step {args.step} in {d} (committed steps: "
                         f"{sorted({c.step for c in committed}) or 'none'})")
        bad_manifests = []
    else:
        chosen = committed
        if not chosen and not bad_manifests:
            parser.error(f"no committed checkpoint in {d} (see `snapckpt ls {d}`)")
    damaged = len(bad_manifests)
    for p in bad_manifests:
        print(f"DAMAGED  {p}")
    for c in chosen:
        problems = _verify_one(args, reader, c)
        files = c.manifest["files"]
        nbytes = sum(r["nbytes"] for r in files.values() if isinstance(r, dict) and isinstance(r.get("nbytes"), int))
        verdict = "DAMAGED" if problems else "OK"
        print(f"{verdict:<8} step {c.step}  {c.dirname}  ({len(files)} file(s), {nbytes} bytes)")
        for p in problems:
            print(f"    {p}")
        damaged += bool(problems)
    total = len(chosen) + len(bad_manifests)
    print(f"{total} checkpoint(s): {total - damaged} intact, {damaged} damaged")
    return 1 if damaged else 0


# --------------------------------------------------------------------------------------- inspect
def flatten(obj: Any, prefix: str = "", _seen: Optional[set] = None) -> Iterator[Tuple[str, Any]]:
    """``(dotted.key, leaf)`` for every leaf of nested dicts, lists and tuples (empty containers are leaves)."""
    _seen = set() if _seen is None else _seen
    if isinstance(obj, (dict, list, tuple)) and obj and id(obj) not in _seen:
        _seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k), _seen)
        return
    yield prefix or "<root>", obj


def _describe(key: str, leaf: Any, storages: Dict[Tuple[int, int], str]) -> List[str]:
    import torch

    if not isinstance(leaf, torch.Tensor):
        text = repr(leaf)
        return [key, "-", type(leaf).__name__, "-", text if len(text) <= 60 else text[:57] + "..."]
    note = ""
    try:
        st = leaf.untyped_storage()
        if st.nbytes():
            skey = (st.data_ptr(), st.nbytes())
            note = f"shares storage with {storages[skey]}" if skey in storages else ""
            storages.setdefault(skey, key)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        pass
    return [key, str(list(leaf.shape)), str(leaf.dtype).replace("torch.", ""),
            str(leaf.numel() * leaf.element_size()), note]


def _refusal(e: BaseException) -> Optional[str]:
    """The reason if ``e`` is ``torch.load``'s weights_only refusal, else ``None``."""
    text = str(e)
    if not isinstance(e, pickle.UnpicklingError) or "weights_only" not in text.replace(" ", "_").lower():
        return None
    lines = [l.strip() for l in text.splitlines() if "WeightsUnpickler error" in l]
    reason = lines[0].split("error:", 1)[-1].strip() if lines else text.splitlines()[0]
    return reason.split(" Please use", 1)[0]


# bits per element of the safetensors dtype names (the format's specification, huggingface/safetensors)
_SAFETENSORS_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8,
                     "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8}


def _inspect_safetensors(path: str) -> Optional[str]:
    """List a safetensors file's tensors from its header (no pickle); return a problem or ``None``."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            rows = [["KEY", "SHAPE", "DTYPE", "BYTES", "NOTE"]]
            for key in f.keys():
                sl = f.get_slice(key)
                shape, dtype = sl.get_shape(), sl.get_dtype()
                numel = 1
                for n in shape:
                    numel *= n
                size = _SAFETENSORS_BITS.get(dtype)
                rows.append([key, str(list(shape)), dtype, "-" if size is None else str(numel * size // 8), ""])
    except Exception as e:  # noqa: BLE001 - reported per file
        print(f"    cannot read the safetensors header: {type(e).__name__}: {e}")
        return f"{path}: {type(e).__name__}: {e}"
    print(_table(rows, indent="    "))
    print(f"    {len(rows) - 1} tensors (safetensors)")
    return None


def _inspect_file(args: argparse.Namespace, path: str, nbytes: int,
                  kind: Optional[str] = None) -> Tuple[Optional[str], Optional[str]]:
    """Print one file's listing; return ``(problem, refusal reason)`` (both ``None`` when it loaded).

    ``kind`` is the manifest record's (``"torch"``: a ``torch.save`` archive; ``"bytes"``: any other format,
    listed only when it is a safetensors file). Other formats (DCP ``.distcp`` shards, JSON) are not
    inspected; ``verify`` checks their checksums.
    """
    import torch

    if path.endswith(".safetensors"):
        return _inspect_safetensors(path), None
    if kind not in (None, "torch") or not zipfile.is_zipfile(path):
        print("    (not a torch.save archive: not inspected; `snapckpt verify` checks its checksum)")
        return None, None
    bar = _bar(args, nbytes, f"load {os.path.basename(path)}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not args.trust, mmap=True)
    except Exception as e:  # noqa: BLE001 - reported per file, the others are still listed
        reason = None if args.trust else _refusal(e)
        if reason is not None:
            print(f"    refused by torch.load(weights_only=True): {reason}")
            return None, reason
        print(f"    cannot load: {type(e).__name__}: {e}")
        return f"{path}: {type(e).__name__}: {e}", None
    finally:
        bar.close()
    storages: Dict[Tuple[int, int], str] = {}
    rows = [["KEY", "SHAPE", "DTYPE", "BYTES", "NOTE"]]
    rows += [_describe(k, v, storages) for k, v in flatten(obj)]
    print(_table(rows, indent="    "))
    tensor_bytes = sum(int(r[3]) for r in rows[1:] if r[3] != "-" and not r[4].startswith("shares"))
    print(f"    {len(rows) - 1} keys, {tensor_bytes} bytes of tensor data")
    return None, None


def cmd_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    d = _checkpoint_dir(parser, args.dir)
    reader = open_storage()
    chosen = [c for c in list_committed(reader, d, quick_check=False) if c.step == args.step]
    if not chosen:
        committed = sorted({c.step for c in list_committed(reader, d, quick_check=False)})
        parser.error(f"no committed checkpoint of step {args.step} in {d} (committed steps: "
                     f"{committed or 'none'})")
    if args.trust:
        print("note: --trust: loading with weights_only=False (runs the files' pickles)", file=sys.stderr)
    ranks = sorted({r.get("rank") for c in chosen for r in c.manifest["files"].values() if isinstance(r, dict)},
                   key=str)
    if args.rank is not None and args.rank not in ranks:
        parser.error(f"step {args.step} in {d} has no files of rank {args.rank} (its ranks: "
                     f"{', '.join(map(str, ranks)) or 'none'})")
    problems, refused = [], []
    for c in chosen:
        print(f"{c.dirname}: step {c.step}, world size {c.manifest['world_size']}")
        bad = _bad_records(c.manifest)
        if bad:
            print(f"  damaged: {bad}")
            problems.append(bad)
            continue
        for name, rec in sorted(c.manifest["files"].items(), key=lambda kv: (kv[1].get("rank", 0), kv[0])):
            if args.rank is not None and rec.get("rank") != args.rank:
                continue
            print(f"  rank {rec.get('rank')}  {name}  {rec['nbytes']} bytes")
            try:
                check_sizes(reader, c.path, {"files": {name: rec}})
            except CheckpointCorruptError as e:
                print(f"    damaged: {e}")
                problems.append(str(e))
                continue
            problem, reason = _inspect_file(args, os.path.join(c.path, name), int(rec["nbytes"]), rec.get("kind"))
            problems += [problem] if problem else []
            refused += [name] if reason else []
    if refused:
        print(f"snapckpt: {len(refused)} file(s) hold pickled Python objects beyond tensors and plain "
              f"containers, which torch.load(weights_only=True) refuses ({', '.join(refused)}). Loading them "
              "with weights_only=False runs their pickle and can execute arbitrary code. If you trust this "
              f"checkpoint, rerun with --trust: snapckpt inspect {args.dir} {args.step} --trust",
              file=sys.stderr)
    if problems:
        print(f"snapckpt: {len(problems)} file(s) could not be read; run `snapckpt verify {args.dir} "
              f"{args.step}` for checksums", file=sys.stderr)
    return 1 if problems or refused else 0


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``snapckpt`` (subcommands ``ls``, ``verify``, ``inspect``)."""
    p = argparse.ArgumentParser(
        prog="snapckpt", description="Inspect and verify snapckpt checkpoint directories.",
        epilog="exit codes: 0 ok, 1 damage found or a file could not be read, 2 usage error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                          help="show progress bars on stderr (default: only when stderr is a terminal)")

    ls = sub.add_parser("ls", help="list the checkpoints in DIR and their state",
                        description="One row per checkpoint directory in DIR: step, name, state (committed, "
                                    "incomplete, damaged), world size, total bytes, and the tracker file "
                                    "(latest) that names it.")
    ls.add_argument("dir", metavar="DIR", help="checkpoint directory (the one given to the Checkpointer)")
    ls.set_defaults(func=cmd_ls, parser=ls, progress=None)

    verify = sub.add_parser("verify", parents=[progress], help="re-checksum committed checkpoints",
                            description="Re-read every file of every committed checkpoint in DIR (or only "
                                        "STEP) and compare its size and checksum with the manifest. Exit 0 "
                                        "when all are intact, 1 on any damage, 2 on a usage error.")
    verify.add_argument("dir", metavar="DIR", help="checkpoint directory")
    verify.add_argument("step", metavar="STEP", type=int, nargs="?", help="verify only this step")
    verify.set_defaults(func=cmd_verify, parser=verify)

    insp = sub.add_parser("inspect", parents=[progress], help="list the keys, shapes and dtypes of a step",
                          description="For every rank file of committed step STEP, list its flattened keys, "
                                      "shapes, dtypes and bytes. Loads with torch.load(weights_only=True).")
    insp.add_argument("dir", metavar="DIR", help="checkpoint directory")
    insp.add_argument("step", metavar="STEP", type=int, help="the step to inspect")
    insp.add_argument("--rank", type=int, default=None, help="only this rank's files")
    insp.add_argument("--trust", action="store_true",
                      help="load with weights_only=False: runs the files' pickles, which can execute "
                           "arbitrary code; only for checkpoints you trust")
    insp.set_defaults(func=cmd_inspect, parser=insp)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``snapckpt`` console script and ``python -m snapckpt``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args, args.parser)
    except BrokenPipeError:  # `snapckpt ls DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
