"""The sidecar manifest: what a committed checkpoint holds, and how to tell it is whole.

Layout inside a checkpoint directory (native files beside it are untouched; native loaders ignore it)::

    <checkpoint_dir>/<dirname>/.snapckpt/manifest.json    the commit record (written before the rename)
    <checkpoint_dir>/.<dirname>.partial-<run_id>/          a save in flight: never read by a loader
        .snapckpt/part_00001.json                           rank 1's part is complete (sizes, checksums)
        .snapckpt/fail_00001.json                           rank 1's part failed (error record)

``manifest.json`` (JSON, ``format_version`` 1)::

    {"format": "snapckpt", "format_version": 1, "step": 100, "dirname": "step_00000100",
     "world_size": 2, "run_id": "...", "created_unix": 1.7e9, "checksum": "xxh3_64",
     "files": {"rank_00000.pt": {"rank": 0, "nbytes": 123, "xxh3_64": "0123456789abcdef", "kind": "torch"},
               ...}}

``kind`` is ``"torch"`` (a ``torch.save`` archive) or ``"bytes"`` (written from raw chunks: safetensors,
JSON...); a manifest without it means ``"torch"``.
``mode`` (optional, an int): the file's permission bits when its spec set them (``0o600`` for safetensors,
as ``safetensors.torch.save_file``); without it the file has the default mode (``0o666`` less the umask).

A checkpoint is *committed* when its directory has a manifest that parses and names its own step and
dirname; it is *intact* when every file has the recorded size (quick check) and checksum (full check).
The checksum is XXH3-64 (the ``xxhash`` package, https://xxhash.com) of the whole file, as 16 hex digits
under the per-file key ``"xxh3_64"``: about 10 GB/s on one core, against 2 GB/s for ``zlib.crc32``, so
checksumming costs the persister and the loader little CPU beside the I/O. Manifests written before it hold
``"crc32"`` (CRC-32 of the whole file, 8 hex digits) instead; both are verified (:data:`CHECKSUMS`).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import xxhash

from snapckpt.errors import CheckpointCorruptError, CommitError
from snapckpt.storage.base import StorageReader

__all__ = ["FORMAT_VERSION", "SIDECAR", "MANIFEST", "Committed", "build_manifest", "parse_manifest",
           "list_committed", "check_sizes", "check_checksums", "crc32_file", "record_checksum", "validate_dirname",
           "validate_file_name", "partial_dirname", "part_marker_name", "fail_marker_name", "ChecksumWriter",
           "CHECKSUM", "CHECKSUMS", "file_checksum", "file_set_changes", "present_files", "save_order",
           "tracker_named"]

FORMAT_VERSION = 1
SIDECAR = ".snapckpt"
MANIFEST = f"{SIDECAR}/manifest.json"
_CHUNK = 8 << 20


class _Crc32:
    """``hashlib``-style wrapper of ``zlib.crc32`` (manifests written before XXH3-64)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc & 0xFFFFFFFF:08x}"


#: The checksum new manifests record, and every checksum a manifest may hold: per-file key -> hasher.
CHECKSUM = "xxh3_64"
CHECKSUMS = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}


def validate_dirname(name: str, what: str = "checkpoint tag") -> str:
    """Check a checkpoint directory name (a tag): one path component, not hidden, no control chars.

    Spaces, colons, brackets and non-ASCII are fine. ``what`` names the argument in the message (an
    integration names its own, e.g. DeepSpeed's ``tag=``). Raises ``ValueError`` naming the problem and the fix.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {name!r}")
    if "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"{what} {name!r} must be a single directory name inside the checkpoint directory (no "
                         "'/' or '\\', not '.' or '..', not hidden): choose a plain name such as 'global_step100'")
    if any(ord(c) < 32 for c in name) or len(name.encode()) > 200:
        raise ValueError(f"{what} {name!r} has control characters or is over 200 bytes: choose a shorter, "
                         "printable name")
    return name


def validate_file_name(name: Any) -> str:
    """Check the name of a file of a checkpoint (relative to its directory): one path component, several
    joined by ``/`` (a file in a sub-directory, as DeepSpeed's ``global_stepN/`` inside a Trainer's
    ``checkpoint-N/``), or ``.snapckpt/<component>`` for an integration's own sidecar files (which native
    loaders ignore). A component may be hidden, since native layouts use such names (torch DCP's
    ``.metadata``); ``.``, ``..``, ``.snapckpt*`` and the sidecar's own records
    (``manifest.json``, ``part_*``, ``fail_*``) are reserved; no ``\\``, no empty component (a leading,
    doubled or trailing ``/``), no control characters (NUL included).

    Raises ``ValueError`` naming the problem; returns ``name``.
    """
    sidecar = isinstance(name, str) and name.startswith(SIDECAR + "/")
    rest = name[len(SIDECAR) + 1:] if sidecar else name
    parts = rest.split("/") if isinstance(rest, str) else [None]
    if (not isinstance(rest, str) or not rest or "\\" in rest or any(p in ("", ".", "..") for p in parts)
            or (sidecar and (len(parts) > 1 or rest.startswith(".")))
            or (not sidecar and any(p.startswith(SIDECAR) for p in parts))
            or (sidecar and (rest == "manifest.json" or rest.startswith(("part_", "fail_"))))
            or any(ord(c) < 32 for c in rest)):
        raise ValueError(f"file name {name!r} must be one path component, or several joined by '/' (a file "
                         f"in a sub-directory), none of them '.', '..' or '{SIDECAR}*' (or "
                         f"'{SIDECAR}/<name>' for a sidecar file)")
    return name


def partial_dirname(dirname: str, run_id: str) -> str:
    """Name of the in-flight directory of ``dirname`` for run ``run_id`` (hidden: starts with a dot)."""
    return f".{dirname}.partial-{run_id}"


def part_marker_name(rank: int) -> str:
    """Relative path of rank ``rank``'s completion marker inside a partial directory."""
    return f"{SIDECAR}/part_{rank:05d}.json"


def fail_marker_name(rank: int) -> str:
    """Relative path of rank ``rank``'s failure marker inside a partial directory."""
    return f"{SIDECAR}/fail_{rank:05d}.json"


class ChecksumWriter:
    """Wraps a binary file: computes the checksum (:data:`CHECKSUM`) and byte count of everything written
    through it."""

    def __init__(self, fileobj) -> None:
        self.fileobj = fileobj
        self._hash = CHECKSUMS[CHECKSUM]()
        self.nbytes = 0

    def write(self, data) -> int:
        self._hash.update(data)
        n = self.fileobj.write(data)
        self.nbytes += n
        return n

    def write_borrowed(self, data, phase: int) -> int:
        """``write``, for a sink with ``write_borrowed(data, phase)``
        (:meth:`~snapckpt.storage.direct.DirectFile.write_borrowed`: ``data`` must then stay unchanged until the
        file is flushed): in pieces of :data:`_CHUNK` bytes, each handed over before it is hashed, so that the
        checksum runs while the device writes. A sink without it gets ``write``. Returns bytes written."""
        borrow = getattr(self.fileobj, "write_borrowed", None)
        if borrow is None:
            return self.write(data)
        mv = memoryview(data).cast("B")
        for a in range(0, len(mv), _CHUNK):  # _CHUNK is a multiple of a page: each piece has the same phase
            piece = mv[a:a + _CHUNK]
            self.nbytes += borrow(piece, phase)
            self._hash.update(piece)
        return len(mv)

    def flush(self) -> None:
        self.fileobj.flush()

    @property
    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def file_checksum(reader: StorageReader, path: str, algo: str = CHECKSUM, progress=None) -> str:
    """Checksum ``algo`` (a key of :data:`CHECKSUMS`) of a whole file, as hex digits; ``progress(nbytes)``
    is called per 8 MiB chunk if given."""
    h = CHECKSUMS[algo]()
    with reader.open_read(path) as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def crc32_file(reader: StorageReader, path: str, progress=None) -> str:
    """CRC-32 of a whole file, as 8 hex digits (see :func:`file_checksum`)."""
    return file_checksum(reader, path, "crc32", progress)


def record_checksum(rec: Dict[str, Any]) -> "tuple[str, str] | None":
    """``(algo, hex digest)`` of a manifest file record, or ``None`` when it holds no known checksum."""
    for algo in CHECKSUMS:
        if isinstance(rec.get(algo), str):
            return algo, rec[algo]
    return None


def build_manifest(*, step: int, dirname: str, world_size: int, run_id: str,
                   parts: Dict[int, Dict[str, Dict[str, Any]]],
                   requested_unix: Optional[float] = None) -> Dict[str, Any]:
    """Assemble the manifest from every rank's part record ``{rank: {file: {nbytes, xxh3_64, kind}}}``.

    ``requested_unix`` (Unix seconds) is when the save was requested; ``created_unix`` is the commit time.
    Commits of one job run in parallel and can finish out of order, so the save order is the former.

    Raises:
        CommitError: the set of parts is not exactly ranks ``0 .. world_size-1``, or two ranks claim
            one file.
    """
    expected = set(range(world_size))
    got = set(parts)
    if got != expected:
        raise CommitError(f"step {step}: parts from ranks {sorted(got)}, expected exactly "
                          f"{sorted(expected)} (missing {sorted(expected - got)}, unexpected "
                          f"{sorted(got - expected)})")
    files: Dict[str, Dict[str, Any]] = {}
    for rank in sorted(parts):
        for name, rec in parts[rank].items():
            if name in files:
                raise CommitError(f"step {step}: file {name!r} written by ranks {files[name]['rank']} "
                                  f"and {rank}")
            files[name] = {"rank": rank, "nbytes": int(rec["nbytes"]), CHECKSUM: str(rec[CHECKSUM]),
                           "kind": str(rec.get("kind", "torch"))}
            if rec.get("mode") is not None:
                files[name]["mode"] = int(rec["mode"])
    return {"format": "snapckpt", "format_version": FORMAT_VERSION, "step": step, "dirname": dirname,
            "world_size": world_size, "run_id": run_id, "created_unix": time.time(),
            "requested_unix": time.time() if requested_unix is None else requested_unix, "checksum": CHECKSUM,
            "files": files}


def save_order(manifest: Dict[str, Any]) -> float:
    """When the save of ``manifest`` was requested (Unix seconds: ``requested_unix``, else ``created_unix``;
    0.0 when neither is a number): the order of "newer" that retention, the tracker rule and the uploads'
    catch-up follow, local and remote alike (after a rewind a lower step is newer)."""
    value = manifest.get("requested_unix", manifest.get("created_unix", 0.0))
    return float(value) if isinstance(value, (int, float)) else 0.0


def tracker_named(manifests: Iterable[Tuple[str, Dict[str, Any]]],
                  read_tracker: Callable[[str], Optional[str]]) -> Set[str]:
    """The directory names, among ``manifests`` (``(dirname, manifest)`` pairs), whose commit wrote a tracker
    file (the manifest's ``tracker`` record) that still holds what that commit wrote, whitespace stripped as
    the frameworks read it: what a framework's own resume loads (DeepSpeed's ``latest`` after a later
    ``save_latest=False`` save still names the older tag). ``read_tracker(name)`` returns the tracker file's
    text, ``None`` when it cannot be read; each name is read once."""
    wrote: Dict[str, Dict[str, Set[str]]] = {}
    for dirname, m in manifests:
        rec = m.get("tracker")
        if isinstance(rec, dict) and isinstance(rec.get("name"), str) and isinstance(rec.get("content"), str):
            wrote.setdefault(rec["name"], {}).setdefault(rec["content"].strip(), set()).add(dirname)
    named: Set[str] = set()
    for name, by_content in wrote.items():
        text = read_tracker(name)
        if text is not None:
            named |= by_content.get(text.strip(), set())
    return named


def parse_manifest(data: bytes, dirname: Optional[str] = None, source: Optional[str] = None) -> Dict[str, Any]:
    """Parse and check a manifest: JSON only (never a pickle), its schema, and every file record (a file
    name that stays inside the checkpoint directory, :func:`validate_file_name`; an int rank and size, a
    str checksum), so that nothing a loader does with it can reach a path outside the directory.

    Args:
        data: the bytes of ``manifest.json``.
        dirname: the directory it was found in; it must name that directory.
        source: the manifest's path, named in the error.

    Raises:
        CheckpointCorruptError: not a valid snapckpt manifest (the message says why and names ``source``).
    """
    try:
        return _parse_manifest(data, dirname)
    except CheckpointCorruptError as e:
        if source is None:
            raise
        raise CheckpointCorruptError(f"{e} [{source}]") from e


def _parse_manifest(data: bytes, dirname: Optional[str]) -> Dict[str, Any]:
    try:
        m = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"manifest is not valid JSON ({len(data)} bytes): {str(e)[:200]}") from e
    if not isinstance(m, dict) or m.get("format") != "snapckpt":
        raise CheckpointCorruptError("manifest is not a snapckpt manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(f"manifest format_version {m.get('format_version')} is not supported "
                                     f"(this snapckpt reads {FORMAT_VERSION})")
    for key, typ in (("step", int), ("dirname", str), ("world_size", int), ("files", dict)):
        if not isinstance(m.get(key), typ):
            raise CheckpointCorruptError(f"manifest field {key!r} is missing or not {typ.__name__}")
    if dirname is not None and m["dirname"] != dirname:
        raise CheckpointCorruptError(f"manifest names directory {m['dirname']!r}, found in {dirname!r}")
    for name, rec in m["files"].items():
        try:
            validate_file_name(name)
        except ValueError as e:
            raise CheckpointCorruptError(f"manifest lists a file outside its checkpoint directory: {e}") from e
        if not (isinstance(rec, dict) and isinstance(rec.get("rank"), int) and isinstance(rec.get("nbytes"), int)
                and record_checksum(rec) is not None and _valid_mode(rec.get("mode"))):
            raise CheckpointCorruptError(f"manifest record of {name!r} is malformed: {str(rec)[:200]}")
    return m


def _valid_mode(mode: Any) -> bool:
    return mode is None or (type(mode) is int and 0 <= mode <= 0o7777)


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its step, directory name, absolute path and manifest."""

    step: int
    dirname: str
    path: str
    manifest: Dict[str, Any]


def list_committed(reader: StorageReader, checkpoint_dir: str, *, quick_check: bool = True,
                   problems: Optional[List[str]] = None,
                   name_pattern: "Optional[re.Pattern[str]]" = None) -> List[Committed]:
    """Committed checkpoints in ``checkpoint_dir``, oldest step first.

    Directories without a parseable manifest are not committed and are skipped; with ``quick_check``
    so are those whose files are missing or have the wrong size. Each skipped one is described in
    ``problems`` when a list is given. A directory without a manifest counts as skipped (damaged, not
    foreign) when it is snapckpt's: it has a ``.snapckpt`` sidecar, or its whole name matches
    ``name_pattern`` (the caller's layout, e.g. ``step_\\d{8,}``); other directories (logs, tensorboard)
    are ignored silently. A directory renamed or deleted while it is read (retention of the job that
    writes ``checkpoint_dir``) is skipped silently too: it is gone, not damaged.
    """
    out: List[Committed] = []
    for name in reader.listdir(checkpoint_dir):
        if name.startswith("."):
            continue
        path = os.path.join(checkpoint_dir, name)
        mpath = os.path.join(path, MANIFEST)
        try:
            data = reader.read_bytes(mpath)
        except NotADirectoryError:
            continue
        except FileNotFoundError:
            if problems is not None and reader.isdir(path) and (
                    reader.isdir(os.path.join(path, SIDECAR))
                    or (name_pattern is not None and name_pattern.fullmatch(name))):
                problems.append(f"{name}: {MANIFEST} is missing (a snapckpt checkpoint directory without "
                                "its commit record: deleted, or damaged by hand)")
            continue
        except OSError as e:
            if problems is not None:
                problems.append(f"{name}: cannot read manifest: {e}")
            continue
        try:
            m = parse_manifest(data, name, source=mpath)
            if quick_check:
                check_sizes(reader, path, m)
        except CheckpointCorruptError as e:
            # a missing file of a directory that is gone now: retired meanwhile (retention renames it away
            # at once), not damaged
            if problems is not None and reader.isdir(path):
                problems.append(f"{name}: {e}")
            continue
        out.append(Committed(m["step"], name, path, m))
    out.sort(key=lambda c: (c.step, c.manifest.get("created_unix", 0)))
    return out


def _files(manifest: Dict[str, Any], rank: Optional[int]) -> Iterable[tuple]:
    for name, rec in sorted(manifest["files"].items()):
        if rank is None or rec.get("rank") == rank:
            yield name, rec


def file_set_changes(reader: StorageReader, path: str, manifest: Dict[str, Any]) -> "tuple[List[str], List[str]]":
    """How the set of files of the committed directory ``path`` differs from its manifest's: ``(missing,
    extra)``, sorted names of the listed files that are gone and of the entries of the directory (files or
    folders; the ``.snapckpt`` sidecar aside) that the manifest does not list. A directory whose user changed
    it in place (re-sharded weights, deleted an optimizer file) has a changed set: its manifest no longer
    describes it. That is not damage: damage is a listed file whose bytes differ from the committed ones
    (:func:`check_sizes`, :func:`check_checksums` with ``present_only``)."""
    listed = set(manifest["files"])
    missing = []
    for name in sorted(listed):
        try:
            reader.size(os.path.join(path, name))
        except FileNotFoundError:
            missing.append(name)
    extra = sorted(n for n in reader.listdir(path) if n != SIDECAR and n not in listed)
    return missing, extra


def present_files(reader: StorageReader, path: str, manifest: Dict[str, Any]) -> Dict[str, Any]:
    """``manifest`` with only the listed files that exist in ``path`` (for :func:`check_sizes` and
    :func:`check_checksums` of a directory changed in place, see :func:`file_set_changes`)."""
    files = {}
    for name, rec in manifest["files"].items():
        try:
            reader.size(os.path.join(path, name))
        except FileNotFoundError:
            continue
        files[name] = rec
    return {**manifest, "files": files}


def check_sizes(reader: StorageReader, path: str, manifest: Dict[str, Any], rank: Optional[int] = None) -> None:
    """Raise ``CheckpointCorruptError`` if a file (of ``rank``, or all) is missing or has the wrong size."""
    for name, rec in _files(manifest, rank):
        try:
            size = reader.size(os.path.join(path, name))
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{os.path.join(path, name)} is missing (listed in the manifest)")
        if size != rec["nbytes"]:
            raise CheckpointCorruptError(f"{os.path.join(path, name)} is {size} bytes, the manifest says "
                                         f"{rec['nbytes']} (truncated or overwritten)")


def check_checksums(reader: StorageReader, path: str, manifest: Dict[str, Any], rank: Optional[int] = None,
                    progress=None, max_workers: int = 4) -> None:
    """Raise ``CheckpointCorruptError`` if a file (of ``rank``, or all) fails its size or checksum (or its
    manifest record holds no checksum this version knows). Several files are read in parallel, on up to
    ``max_workers`` threads (reads and hashing of large buffers release the GIL)."""
    check_sizes(reader, path, manifest, rank)
    todo = []
    for name, rec in _files(manifest, rank):
        known = record_checksum(rec)
        if known is None:
            raise CheckpointCorruptError(f"the manifest record of {os.path.join(path, name)} holds none of the "
                                         f"checksums {sorted(CHECKSUMS)}")
        todo.append((os.path.join(path, name), *known))

    def check(item) -> None:
        fpath, algo, want = item
        got = file_checksum(reader, fpath, algo, progress)
        if got != want:
            raise CheckpointCorruptError(f"{fpath} has {algo} {got}, the manifest says {want} (corrupted)")

    if len(todo) <= 1 or max_workers <= 1:
        for item in todo:
            check(item)
        return
    with cf.ThreadPoolExecutor(max_workers=min(max_workers, len(todo)), thread_name_prefix="snapckpt-verify") as ex:
        for fut in [ex.submit(check, item) for item in todo]:
            fut.result()  # the first failing file, in manifest order
