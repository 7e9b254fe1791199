"""Remote-only mode: ``Checkpointer("s3://bucket/run1")`` writes each part from the arena straight to the
object store and commits it there, with no local copy (for nodes without a local disk to spare).

The persister side of it, one node (a job on several nodes is refused at construction):

- **writers** (:func:`write_part_remote`): each rank's native files are streamed from its arena slot as
  objects under the final prefix ``<url>/<dirname>/`` (S3: a multipart upload, parts of ``block_nbytes``,
  4 in flight; other stores: fsspec's buffered writer; a few blocks per file in memory, never a second copy
  of the part), the checksum computed on the way; then the rank's **part marker object**
  ``<dirname>/.snapckpt/part_<rank>.json`` (sizes and checksums). Before the first byte the prefix loses
  its manifest (a re-save of a step replaces it) and gets the upload marker ``remote.json``.
- **the committer** (:func:`commit_remote`, rank 0's persister) waits for a part marker of every rank by
  listing the store (bounded by ``commit_timeout_secs``; a rank that died before handing its part over
  ends the wait at once, as on POSIX), checks every object's size in the store, writes the **manifest
  object** (the commit record), removes the part markers, then writes the **tracker object** and runs
  retention (manifest first, then the data). No rename anywhere.
- on failure the prefix is deleted once the node's writers of the step are done
  (:meth:`~snapckpt.storage.remote.RemoteStore.discard_uncommitted`); what a killed persister left (a prefix
  without a manifest, an unfinished multipart upload) is removed by the next persister of the job when
  its committer connects (:func:`clean_start`).

Loading is the engine's (:mod:`snapckpt.engine.loader`): the committed steps are the store's prefixes with
a manifest, each rank's files read by ranged GETs, checksums verified.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence

from snapckpt._internal import faultpoints as faults
from snapckpt.errors import CommitError, SnapckptError
from snapckpt.ondisk.manifest import MANIFEST, ChecksumWriter, build_manifest, part_marker_name, \
    validate_file_name
from snapckpt.storage.urls import is_remote_url

if TYPE_CHECKING:  # imported where a store is made: a persister of a local directory never needs it
    from snapckpt.storage.remote import RemoteStore

__all__ = ["store_for", "write_part_remote", "commit_remote", "clean_start", "newest_committed_step",
           "POLL_SECS", "is_remote_url"]

log = logging.getLogger("snapckpt.persister")

#: Seconds between two listings of the store while the committer waits for part markers (a LIST request
#: each: cheaper than the POSIX poll, which only reads a directory).
POLL_SECS = 0.1

_stores: Dict[str, RemoteStore] = {}
_stores_lock = threading.Lock()


def store_for(url: str) -> RemoteStore:
    """The persister's one :class:`RemoteStore` of ``url`` (made once: its client and connections are reused
    by every writer and commit).

    Raises:
        RemoteStorageError: the URL cannot be used (checked by the Checkpointer before it got here).
    """
    with _stores_lock:
        store = _stores.get(url)
        if store is None:
            from snapckpt.storage.remote import RemoteStore

            store = _stores[url] = RemoteStore(url, role="checkpoint_dir")
        return store


class _Blocks:
    """Hands writes to the object writer ``f`` in pieces of at most ``block`` bytes, so that its buffer never
    holds more than about two blocks (one ``write`` of a whole tensor would otherwise be copied into it
    entire)."""

    def __init__(self, f, block: int) -> None:
        self.f, self.block = f, block

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for lo in range(0, len(view), self.block):
            self.f.write(view[lo:lo + self.block])
        return len(view)

    def flush(self) -> None:
        pass  # a part is sent when a block is full; a forced flush would send a short part


def write_part_remote(store: RemoteStore, buf, index: Dict[str, Any], dirname: str, *, rank: int, run_id: str,
                      step: int, on_data_read: Optional[Callable[[], None]] = None) -> Dict[str, Dict[str, Any]]:
    """Write rank ``rank``'s files of ``step`` from slot mapping ``buf`` as objects under
    ``<store.url>/<dirname>/``, then its part marker object; return ``{file: {nbytes, xxh3_64, kind}}``.

    Args:
        store: the checkpoint location.
        buf: the slot's ``mmap`` (read only here).
        index: the slot's index (:func:`snapckpt.persister.slot_index.read_index`).
        dirname: the checkpoint's prefix name (``step_00000100``).
        on_data_read: called once every object is complete, before the part marker (the slot may be
            released then).

    Raises:
        ValueError: the index names a file outside the prefix.
        RemoteStorageError: the bucket is gone, or the store failed after its client's retries (an
            upload's multipart upload is aborted); the message names the URL and the cause.
    """
    try:
        return _write_part(store, buf, index, dirname, rank=rank, run_id=run_id, step=step,
                           on_data_read=on_data_read)
    except (SnapckptError, ValueError):
        raise
    except Exception as e:  # the store's (s3fs's OSError, botocore's errors): name the URL and the cause
        raise store.failure(f"writing rank {rank}'s part of step {step} to {store.display(dirname)}", e) from e


def _write_part(store: RemoteStore, buf, index: Dict[str, Any], dirname: str, *, rank: int, run_id: str,
                step: int, on_data_read: Optional[Callable[[], None]]) -> Dict[str, Dict[str, Any]]:
    from snapckpt.persister.writer import encode_file, file_record

    store.begin_part(dirname, rank=rank, run_id=run_id, step=step)
    files: Dict[str, Dict[str, Any]] = {}
    for f in index["files"]:
        if not f.get("persist", True):
            continue  # a MemoryOnly file: part of the memory snapshot only
        rel = validate_file_name(f["path"])
        kind = f.get("kind", "torch")
        out = store.open_write(dirname, rel, on_part=lambda: faults.point("remote.mid_upload", step=step, rank=rank))
        try:
            cw = ChecksumWriter(_Blocks(out, store.block_nbytes))
            encode_file(cw, buf, f, kind)
            out.close()
        except BaseException:
            store.abandon(out)
            raise
        files[rel] = file_record(cw, kind, f)  # its mode too: a download sets it
    if on_data_read is not None:
        on_data_read()
    faults.point("persist.before_part_marker", step=step, rank=rank)
    marker = {"rank": rank, "run_id": run_id, "step": step, "files": files}
    store.write_object(dirname, part_marker_name(rank), data=json.dumps(marker).encode())
    return files


def commit_remote(store: RemoteStore, req) -> Dict[str, Any]:
    """The commit of one step in the store (the committer; see the module docstring); return the manifest.

    Args:
        req: the :class:`~snapckpt.persister.commit.CommitRequest` (its ``checkpoint_dir`` is the URL).

    Raises:
        CommitTimeoutError: ranks missing at the deadline (named).
        PeerLostError: a missing part can never come (``req.peer_check``).
        CommitError: a rank failed, an unexpected rank wrote a part, or an object is missing or of the
            wrong size in the store.
        RemoteStorageError: the store failed while committing, after its client's retries; the message names
            the URL, the cause, and whether the manifest was written (then the step is committed and loadable,
            and only the removal of part markers or the tracker's update failed).
    """
    progress: Dict[str, bool] = {"manifest": False}
    try:
        return _commit(store, req, progress)
    except SnapckptError:
        raise
    except Exception as e:  # the store's: name the URL and the cause
        what = (f"finishing the commit of step {req.step} (its manifest is written: the step is committed and "
                f"loadable; the part markers' removal or the tracker's update failed)" if progress["manifest"]
                else f"committing step {req.step} (nothing committed)")
        raise store.failure(f"{what} as {store.display(req.dirname)}", e) from e


def _commit(store: RemoteStore, req, progress: Dict[str, bool]) -> Dict[str, Any]:
    from snapckpt.persister.commit import wait_for_parts

    parts = wait_for_parts(store, req, in_dir=f"{store.url}/{req.dirname}", poll_secs=POLL_SECS)  # a LIST each
    manifest = build_manifest(step=req.step, dirname=req.dirname, world_size=req.world_size,
                              requested_unix=req.requested_unix, run_id=req.run_id, parts=parts)
    if req.tracker_name:
        manifest["tracker"] = {"name": req.tracker_name, "content": req.tracker_content}
    try:
        store.check_sizes(req.dirname, manifest)
    except Exception as e:
        raise CommitError(f"step {req.step}: {e}") from e
    faults.point("remote.before_manifest", step=req.step, rank=None)
    store.write_object(req.dirname, MANIFEST, data=json.dumps(manifest, indent=1).encode())
    progress["manifest"] = True
    for r in parts:  # the manifest holds their records now; a re-save must not count them
        store.remove_object(req.dirname, part_marker_name(r))
    faults.point("remote.before_tracker", step=req.step, rank=None)
    newest = True  # False: a later save already moved the tracker (its commit ended first)
    if req.tracker_name:
        def write_tracker() -> None:
            store.write_object(req.tracker_name, data=req.tracker_content.encode())

        if req.tracker_gate is None:
            write_tracker()
        else:
            newest = req.tracker_gate(write_tracker) is not False
    log.info("committed step %d as %s (%d files, remote-only)", req.step, store.display(req.dirname),
             len(manifest["files"]))
    # a save behind a later one (its commit ended after the later one's) is not protected: the tracker object
    # names the later one, and keep_last=1 would otherwise keep both until the next commit
    try:
        store.apply_retention(req.keep_last, protect=[req.dirname] if newest else [])
    except Exception as e:  # retention never fails a commit that already happened
        log.warning("retention after step %d failed: %s: %s", req.step, type(e).__name__, str(e)[:300])
    return manifest


def clean_start(url: str, known_runs: Sequence[str]) -> None:
    """When a committer of a run connects: delete what interrupted uploads of earlier persisters left under
    ``url`` (prefixes without a manifest, unfinished multipart uploads), leaving the prefixes of the runs
    this persister still serves (``known_runs``: their writes or crash flush may be in flight). A failure is
    a warning: the next start tries again."""
    try:
        removed = store_for(url).clean_orphans(keep_runs=list(known_runs))
        if removed:
            log.warning("remote-only: removed %d interrupted upload(s) under %s: %s", len(removed), url, removed)
    except Exception as e:
        log.warning("remote-only: could not clean up interrupted uploads under %s: %s: %s", url,
                    type(e).__name__, str(e)[:300])


def newest_committed_step(url: str) -> Optional[int]:
    """The highest step committed under ``url`` (``None``: none).

    Raises:
        OSError / the store's errors: the store cannot be listed.
    """
    committed = store_for(url).list_committed()
    return max((c.step for c in committed), default=None)
