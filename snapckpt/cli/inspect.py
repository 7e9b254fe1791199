"""``snapckpt inspect DIR STEP [--rank R] [--trust]``: the keys, shapes, dtypes and bytes of every rank file
of a committed step.

Each file is first size-checked against its manifest record (:mod:`snapckpt.ondisk.manifest`), then
listed by kind: a ``torch.save`` archive is loaded with ``torch.load(weights_only=True, mmap=True)`` (no
tensor data read, no pickled code run; ``--trust`` loads with ``weights_only=False``) and its nested
containers flattened to dotted keys (:func:`flatten`); a ``.safetensors`` file is listed from its header;
other formats (DCP ``.distcp`` shards, JSON) are named only. Manifests and sizes are read through
:func:`snapckpt.storage.factory.open_storage`; torch and safetensors are imported only when a file needs
them.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import zipfile
from typing import Any, Dict, Iterator, List, Optional, Tuple

from snapckpt.cli.common import bad_records, bar, checkpoint_dir, table
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
    print(table(rows, indent="    "))
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
    progress = bar(args, nbytes, f"load {os.path.basename(path)}")
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
        progress.close()
    storages: Dict[Tuple[int, int], str] = {}
    rows = [["KEY", "SHAPE", "DTYPE", "BYTES", "NOTE"]]
    rows += [_describe(k, v, storages) for k, v in flatten(obj)]
    print(table(rows, indent="    "))
    tensor_bytes = sum(int(r[3]) for r in rows[1:] if r[3] != "-" and not r[4].startswith("shares"))
    print(f"    {len(rows) - 1} keys, {tensor_bytes} bytes of tensor data")
    return None, None


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
        bad = bad_records(c.manifest)
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
