"""Group commit of a node's parts: the fsyncs of every part the persister has written meanwhile, together.

Each rank's part needs its files fsynced, then its part marker written and fsynced, then the marker's
directory fsynced (contract 4, :mod:`snapckpt.persister.commit`). Done part by part, one node persister
serving N ranks pays about 3N fsyncs one after another, and the commit waits for the last of them. Here
the writer tasks only write the files (:func:`snapckpt.persister.writer.write_part_data`) and hand the
part over; one thread takes every part handed over so far as a batch and runs
:func:`~snapckpt.persister.writer.finish_parts` on it: the batch's fsyncs run concurrently (the
filesystem commits its journal once for all of them: ext4/XFS group commit), then its markers, then one
fsync per marker directory. Parts handed over while a batch is being synced form the next batch, so the
number of fsync rounds per commit stays about the same whatever the number of ranks on the node.

Ordering is unchanged: a part's marker is written only after that part's files are durable, and the
part is reported done only once its marker and the marker's directory are durable.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import List, Optional, Tuple

from snapckpt.persister.writer import WrittenPart, finish_parts

log = logging.getLogger("snapckpt.persister")

__all__ = ["PartSyncer"]


class PartSyncer:
    """The node persister's batcher of written parts (one per :class:`~snapckpt.persister.scheduler.Scheduler`).

    Args:
        max_parallel: fsync calls in flight at once (threads, started as needed).
    """

    def __init__(self, max_parallel: int = 16) -> None:
        self._cv = threading.Condition()
        self._queue: List[Tuple[WrittenPart, cf.Future]] = []
        self._pool = cf.ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="snapckpt-fsync")
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, part: WrittenPart) -> cf.Future:
        """Queue ``part`` for the next batch. The future's result is the part's file records once its marker
        is durable; its exception is the part's error (``OSError`` from fsync or the marker's write; the
        part's descriptors are closed either way). Callbacks run on the batch thread.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        fut: cf.Future = cf.Future()
        with self._cv:
            if self._closed:
                part.close()
                raise RuntimeError("the part syncer is shut down")
            self._queue.append((part, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="snapckpt-part-sync", daemon=True)
                self._thread.start()
            self._cv.notify()
        return fut

    def shutdown(self) -> None:
        """Finish the parts queued so far, then stop (at exit)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            try:
                errors = finish_parts([p for p, _ in batch], self._pool)
            except BaseException as e:  # not expected: finish_parts returns the parts' errors
                log.exception("syncing a batch of %d parts failed", len(batch))
                for p, _ in batch:
                    p.close()
                errors = [e] * len(batch)
            for (part, fut), err in zip(batch, errors):
                if err is None:
                    fut.set_result(part.files)
                else:
                    fut.set_exception(err)
