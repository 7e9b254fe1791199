"""The remote tier: committed checkpoints copied to an object store (``s3://``, any fsspec URL).

Layout under the remote URL (the same native layout as ``checkpoint_dir``)::

    <remote_dir>/step_00000100/rank_00000.pt               data objects, uploaded first
    <remote_dir>/step_00000100/.snapckpt/remote.json       written before the data: a snapckpt upload began
    <remote_dir>/step_00000100/.snapckpt/manifest.json     the commit record, written last
    <remote_dir>/latest                                    tracker object, written after the manifest

**Commit without rename.** An object store has no atomic rename of a prefix, so the manifest object is the
commit record: it is written only after every data object is complete (each streamed from the local
committed copy after its XXH3-64 was recomputed from the same open file and compared with the local
manifest, its size read back from the store), then the tracker object. Readers (:meth:`RemoteStore.list_committed`) ignore every
prefix without a manifest that parses, or whose objects have the wrong size. Retention deletes the
manifest first, then the data: a half-deleted checkpoint is never taken for a committed one. An upload
that was interrupted (the persister killed, the connection lost) leaves a prefix with ``remote.json`` and
no manifest, and maybe an unfinished multipart upload: :meth:`RemoteStore.clean_orphans` (run by the next
persister of the job) deletes both.

Credentials come from the standard places only (the provider's environment variables and config files;
``AWS_ENDPOINT_URL`` for an S3-compatible endpoint): snapckpt never writes or logs them, and its error
messages name the URL, never a key.

The library is fsspec (with s3fs for ``s3://``): one interface for every object store fsspec knows; s3fs's
``put_file`` sends parts of ``block_nbytes`` concurrently (multipart upload), downloads stream in blocks,
several files at once, so a checkpoint never has a second full copy in RAM (``benchmarks/remote_s3.py``
measures both against plain clients).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import posixpath
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from snapckpt.storage.posix import PosixStorage
from snapckpt.storage.urls import check_remote_url, is_remote_url
from snapckpt._internal import env as _env
from snapckpt._internal import faultpoints as faults
from snapckpt.errors import CheckpointCorruptError, RemoteStorageError, RemoteURLError
from snapckpt.ondisk.manifest import (CHECKSUMS, MANIFEST, SIDECAR, parse_manifest, record_checksum, save_order,
                                      tracker_named)

__all__ = ["RemoteStore", "RemoteCommitted", "REMOTE_MARKER", "BLOCK_NBYTES", "is_remote_url", "call_bounded",
           "NoAnswer", "PROBE_TIMEOUT_SECS"]

log = logging.getLogger(__name__)

#: Marker of a snapckpt upload in a checkpoint prefix (written before the data objects).
REMOTE_MARKER = f"{SIDECAR}/remote.json"
#: Default multipart part size of uploads and block size of downloads (bytes); also the memory one stream
#: holds (``SNAPCKPT_REMOTE_BLOCK_NBYTES`` changes it).
BLOCK_NBYTES = 16 << 20
#: Files of one checkpoint uploaded or downloaded at once.
PARALLEL_FILES = 4
#: The most seconds the start's access probe may take (less when half the coordination timeout is less):
#: a store that accepts connections but never answers would otherwise hold rank 0 for minutes while the
#: other ranks' wait for it times out with a misleading "rank 0 did not answer".
PROBE_TIMEOUT_SECS = 60.0
#: Parts of one file in flight at once (S3): with the files, at most
#: ``PARALLEL_FILES * PART_CONCURRENCY * block_nbytes`` bytes (256 MiB by default) of a checkpoint in memory.
PART_CONCURRENCY = 4


@dataclass(frozen=True)
class RemoteCommitted:
    """A checkpoint committed in the remote tier: step, directory name, URL of its prefix, manifest."""

    step: int
    dirname: str
    url: str
    manifest: Dict[str, Any]


class RemoteStore:
    """One remote checkpoint location (``s3://bucket/prefix``...), through fsspec.

    Args:
        url: the remote directory, any fsspec URL with a scheme (``s3://bucket/run1``).
        role: what the URL is, for messages: ``"remote_dir"`` (the remote tier beside a local directory) or
            ``"checkpoint_dir"`` (remote-only mode, :mod:`snapckpt.persister.remote_only`).

    Raises:
        RemoteURLError: (a :class:`RemoteStorageError`) the URL's shape is wrong (see
            :func:`~snapckpt.storage.urls.check_remote_url`), fsspec has no implementation for its scheme
            installed (the message names the package to install: ``pip install '.[s3]'`` in a snapckpt clone for
            ``s3://``) or does not know it, or the filesystem cannot reach the URL's host when made.
    """

    def __init__(self, url: str, role: str = "remote_dir") -> None:
        self.role = role
        scheme, self.url = check_remote_url(url, role)
        try:
            import fsspec
            self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True)
        except ImportError as e:
            raise RemoteURLError(
                f"{role} {self.url!r}: the fsspec implementation for this scheme is not installed ({e}); "
                "for s3:// install the s3 extra: pip install '.[s3]' in your snapckpt clone (s3fs)") from e
        except ValueError as e:  # an unknown protocol
            hint = " (URL schemes are lower case)" if scheme != scheme.lower() else ""
            raise RemoteURLError(f"{role} {self.url!r}: {e}{hint}; supported: s3:// (pip install '.[s3]' "
                                 "in your snapckpt clone), or any fsspec URL whose implementation is installed") from e
        except Exception as e:  # a filesystem that connects in its constructor (ftp://, sftp://): host unknown...
            raise RemoteURLError(f"{role} {self.url!r} cannot be reached: {type(e).__name__}: "
                                 f"{str(e)[:300]}; check the host in the URL and the network (snapckpt is tested with s3://; "
                                 "another scheme works when its fsspec filesystem stores objects)") from e
        self.root = self.root.rstrip("/")
        self.block_nbytes = _env.remote_block_nbytes()
        # {dirname: (identity of its manifest object in a listing, parsed manifest)}: list_committed's
        # manifests, read again only when the listing shows the object changed
        self._manifests: Dict[str, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
        #: :meth:`claim` created the owner record (no job had used the directory): it holds none of this job's
        #: checkpoints, so a listing that fails cannot hide one
        self.claimed_new = False

    # ----------------------------------------------------------------------------------- helpers
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def display(self, *parts: str) -> str:
        """The URL of ``parts`` under the remote directory (for messages)."""
        return posixpath.join(self.url, *parts)

    def _read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def _write(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)

    # ------------------------------------------------------------------------------------ checks
    def check_access(self, timeout: Optional[float] = None) -> None:
        """Check that the remote directory can be listed and written (a small probe object is written and
        deleted). Called by :class:`~snapckpt.Checkpointer` at start, before training.

        Args:
            timeout: seconds the probe may take (``None``: the client's own timeouts and retries, which for a
                store that accepts connections but never answers add up to minutes: s3fs's 15 s read timeout,
                botocore's attempts, s3fs's retries).

        Raises:
            RemoteStorageError: the bucket does not exist, the credentials are missing or refused, the
                endpoint cannot be reached, or it did not answer within ``timeout``; the message names the
                URL, the cause and the fix, never a key.
        """
        probe = self._path(f".snapckpt-probe-{uuid.uuid4().hex[:12]}")

        def run() -> None:
            self._write(probe, b"snapckpt access probe\n")
            self.fs.rm_file(probe)
            self.fs.invalidate_cache()

        try:
            call_bounded(run, timeout)
        except NoAnswer as e:
            raise RemoteStorageError(
                f"{self.role} {self.url!r}: the store did not answer a probe object's write within {timeout:g} s "
                "(stalled, overloaded or unreachable); check the endpoint (AWS_ENDPOINT_URL for an S3-compatible "
                "store), the network and the store's health") from e
        except FileNotFoundError as e:
            raise self._no_bucket(e) from e
        except PermissionError as e:
            raise RemoteStorageError(
                f"{self.role} {self.url!r}: access denied ({_cause(e)}); check the credentials in the standard "
                "places (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials, the instance "
                "role) and that they may write this prefix") from e
        except Exception as e:  # no credentials, endpoint down, DNS...
            raise RemoteStorageError(
                f"{self.role} {self.url!r}: cannot write a probe object: {_cause(e)}; check the endpoint "
                "(AWS_ENDPOINT_URL for an S3-compatible store), the network and the credentials in the "
                "standard places") from e

    def _no_bucket(self, e: BaseException) -> RemoteStorageError:
        return RemoteStorageError(
            f"{self.role} {self.url!r}: the bucket does not exist ({_cause(e)}); create it (e.g. "
            f"`aws s3 mb {self.url.split('/')[0]}//{self.url.split('/')[2]}`) or fix the URL")

    def check_bucket(self, e: FileNotFoundError) -> None:
        """After the store answered ``e`` (not found): raise :class:`RemoteStorageError` naming the URL and the
        fix when the bucket itself is missing (deleted, or a wrong URL), so that a missing bucket is never read
        as an empty prefix; return when the bucket exists or the store cannot tell."""
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.invalidate_cache()
            missing = not self.fs.exists(bucket)
        except Exception:  # cannot tell: the caller's own error stands
            return
        if missing:
            raise self._no_bucket(e) from e

    def failure(self, what: str, e: BaseException) -> RemoteStorageError:
        """The error to raise when the store failed (after its client's own retries) while doing ``what``
        (``"writing step 2"``): it names the URL, the cause (with the server's answer that s3fs translated,
        e.g. ``SlowDown ... UploadPart``) and what stays intact; never a key."""
        inner = e.__cause__
        detail = f" ({_cause(inner)})" if inner is not None and str(inner) not in str(e) else ""
        return RemoteStorageError(
            f"{self.role} {self.url!r}: {what} failed after the client's retries: {_cause(e)}{detail}; the "
            "checkpoints committed before are intact; check the endpoint, the network and the store's health")

    OWNER = ".snapckpt-owner.json"

    def claim(self, checkpoint_dir: str, job_id: Optional[str]) -> Dict[str, Any]:
        """Record the job that owns this remote directory, or check that it is this one: a job is
        ``(realpath(checkpoint_dir), job_id)``, as for the local directory (a fresh node resuming the same
        job at the same path is the same job); in remote-only mode ``checkpoint_dir`` is the URL itself.
        The record is the object ``<remote_dir>/.snapckpt-owner.json``; it is returned (its ``dir_id``, a
        random id made with it, tells a re-created remote directory from the one memory snapshots were
        taken for).

        Raises:
            RemoteStorageError: another job owns the directory (its checkpoints would replace this job's,
                and a fresh node would load the other job's state); the message names it and the fix.
        """
        where = checkpoint_dir if is_remote_url(checkpoint_dir) else os.path.realpath(checkpoint_dir)
        me = {"checkpoint_dir": where, "job_id": job_id or ""}
        path = self._path(self.OWNER)
        for _ in range(3):
            absent = False
            try:
                owner = json.loads(self._read(path))
                if not isinstance(owner, dict):
                    owner = None
            except FileNotFoundError:
                owner, absent = None, True
            except (ValueError, UnicodeDecodeError):
                owner = None  # unreadable: rewritten below
            if owner is None and absent:
                mine = {**me, "host": socket.gethostname(), "created_unix": time.time(), "dir_id": uuid.uuid4().hex}
                if self._create(path, json.dumps(mine).encode()):
                    self.claimed_new = True
                    return mine
                continue  # another job created it since the read (two jobs started at once): check against it
            break
        if owner is not None and {k: owner.get(k) for k in me} != me:
            raise RemoteStorageError(
                f"{self.role} {self.url!r} is the remote tier of another job (checkpoint_dir "
                f"{owner.get('checkpoint_dir')!r}, job_id {owner.get('job_id') or None!r}, host "
                f"{owner.get('host')!r}); this job ({me['checkpoint_dir']!r}, job_id {job_id!r}) would replace "
                f"its checkpoints: give each job its own {self.role}, or delete {self.display(self.OWNER)} if "
                "that job is gone (also when this job's local directory moved)")
        if owner is None:
            owner = {**me, "host": socket.gethostname(), "created_unix": time.time(), "dir_id": uuid.uuid4().hex}
            self._write(path, json.dumps(owner).encode())
        return owner

    def _create(self, path: str, data: bytes) -> bool:
        """Write the small object ``path`` only if it does not exist (S3's conditional PUT, ``If-None-Match:
        *``); return ``False`` when it exists. A store that refuses the condition (an S3-compatible store
        without conditional writes) and other schemes get a plain write: the claim is then read-then-write,
        as before."""
        if "s3" in _protocols(self.fs):
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False
            except Exception as e:  # 501 NotImplemented and the like: no conditional writes there
                log.info("remote: %s refused a conditional write (%s); writing it plainly", self.display(),
                         _cause(e))
        self._write(path, data)
        return True

    # ------------------------------------------------------------------------------------ listing
    def _dirs(self) -> List[str]:
        try:
            entries = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError as e:
            self.check_bucket(e)
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")

    def list_committed(self, problems: Optional[List[str]] = None) -> List[RemoteCommitted]:
        """Committed remote checkpoints, oldest step first: prefixes whose manifest object parses and whose
        data objects all exist with the recorded sizes. Prefixes without a manifest (an upload in flight,
        or interrupted) and hidden ones are skipped silently; damaged ones are described in ``problems``.

        One recursive listing of the remote directory (a paginated LIST, about one request per 1,000
        objects) gives every prefix's objects and sizes; a manifest is read only when the listing shows its
        object changed since this store last read it (another ETag, size or modification time; read every
        time where the store reports none of those, and every time while it does not parse). A prefix whose
        objects do not match its manifest in that listing is listed once more before it is called damaged
        (:meth:`_check_sizes` names the object; the prefix may have changed since the listing).

        Raises:
            RemoteStorageError: the bucket does not exist.
            OSError / the store's errors: the store cannot be listed.
        """
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError as e:
            self.check_bucket(e)
            return []
        objects: Dict[str, Dict[str, Dict[str, Any]]] = {}  # {dirname: {name in it: listing info}}
        for path, info in found.items():
            top, _, rest = posixpath.relpath(path, self.root).partition("/")
            if rest and not top.startswith("."):
                objects.setdefault(top, {})[rest] = info
        # built aside, then swapped in: a listing given up by call_bounded may still be running beside this one
        known, fresh = self._manifests, {}
        out: List[RemoteCommitted] = []
        for name, listed in sorted(objects.items()):
            info = listed.get(MANIFEST)
            if info is None:  # an upload in flight, or interrupted
                continue
            ident = _listed_identity(info)
            try:
                if ident is not None and name in known and known[name][0] == ident:
                    m = known[name][1]
                else:
                    m = parse_manifest(self._read(self._path(name, MANIFEST)), name,
                                       source=self.display(name, MANIFEST))
                if ident is not None:
                    fresh[name] = (ident, m)
                if any(int(listed.get(f, {}).get("size", -1)) != rec["nbytes"] for f, rec in m["files"].items()):
                    self._check_sizes(name, m)
            except FileNotFoundError:  # gone since the listing (retention)
                continue
            except CheckpointCorruptError as e:
                if problems is not None:
                    problems.append(f"{self.display(name)}: {e}")
                continue
            out.append(RemoteCommitted(m["step"], name, self.display(name), m))
        self._manifests = fresh
        out.sort(key=lambda c: (c.step, c.manifest.get("created_unix", 0)))
        return out

    def _check_sizes(self, dirname: str, manifest: Dict[str, Any]) -> None:
        sizes: Dict[str, int] = {}
        base = self._path(dirname)
        for path, info in self.fs.find(base, detail=True).items():
            sizes[posixpath.relpath(path, base)] = int(info.get("size", -1))
        for name, rec in manifest["files"].items():
            if name not in sizes:
                raise CheckpointCorruptError(f"{self.display(dirname, name)} is missing (listed in the manifest)")
            if sizes[name] != rec["nbytes"]:
                raise CheckpointCorruptError(f"{self.display(dirname, name)} is {sizes[name]} bytes, the manifest "
                                             f"says {rec['nbytes']}")

    # ------------------------------------------------------------------------------------- upload
    def upload(self, local_dir: str, dirname: str, manifest: Dict[str, Any], *, run_id: str,
               tracker_name: str = "", tracker_content: str = "") -> bool:
        """Upload the committed local checkpoint ``local_dir`` (manifest ``manifest``) as ``<url>/<dirname>``
        and commit it there: marker, data objects (each file's checksum recomputed and compared with the
        manifest just before it is sent; sizes read back), manifest object, its objects' sizes read back once
        more, then the tracker object ``tracker_name`` (if given), unless a checkpoint committed in the store
        was saved later (:meth:`_saved_later`).

        A prefix already committed with the same files (same sizes and checksums) is left as it is (only
        the tracker is written). A different one (a re-save of the step) loses its manifest first.

        Two persisters can upload here at once: after a restart that put rank 0 on another node, the
        previous committer's persister still uploads its queue while the new committer uploads and removes
        what it takes for interrupted uploads (:meth:`clean_orphans`). Hence the second read-back (objects
        removed after the first one: the manifest is taken back and the upload fails, to be retried) and
        the tracker rule: an upload that ends after a later save's never moves the tracker object back.

        Returns:
            ``False`` when ``tracker_name`` was given but not written (a later save is committed here);
            else ``True``.

        Raises:
            CheckpointCorruptError: a local file no longer matches its manifest (nothing committed remotely),
                or the data objects vanished while the manifest was written (the manifest is removed).
            OSError / the store's errors: the upload failed (nothing committed remotely).
        """
        step = manifest["step"]
        prefix = self._path(dirname)
        mpath = self._path(dirname, MANIFEST)
        same = False
        try:
            old = parse_manifest(self._read(mpath), dirname)
            same = old["files"] == manifest["files"]
            if same:
                self._check_sizes(dirname, old)  # an object lost since: upload again
        except FileNotFoundError:
            pass
        except CheckpointCorruptError:
            pass
        if not same:
            if self.fs.exists(prefix):
                self._rm_quiet(mpath)  # the commit record goes first: never a manifest over mixed data
                self._rm_tree(prefix)
            self._write(self._path(dirname, REMOTE_MARKER),
                        json.dumps({"run_id": run_id, "step": step, "started_unix": time.time(),
                                    "tracker_name": tracker_name, "tracker_content": tracker_content}).encode())
            names = sorted(manifest["files"])
            with cf.ThreadPoolExecutor(max_workers=min(PARALLEL_FILES, max(1, len(names))),
                                       thread_name_prefix="snapckpt-upload") as ex:
                futs = [ex.submit(self._put_file, os.path.join(local_dir, n), dirname, n, manifest["files"][n],
                                  step) for n in names]
                for f in futs:
                    f.result()
            self.fs.invalidate_cache()
            self._check_sizes(dirname, manifest)
            faults.point("remote.before_manifest", step=step, rank=None)
            self._write(mpath, json.dumps(manifest, indent=1).encode())
            try:  # another uploader's clean-up may have removed the objects since they were read back
                self.fs.invalidate_cache()
                self._check_sizes(dirname, manifest)
            except CheckpointCorruptError:
                self._rm_quiet(mpath)
                raise
        # (a later save committed between this listing and the tracker's write still loses: one request's window)
        later = self._saved_later(tracker_name, dirname, manifest) if tracker_name else None
        if later is not None:
            log.info("remote: %s of step %d not written: step %d (%s), saved later, is committed there",
                     tracker_name, step, later.step, later.dirname)
        elif tracker_name:
            faults.point("remote.before_tracker", step=step, rank=None)
            self._write(self._path(tracker_name), tracker_content.encode())
        log.info("remote: committed step %d as %s (%d files)", step, self.display(dirname), len(manifest["files"]))
        return later is None

    def _saved_later(self, tracker_name: str, dirname: str, manifest: Dict[str, Any]) -> Optional[RemoteCommitted]:
        """The latest-saved committed checkpoint here (other than ``dirname``) whose commit wrote the tracker
        ``tracker_name`` (its manifest's ``tracker`` record) and whose save was requested after ``manifest``'s
        (``requested_unix``, the order retention and the loader use), or ``None``."""
        mine = save_order(manifest)
        later = [c for c in self.list_committed() if c.dirname != dirname and save_order(c.manifest) > mine
                 and isinstance(c.manifest.get("tracker"), dict) and c.manifest["tracker"].get("name") == tracker_name
                 and isinstance(c.manifest["tracker"].get("content"), str)]
        return max(later, key=lambda c: save_order(c.manifest)) if later else None

    def _put_file(self, local: str, dirname: str, name: str, rec: Dict[str, Any], step: int) -> None:
        """Upload one committed file: its checksum is recomputed from an open descriptor, then the same
        inode (``/proc/self/fd``: a re-commit that renamed another file into place meanwhile cannot swap
        the bytes) is sent by s3fs's ``put_file``: parts of ``block_nbytes`` uploaded :data:`PART_CONCURRENCY`
        at a time (a multipart upload, aborted by s3fs on an error), a single PUT below two parts."""
        known = record_checksum(rec)
        if known is None:
            raise CheckpointCorruptError(f"{local}: its manifest record holds no known checksum")
        algo, want = known
        h = CHECKSUMS[algo]()
        n = 0
        fd = os.open(local, os.O_RDONLY)
        try:
            while True:
                chunk = os.read(fd, self.block_nbytes)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
            if n != rec["nbytes"] or h.hexdigest() != want:
                raise CheckpointCorruptError(
                    f"{local} changed since it was committed ({n} bytes, {algo} {h.hexdigest()}; the manifest "
                    f"says {rec['nbytes']} bytes, {want}); not uploaded")
            kwargs: Dict[str, Any] = {}
            if "s3" in _protocols(self.fs):
                kwargs = {"chunksize": self.block_nbytes, "max_concurrency": PART_CONCURRENCY}
            self.fs.put_file(f"/proc/self/fd/{fd}", self._path(dirname, name), callback=_part_point(step), **kwargs)
        finally:
            os.close(fd)

    # ------------------------------------------------------------- remote-only mode (no local copy)
    def fs_path(self, url: str) -> str:
        """The store path of ``url`` (a URL under :attr:`url`, as the commit protocol builds them)."""
        if url != self.url and not url.startswith(self.url + "/"):
            raise ValueError(f"{url!r} is not under {self.url!r}")
        return self.root + url[len(self.url):]

    def listdir(self, url: str) -> List[str]:
        """Names of the objects and prefixes directly under ``url`` (``[]`` when there are none), listed
        afresh (the commit polls it; fsspec's listing cache would hide new part markers)."""
        try:
            entries = self.fs.ls(self.fs_path(url), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def read_bytes(self, url: str) -> bytes:
        """The whole object ``url`` (small objects: markers, manifests).

        Raises:
            FileNotFoundError: no such object.
        """
        return self._read(self.fs_path(url))

    def write_object(self, *parts: str, data: bytes) -> None:
        """Write the small object ``<url>/<parts...>`` in one PUT (a reader sees all of it or none)."""
        self._write(self._path(*parts), data)

    def remove_object(self, *parts: str) -> None:
        """Delete ``<url>/<parts...>`` if it exists."""
        self._rm_quiet(self._path(*parts))

    def begin_part(self, dirname: str, *, rank: int, run_id: str, step: int) -> None:
        """Before a persister streams rank ``rank``'s files of ``step`` into ``<url>/<dirname>``: the prefix
        stops being a committed checkpoint (its manifest goes first: a re-save of a step replaces it, never
        a manifest over mixed data), the rank's part marker of an earlier save goes, and the upload marker
        ``remote.json`` says that a snapckpt upload of ``run_id`` began there (what
        :meth:`clean_orphans` of a later persister removes if no manifest follows).

        Raises:
            RemoteStorageError: the bucket does not exist (deleted since the start).
            OSError / the store's errors: the store failed.
        """
        self._rm_quiet(self._path(dirname, MANIFEST))
        self._rm_quiet(self._path(dirname, SIDECAR, f"part_{rank:05d}.json"))
        try:
            self._write(self._path(dirname, REMOTE_MARKER),
                        json.dumps({"run_id": run_id, "step": step, "started_unix": time.time()}).encode())
        except FileNotFoundError as e:  # the first write of a save: a bucket deleted since the start
            self.check_bucket(e)
            raise

    def open_write(self, dirname: str, name: str, on_part: Optional[Callable[[], None]] = None):
        """A writer of the data object ``<url>/<dirname>/<name>``: for S3, each ``block_nbytes`` written is one
        part of a multipart upload, :data:`PART_CONCURRENCY` parts in flight (a single PUT below one part);
        other stores, fsspec's buffered writer (one part at a time). Close it to complete the object;
        :meth:`abandon` it after an error. ``on_part()`` runs after each part is stored (S3; the fault point
        ``remote.mid_upload`` of the tests)."""
        path = self._path(dirname, name)
        if "s3" in _protocols(self.fs):
            return _S3PartWriter(self.fs, path, self.block_nbytes, PART_CONCURRENCY, on_part)
        return self.fs.open(path, "wb", block_size=self.block_nbytes)

    @staticmethod
    def abandon(f) -> None:
        """Drop the writer ``f`` of :meth:`open_write` without completing its object (an S3 multipart upload
        is aborted; what a killed process leaves is removed by :meth:`clean_orphans`)."""
        try:
            f.discard()
        except Exception as e:  # best effort: the next persister's clean-up is the backstop
            log.warning("remote: could not abort an unfinished upload: %s", _cause(e))
        finally:
            f.closed = True  # else its close() (at garbage collection too) would complete a truncated object

    def check_sizes(self, dirname: str, manifest: Dict[str, Any]) -> None:
        """Check that every object ``manifest`` lists exists under ``<url>/<dirname>`` with its size.

        Raises:
            CheckpointCorruptError: an object is missing or of the wrong size (named).
        """
        self.fs.invalidate_cache()
        self._check_sizes(dirname, manifest)

    def discard_uncommitted(self, dirname: str) -> None:
        """Delete ``<url>/<dirname>`` unless it holds a manifest, and abort the unfinished multipart uploads
        under it (after a failed save, none of whose writers is running: nothing of it may look like a
        checkpoint, and both cost storage; a writer that failed with the store down could not abort its own).

        Raises:
            OSError / the store's errors: the store failed (nothing or part of it deleted; call again).
        """
        if not self.fs.exists(self._path(dirname, MANIFEST)):
            self._rm_tree(self._path(dirname))
        self._abort_multipart(under=dirname)

    def _expected(self, dirname: str, name: str, rec: Dict[str, Any]) -> Tuple[str, str, str]:
        """``(display name, checksum algorithm, expected digest)`` of a data object from its manifest record.

        Raises:
            CheckpointCorruptError: the record holds no checksum snapckpt knows.
        """
        where = self.display(dirname, name)
        known = record_checksum(rec)
        if known is None:
            raise CheckpointCorruptError(f"{where}: its manifest record holds no known checksum")
        return (where, *known)

    def read_verified(self, dirname: str, name: str, rec: Dict[str, Any], *, parallel: int = PART_CONCURRENCY
                      ) -> bytearray:
        """The data object ``<url>/<dirname>/<name>`` read into memory by ``parallel`` ranged GETs of
        ``block_nbytes`` at once, its size and checksum checked against its manifest record ``rec``.

        Returns:
            the object's bytes (``rec["nbytes"]`` of them).

        Raises:
            CheckpointCorruptError: the object is missing, of another size, or fails its checksum.
        """
        where, algo, want = self._expected(dirname, name, rec)
        nbytes = int(rec["nbytes"])
        path = self._path(dirname, name)
        try:
            size = int(self.fs.info(path).get("size", -1))
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{where} is missing (listed in the manifest)") from e
        if size != nbytes:
            raise CheckpointCorruptError(f"{where} is {size} bytes, the manifest says {nbytes}")
        out = bytearray(nbytes)
        view = memoryview(out)
        step = self.block_nbytes

        def get(lo: int) -> None:
            hi = min(nbytes, lo + step)
            data = self.fs.cat_file(path, start=lo, end=hi)
            if len(data) != hi - lo:
                raise CheckpointCorruptError(f"{where}: a ranged read of bytes {lo}-{hi} returned {len(data)}")
            view[lo:hi] = data

        if nbytes:
            with cf.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="snapckpt-get") as ex:
                for f in [ex.submit(get, lo) for lo in range(0, nbytes, step)]:
                    f.result()
        h = CHECKSUMS[algo]()
        h.update(view)
        if h.hexdigest() != want:
            raise CheckpointCorruptError(f"{where} has {algo} {h.hexdigest()}, the manifest says {want} "
                                         "(corrupted in the store)")
        return out

    def verify_object(self, dirname: str, name: str, rec: Dict[str, Any]) -> None:
        """Stream the data object ``<url>/<dirname>/<name>`` (``block_nbytes`` at a time, nothing kept) and
        check its size and checksum against its manifest record ``rec`` (``snapckpt verify URL``).

        Raises:
            CheckpointCorruptError: the object is missing, of another size, or fails its checksum.
        """
        where, algo, want = self._expected(dirname, name, rec)
        h, n = CHECKSUMS[algo](), 0
        try:
            with self.fs.open(self._path(dirname, name), "rb", block_size=self.block_nbytes) as src:
                while True:
                    chunk = src.read(self.block_nbytes)
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{where} is missing (listed in the manifest)") from e
        if n != rec["nbytes"] or h.hexdigest() != want:
            raise CheckpointCorruptError(f"{where} is {n} bytes with {algo} {h.hexdigest()}; the manifest says "
                                         f"{rec['nbytes']} bytes, {want} (corrupted in the store)")

    # ----------------------------------------------------------------------------------- download
    def download(self, c: RemoteCommitted, checkpoint_dir: str, *, fsync: bool = True, replace: bool = False) -> str:
        """Download the remote checkpoint ``c`` into ``<checkpoint_dir>/<dirname>`` with every checksum
        verified, the local way: a hidden partial directory, the manifest written last, a rename; then the
        tracker file the upload recorded (if any). Return the local path.

        ``replace``: an existing ``<checkpoint_dir>/<dirname>`` (a local copy the caller found damaged) is
        replaced once the download is complete and verified (renamed to a hidden ``.download-`` name, which
        :func:`remove_download_leftovers` also removes if this process is killed in between, then deleted).

        Raises:
            CheckpointCorruptError: a remote object fails its size or checksum (nothing is left locally, and
                a directory to replace is untouched).
            FileExistsError: ``<checkpoint_dir>/<dirname>`` already exists and ``replace`` is false.
        """
        final = os.path.join(checkpoint_dir, c.dirname)
        if os.path.exists(final) and not replace:
            raise FileExistsError(f"{final} exists; not overwritten by the download of {c.url}")
        remove_download_leftovers(checkpoint_dir)
        partial = os.path.join(checkpoint_dir, f".{c.dirname}.download-{uuid.uuid4().hex[:12]}")
        os.makedirs(os.path.join(partial, SIDECAR), exist_ok=True)
        try:
            names = sorted(c.manifest["files"])
            with cf.ThreadPoolExecutor(max_workers=min(PARALLEL_FILES, max(1, len(names))),
                                       thread_name_prefix="snapckpt-download") as ex:
                futs = [ex.submit(self._get_file, c, n, partial, fsync) for n in names]
                for f in futs:
                    f.result()
            _write_local(os.path.join(partial, MANIFEST), json.dumps(c.manifest, indent=1).encode(), fsync)
            old = None
            if os.path.lexists(final):  # replace: the damaged copy goes aside only now
                old = os.path.join(checkpoint_dir, f".{c.dirname}.download-replaced-{uuid.uuid4().hex[:12]}")
                os.rename(final, old)
            os.rename(partial, final)
            PosixStorage(fsync=fsync).fsync_dir(checkpoint_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
                log.warning("remote: replaced the damaged local copy of step %d (%s) by the intact one "
                            "downloaded from %s", c.step, final, c.url)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        try:
            info = json.loads(self._read(self._path(c.dirname, REMOTE_MARKER)))
            tname, tcontent = info.get("tracker_name"), info.get("tracker_content")
        except (OSError, ValueError):
            tname = tcontent = None
        if isinstance(tname, str) and tname and "/" not in tname and isinstance(tcontent, str):
            tmp = os.path.join(checkpoint_dir, f".{tname}.tmp-{uuid.uuid4().hex[:12]}")
            _write_local(tmp, tcontent.encode(), fsync)
            os.replace(tmp, os.path.join(checkpoint_dir, tname))
            PosixStorage(fsync=fsync).fsync_dir(checkpoint_dir)
        log.info("remote: downloaded step %d from %s into %s", c.step, c.url, final)
        return final

    def _get_file(self, c: RemoteCommitted, name: str, partial: str, fsync: bool) -> None:
        rec = c.manifest["files"][name]
        known = record_checksum(rec)
        if known is None:
            raise CheckpointCorruptError(f"{c.url}/{name}: its manifest record holds no known checksum")
        algo, want = known
        h = CHECKSUMS[algo]()
        dest = os.path.join(partial, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        n = 0
        with self.fs.open(self._path(c.dirname, name), "rb", block_size=self.block_nbytes) as src, \
                open(dest, "wb") as dst:
            while True:
                chunk = src.read(self.block_nbytes)
                if not chunk:
                    break
                h.update(chunk)
                dst.write(chunk)
                n += len(chunk)
            dst.flush()
            if rec.get("mode") is not None:  # the permission bits it was saved with (an object store keeps none)
                os.fchmod(dst.fileno(), rec["mode"] & 0o777)  # a bucket's writer never sets setuid bits here
            if fsync:
                os.fsync(dst.fileno())
        if n != rec["nbytes"] or h.hexdigest() != want:
            raise CheckpointCorruptError(f"{c.url}/{name} is {n} bytes with {algo} {h.hexdigest()}; the manifest "
                                         f"says {rec['nbytes']} bytes, {want} (corrupted in the store)")

    # ---------------------------------------------------------------------------- retention, orphans
    def apply_retention(self, keep_last: Optional[int], protect: List[str] = ()) -> List[str]:
        """Delete remote checkpoints beyond the ``keep_last`` most recently saved (manifest first, then
        the data), except one the tracker object names (as local retention:
        :func:`~snapckpt.ondisk.manifest.tracker_named`); return the deleted directory names."""
        if keep_last is None:
            return []
        committed = self.list_committed()
        committed.sort(key=lambda c: save_order(c.manifest))
        keep = {c.dirname for c in committed[-keep_last:]} | set(protect)
        if len(committed) > keep_last:
            keep |= tracker_named(((c.dirname, c.manifest) for c in committed[:-keep_last]), self._read_tracker)
        deleted = []
        for c in committed:
            if c.dirname in keep:
                continue
            self._rm_quiet(self._path(c.dirname, MANIFEST))
            self._rm_tree(self._path(c.dirname))
            deleted.append(c.dirname)
            log.info("remote retention: deleted %s (step %d), keeping the newest %d", c.url, c.step, keep_last)
        return deleted

    def _read_tracker(self, name: str) -> Optional[str]:
        try:
            return self._read(self._path(name)).decode("utf-8", errors="replace")
        except (FileNotFoundError, IsADirectoryError):
            return None

    def clean_orphans(self, keep_runs: Sequence[str] = ()) -> List[str]:
        """Delete what interrupted uploads left: prefixes holding snapckpt's upload marker but no manifest,
        and unfinished multipart uploads under the remote directory (S3). Only for the job's one uploader,
        when no upload of its own is in flight; prefixes (and their multipart uploads) whose upload marker
        names a run of ``keep_runs`` are left alone (runs this persister still serves). Return the prefixes
        deleted."""
        removed = []
        busy = set()
        for name in self._dirs():
            if name.startswith("."):
                continue
            if keep_runs and self._marker_run(name) in keep_runs:
                busy.add(name)
                continue
            if self.fs.exists(self._path(name, MANIFEST)) or not self.fs.exists(self._path(name, REMOTE_MARKER)):
                continue
            self._rm_tree(self._path(name))
            removed.append(name)
            log.warning("remote: deleted %s, an upload that was interrupted (no manifest)", self.display(name))
        try:
            self._abort_multipart(busy)
        except Exception as e:  # best effort: a bucket lifecycle rule is the backstop
            log.warning("remote: could not list or abort multipart uploads under %s: %s", self.url, _cause(e))
        self.fs.invalidate_cache()
        return removed

    def _marker_run(self, dirname: str) -> Optional[str]:
        try:
            rec = json.loads(self._read(self._path(dirname, REMOTE_MARKER)))
        except (OSError, ValueError):
            return None
        return rec.get("run_id") if isinstance(rec, dict) else None

    def _abort_multipart(self, busy: Set[str] = frozenset(), under: Optional[str] = None) -> None:
        """Abort unfinished S3 multipart uploads under the remote directory, or only under its prefix
        ``under`` (they cost storage until aborted), except those under the prefixes ``busy``. Other
        stores: nothing to do.

        Raises:
            OSError / the store's errors: listing or aborting failed.
        """
        if "s3" not in _protocols(self.fs):
            return
        bucket, _, key = self.root.partition("/")
        prefix = key + "/" if key else ""
        from fsspec.asyn import sync
        reply = sync(self.fs.loop, self.fs._call_s3, "list_multipart_uploads", Bucket=bucket,
                     Prefix=prefix + (under + "/" if under else ""))
        for up in reply.get("Uploads", []):
            if up["Key"][len(prefix):].split("/", 1)[0] in busy:
                continue
            sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                 UploadId=up["UploadId"])
            log.warning("remote: aborted an unfinished multipart upload of s3://%s/%s", bucket, up["Key"])

    def _rm_quiet(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def _rm_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()


class _S3PartWriter:
    """A write-only S3 object sent as a multipart upload whose parts (``block`` bytes each, the last one
    shorter) are uploaded ``concurrency`` at a time on threads, through s3fs's client (its credentials,
    endpoint and retries). Memory: the block being filled plus the parts in flight. s3fs's own file object
    sends one part at a time (measured 1.8x slower than its ``put_file``).

    ``parts``: the parts completed so far (``{"PartNumber", "ETag"}``); ``on_part()`` runs after each (on the
    part's thread). ``write`` / ``close`` raise the store's error of a part; :meth:`discard` aborts the upload.
    """

    def __init__(self, fs, path: str, block: int, concurrency: int,
                 on_part: Optional[Callable[[], None]] = None) -> None:
        self.on_part = on_part
        self.fs, self.path, self.block, self.concurrency = fs, path, block, max(1, concurrency)
        self.bucket, self.key, _ = fs.split_path(path)
        self.buf = bytearray()
        self.parts: List[Dict[str, Any]] = []
        self.upload_id: Optional[str] = None
        self.closed = False
        self._next = 1
        self._inflight: List[cf.Future] = []
        self._pool: Optional[cf.ThreadPoolExecutor] = None

    def _call(self, method: str, **kwargs: Any) -> Dict[str, Any]:
        from fsspec.asyn import sync
        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, **kwargs)

    def write(self, data) -> int:
        if self.closed:
            raise ValueError(f"write to {self.path} after close")
        self.buf += data
        while len(self.buf) >= self.block:
            self._send(bytes(self.buf[:self.block]))
            del self.buf[:self.block]
        return len(data)

    def flush(self) -> None:
        pass  # parts are sent when full

    def _reap(self, block_until_below: int) -> None:
        """Raise the error of a finished part; wait until fewer than ``block_until_below`` are in flight."""
        while True:
            for f in [f for f in self._inflight if f.done()]:
                self._inflight.remove(f)
                f.result()
            if len(self._inflight) < block_until_below:
                return
            cf.wait(self._inflight, return_when=cf.FIRST_COMPLETED)

    def _send(self, chunk: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._call("create_multipart_upload")["UploadId"]
            self._pool = cf.ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="snapckpt-part")
        self._reap(self.concurrency)
        number, self._next = self._next, self._next + 1
        self._inflight.append(self._pool.submit(self._upload, number, chunk))

    def _upload(self, number: int, chunk: bytes) -> None:
        out = self._call("upload_part", UploadId=self.upload_id, PartNumber=number, Body=chunk)
        self.parts.append({"PartNumber": number, "ETag": out["ETag"]})
        if self.on_part is not None:
            self.on_part()

    def close(self) -> None:
        """Send what is left and complete the object (raises the store's error; then :meth:`discard`)."""
        if self.closed:
            return
        if self.upload_id is None:
            self._call("put_object", Body=bytes(self.buf))
        else:
            if self.buf:
                self._send(bytes(self.buf))
            self._reap(1)
            parts = sorted(self.parts, key=lambda p: p["PartNumber"])
            self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": parts})
            self._pool.shutdown(wait=True)
        self.buf = bytearray()
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abort the multipart upload (its parts in flight are waited for first)."""
        self.closed = True
        self.buf = bytearray()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.upload_id is not None:
            self._call("abort_multipart_upload", UploadId=self.upload_id)
            self.upload_id = None


class NoAnswer(TimeoutError):
    """:func:`call_bounded` gave up waiting (not a timeout of the client itself)."""


def call_bounded(fn: Callable[[], Any], timeout: Optional[float]) -> Any:
    """``fn()``, but given up after ``timeout`` seconds (``None``: waited for): it runs on a daemon thread,
    left to end on its own when given up (a store request blocked for the client's own timeouts).

    Raises:
        NoAnswer: (a ``TimeoutError``) ``fn`` had not returned after ``timeout`` seconds.
        whatever ``fn`` raised.
    """
    if timeout is None:
        return fn()
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name="snapckpt-remote-call", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise NoAnswer(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _listed_identity(info: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """What tells one version of an object from another in a listing's ``info`` (its size with the ETag, or the
    generation, or the modification time), ``None`` when the store reports none of them."""
    for key in ("ETag", "etag", "generation", "LastModified", "last_modified", "mtime", "updated"):
        if info.get(key) is not None:
            return (info.get("size"), key, str(info[key]))
    return None


def _protocols(fs) -> tuple:
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def _part_point(step: int):
    """An fsspec callback that runs the ``remote.mid_upload`` fault point after each part sent."""
    from fsspec.callbacks import Callback

    class PartPoint(Callback):
        def relative_update(self, inc=1) -> None:  # s3fs: once per part sent
            faults.point("remote.mid_upload", step=step, rank=None)

    return PartPoint()


def _cause(e: BaseException) -> str:
    """A short description of a store error (the exception's type and first line; fsspec errors carry
    no credentials)."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:300]}"


def _write_local(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def remove_download_leftovers(checkpoint_dir: str) -> List[str]:
    """Delete the hidden ``.<dirname>.download-*`` directories a killed download left in ``checkpoint_dir``
    (only rank 0 of the job owning the directory downloads, one step at a time, so none is in progress
    when it calls this); return their paths."""
    gone = []
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return gone
    for n in names:
        if n.startswith(".") and ".download-" in n:
            p = os.path.join(checkpoint_dir, n)
            shutil.rmtree(p, ignore_errors=True)
            log.warning("removed %s, left by an interrupted download from the remote tier", p)
            gone.append(p)
    return gone
