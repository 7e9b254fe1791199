"""``snapckpt inspect DIR STEP [--rank R] [--trust]``: the keys, shapes, dtypes and bytes of every rank file
of a committed step.

Each file is first size-checked against its manifest record (:mod:`snapckpt.ondisk.manifest`), then
listed by kind: a ``torch.save`` archive is loaded with ``torch.load(weights_only=True, mmap=True)`` (no
tensor data read, no pickled code run; ``--trust`` loads with ``weights_only=False``) and its nested
containers flattened to dotted keys (:func:`flatten`); a ``.safetensors`` file is listed from its header;
other formats (DCP ``.distcp`` shards, JSON) are named only. Manifests and sizes are read through
:func:`snapckpt.storage.factory.open_storage`; torch and safetensors are imported only when a file needs
them.

``--json`` prints one object instead of the listing: ``{"dir", "step", "checkpoints": [{"name", "step",
"world_size", "problem" (str or null: the manifest's records are unusable, or the directory was deleted or
renamed while it was inspected, by retention of the job saving there: gone, not damaged), "files": [{"name", "rank",
"bytes", "kind" ("torch", "safetensors", "other" or null when not opened), "status" ("ok", "damaged",
"unreadable", "refused" by weights_only, "not inspected"), "error" (str or null), "keys": [{"key",
"type" ("Tensor" or the Python type's name), "shape" (list or null), "dtype" (str or null), "bytes" (int
or null), "shares_storage_with" (the key whose storage it shares, or null), "value" (repr of a
non-tensor, or null)}]}]}], "problems": [str], "refused": [file names]}``; the exit codes are the same.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapckpt.cli.common import bad_records, bar, checkpoint_dir, fail, human_bytes, print_json, table
from snapckpt.errors import CheckpointCorruptError
from snapckpt.ondisk.manifest import check_sizes, list_committed
from snapckpt.storage.factory import open_storage

__all__ = ["flatten", "cmd_inspect"]


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


def _describe(key: str, leaf: Any, storages: Dict[Tuple[int, int], str]) -> Dict[str, Any]:
    """One key's record (see the module docstring's ``--json`` schema)."""
    import torch

    if not isinstance(leaf, torch.Tensor):
        text = repr(leaf)
        return {"key": key, "type": type(leaf).__name__, "shape": None, "dtype": None, "bytes": None,
                "shares_storage_with": None, "value": text if len(text) <= 60 else text[:57] + "..."}
    shares = None
    try:
        st = leaf.untyped_storage()
        if st.nbytes():
            skey = (st.data_ptr(), st.nbytes())
            shares = storages.get(skey)
            storages.setdefault(skey, key)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        pass
    return {"key": key, "type": "Tensor", "shape": list(leaf.shape), "dtype": str(leaf.dtype).replace("torch.", ""),
            "bytes": leaf.numel() * leaf.element_size(), "shares_storage_with": shares, "value": None}


def _print_keys(keys: List[Dict[str, Any]], what: str) -> None:
    rows = [["KEY", "SHAPE", "DTYPE", "SIZE", "NOTE"]]
    for k in keys:
        note = (f"shares storage with {k['shares_storage_with']}" if k["shares_storage_with"]
                else k["value"] if k["value"] is not None else "")
        rows.append([k["key"], "-" if k["shape"] is None else str(k["shape"]), k["dtype"] or k["type"],
                     human_bytes(k["bytes"]), note])
    print(table(rows, indent="    "))
    tensor_bytes = sum(k["bytes"] or 0 for k in keys if not k["shares_storage_with"])
    print(f"    {len(keys)} {what}, {human_bytes(tensor_bytes)} of tensor data ({tensor_bytes} bytes)")


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


def _inspect_safetensors(path: str, rec: Dict[str, Any]) -> None:
    """Fill ``rec`` with a safetensors file's tensors, read from its header (no pickle)."""
    from safetensors import safe_open

    rec["kind"] = "safetensors"
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, dtype = sl.get_shape(), sl.get_dtype()
                numel = 1
                for n in shape:
                    numel *= n
                size = _SAFETENSORS_BITS.get(dtype)
                rec["keys"].append({"key": key, "type": "Tensor", "shape": list(shape), "dtype": dtype,
                                    "bytes": None if size is None else numel * size // 8,
                                    "shares_storage_with": None, "value": None})
    except Exception as e:  # noqa: BLE001 - reported per file
        rec["status"], rec["error"] = "unreadable", f"cannot read the safetensors header: {type(e).__name__}: {e}"


def _is_torch_archive(path: str) -> bool:
    """Whether a file recorded as raw bytes is itself a ``torch.save`` archive (the Trainer's ``scheduler.pt``,
    ``rng_state_*.pth`` and ``training_args.bin``, which the Hugging Face callback hands over as bytes): one zip
    from the file's first byte to its last (the archive the end record describes starts at offset 0) with a
    ``<name>/data.pkl`` entry. A DCP ``.distcp`` shard, a run of ``torch.save`` records and raw tensor data whose
    end record describes its last record only, is not one."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            # zipfile shifts every offset by the bytes found before the archive: 0 only for a whole-file zip
            return (bool(infos) and min(i.header_offset for i in infos) == 0
                    and any(i.filename.count("/") == 1 and i.filename.endswith("/data.pkl") for i in infos))
    except (OSError, zipfile.BadZipFile):
        return False


def _inspect_file(args: argparse.Namespace, path: str, rec: Dict[str, Any], kind: Optional[str] = None) -> None:
    """Fill the file record ``rec`` (``status`` "ok", "unreadable", "refused" or "not inspected", its
    ``keys``) from the file at ``path``.

    ``kind`` is the manifest record's (``"torch"``: a ``torch.save`` archive; ``"bytes"``: any other format,
    listed only when it is a safetensors file or itself a ``torch.save`` archive, :func:`_is_torch_archive`).
    Other formats (DCP ``.distcp`` shards, JSON) are not inspected; ``verify`` checks their checksums.
    """
    import torch

    if path.endswith(".safetensors"):
        _inspect_safetensors(path, rec)
        return
    if not (zipfile.is_zipfile(path) if kind in (None, "torch") else _is_torch_archive(path)):
        rec["kind"], rec["status"] = "other", "not inspected"
        return
    rec["kind"] = "torch"
    progress = bar(args, int(rec["bytes"]), f"load {os.path.basename(path)}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not args.trust, mmap=True)
    except Exception as e:  # noqa: BLE001 - reported per file, the others are still listed
        reason = None if args.trust else _refusal(e)
        if reason is not None:
            rec["status"], rec["error"] = "refused", reason
        else:
            rec["status"], rec["error"] = "unreadable", f"cannot load: {type(e).__name__}: {e}"
        return
    finally:
        progress.close()
    storages: Dict[Tuple[int, int], str] = {}
    rec["keys"] = [_describe(k, v, storages) for k, v in flatten(obj)]


def _print_file(rec: Dict[str, Any]) -> None:
    print(f"  rank {rec['rank']}  {rec['name']}  {human_bytes(rec['bytes'])}")
    status = rec["status"]
    if status == "damaged":
        print(f"    damaged: {rec['error']}")
    elif status == "refused":
        print(f"    refused by torch.load(weights_only=True): {rec['error']}")
    elif status == "unreadable":
        print(f"    {rec['error']}")
    elif status == "not inspected":
        print("    (not a torch.save archive: not inspected; `snapckpt verify` checks its checksum)")
    elif rec["kind"] == "safetensors":
        _print_keys(rec["keys"], "tensors (safetensors)")
    else:
        _print_keys(rec["keys"], "keys")


def cmd_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """List every file of committed step ``args.step`` in ``args.dir`` (only rank ``args.rank``'s when given).

    Returns 0 when every file was listed, 1 when one is damaged, cannot be read, or holds pickled objects
    that ``weights_only=True`` refuses (then the ``--trust`` hint goes to stderr). A usage error (no such
    directory, no committed checkpoint of the step, no files of the rank) exits 2.
    """
    d = checkpoint_dir(parser, args.dir)
    reader = open_storage()
    chosen = [c for c in list_committed(reader, d, quick_check=False) if c.step == args.step]
    if not chosen:
        committed = sorted({c.step for c in list_committed(reader, d, quick_check=False)})
        fail(parser, f"no committed checkpoint of step {args.step} in {d} (committed steps: "
                     f"{committed or 'none'})")
    if args.trust:
        print("note: --trust: loading with weights_only=False (runs the files' pickles)", file=sys.stderr)
    ranks = sorted({r.get("rank") for c in chosen for r in c.manifest["files"].values() if isinstance(r, dict)},
                   key=str)
    if args.rank is not None and args.rank not in ranks:
        fail(parser, f"step {args.step} in {d} has no files of rank {args.rank} (its ranks: "
                     f"{', '.join(map(str, ranks)) or 'none'})")
    as_json = getattr(args, "json", False)
    problems, refused, out, gone = [], [], [], []
    for c in chosen:
        entry: Dict[str, Any] = {"name": c.dirname, "step": c.step, "world_size": c.manifest["world_size"],
                                 "problem": None, "files": []}
        out.append(entry)
        if not as_json:
            print(f"{c.dirname}: step {c.step}, world size {c.manifest['world_size']}")
        bad = bad_records(c.manifest)
        if bad:
            entry["problem"] = bad
            if not as_json:
                print(f"  damaged: {bad}")
            problems.append(bad)
            continue
        for name, rec in sorted(c.manifest["files"].items(), key=lambda kv: (kv[1].get("rank", 0), kv[0])):
            if args.rank is not None and rec.get("rank") != args.rank:
                continue
            frec: Dict[str, Any] = {"name": name, "rank": rec.get("rank"), "bytes": int(rec["nbytes"]),
                                    "kind": None, "status": "ok", "error": None, "keys": []}
            entry["files"].append(frec)
            try:
                check_sizes(reader, c.path, {"files": {name: rec}})
            except CheckpointCorruptError as e:
                frec["status"], frec["error"] = "damaged", str(e)
            else:
                _inspect_file(args, os.path.join(c.path, name), frec, rec.get("kind"))
            if frec["status"] in ("damaged", "unreadable") and not os.path.isdir(c.path):
                # retired meanwhile (retention renames it away): gone, not damaged
                entry["files"].pop()
                entry["problem"] = (f"{c.path} was deleted or renamed while it was inspected (retention of the "
                                    "job saving there, or by hand)")
                problems.append(entry["problem"])
                gone.append(entry["problem"])
                if not as_json:
                    print(f"  {entry['problem']}")
                break
            if frec["status"] in ("damaged", "unreadable"):
                problems.append(f"{os.path.join(c.path, name)}: {frec['error']}")
            refused += [name] if frec["status"] == "refused" else []
            if not as_json:
                _print_file(frec)
    if as_json:
        print_json({"dir": args.dir, "step": args.step, "checkpoints": out, "problems": problems,
                    "refused": refused})
    if refused:
        print(f"snapckpt: {len(refused)} file(s) hold pickled Python objects beyond tensors and plain "
              f"containers, which torch.load(weights_only=True) refuses ({', '.join(refused)}). Loading them "
              "with weights_only=False runs their pickle and can execute arbitrary code. If you trust this "
              f"checkpoint, rerun with --trust: snapckpt inspect {args.dir} {args.step} --trust",
              file=sys.stderr)
    if gone:
        print(f"snapckpt: step {args.step} is gone from {args.dir}: {'; '.join(gone)}", file=sys.stderr)
    elif problems:
        print(f"snapckpt: {len(problems)} file(s) could not be read; run `snapckpt verify {args.dir} "
              f"{args.step}` for checksums", file=sys.stderr)
    return 1 if problems or refused else 0
