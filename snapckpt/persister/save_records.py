"""The save records of a node persister (``Scheduler.results``) with the two indexes its scans need.

A job that saves every few steps for weeks holds 100,000 records; the scheduler's questions are about the few
saves still in flight (which earlier save of this directory must a writer wait for; which commits of a run to
wake; is a run still busy) and about one run's records (what a rank that died had accepted; which records to
prune). :class:`SaveRecords` maps ``(run id, step, dirname)`` to that save's records, ordered by generation
(:attr:`Result.gen <snapckpt.persister.scheduler.Result.gen>`; the newest last): as a mapping it gives the newest
record of each key, in creation order (a key saved again, :meth:`SaveRecords.push`, goes to the end); the
earlier ones, kept while something may still ask about them (the scheduler's rule: ``Scheduler._replace``), are
found by generation (:meth:`SaveRecords.find`) or read in order (:meth:`SaveRecords.records`). It keeps
alongside, on every insertion and removal:

- ``by_run``: run id -> its keys, each with its creation number (increasing, in mapping order);
- ``live``: ``(run id, dirname)`` -> the keys whose newest save may be in flight (``key -> creation number``). A
  key joins on insertion and whenever a writer or a commit of it starts (:meth:`track`), and leaves when it is
  removed or seen over (:meth:`settle`): a superset of the saves in flight, whose own state decides.

The scheduler keeps the records' in-flight and pruning rules; this module only holds them.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Dict, Iterator, List, Optional, Tuple

__all__ = ["SaveRecords"]

SaveKey = Tuple[str, int, str]  # (run id, step, dirname): one save


class SaveRecords(MutableMapping):
    """``SaveKey -> Result`` (the newest record of the key), indexed by run and, for the saves that may be in
    flight, by run and directory; each key's earlier records held with it (:meth:`records`)."""

    def __init__(self) -> None:
        self._recs: Dict[SaveKey, List] = {}  # key -> its records, oldest generation first
        self.by_run: Dict[str, Dict[SaveKey, int]] = {}
        self.live: Dict[Tuple[str, str], Dict[SaveKey, int]] = {}
        self._made = 0  # creation numbers handed out

    # ----------------------------------------------------------------------------- the newest records
    def __getitem__(self, key: SaveKey):
        return self._recs[key][-1]

    def get(self, key: SaveKey, default=None):
        recs = self._recs.get(key)
        return recs[-1] if recs is not None else default

    def __contains__(self, key) -> bool:
        return key in self._recs

    def __iter__(self) -> Iterator[SaveKey]:
        return iter(self._recs)

    def __len__(self) -> int:
        return len(self._recs)

    def __setitem__(self, key: SaveKey, res) -> None:
        """``res`` is ``key``'s newest record: the key's first, or in place of its newest (as in a dict, a key
        set again keeps its place)."""
        recs = self._recs.get(key)
        if recs is None:
            self._add(key, [res])
        else:
            recs[-1] = res
        self.track(key)

    def __delitem__(self, key: SaveKey) -> None:
        """Drop ``key`` with every record of it."""
        del self._recs[key]
        self._unindex(key)

    def clear(self) -> None:
        self._recs.clear()
        self.by_run.clear()
        self.live.clear()

    # ------------------------------------------------------------------------------- every generation
    def push(self, key: SaveKey, res) -> None:
        """``res`` is a new save of ``key`` (a later generation than its records'): its newest record, the others
        kept before it; the key goes to the end of the creation order, as a key removed and added again."""
        recs = self._recs.pop(key, [])
        self._unindex(key)
        recs.append(res)
        self._add(key, recs)
        self.track(key)

    def add_older(self, key: SaveKey, res) -> None:
        """Hold ``res`` (held ``key``; ``res.gen`` below its newest record's) among ``key``'s earlier records, in
        generation order (after those of the same generation)."""
        recs = self._recs[key]
        i = len(recs) - 1
        while i > 0 and recs[i - 1].gen > res.gen:
            i -= 1
        recs.insert(i, res)

    def records(self, key: SaveKey) -> List:
        """``key``'s records, oldest generation first, the newest last (``[]``: none held; do not modify)."""
        return self._recs.get(key, [])

    def find(self, key: SaveKey, gen: int):
        """``key``'s record of generation ``gen`` (``None``: none held)."""
        for res in self._recs.get(key, ()):
            if res.gen == gen:
                return res
        return None

    def keep_older(self, key: SaveKey, keep: Callable[[object], bool]) -> None:
        """Drop the records of ``key`` before its newest for which ``keep(record)`` is false."""
        recs = self._recs.get(key)
        if recs is not None and len(recs) > 1:
            recs[:-1] = [r for r in recs[:-1] if keep(r)]

    # ----------------------------------------------------------------------------------- the indexes
    def _add(self, key: SaveKey, recs: List) -> None:
        self._made += 1
        self._recs[key] = recs
        self.by_run.setdefault(key[0], {})[key] = self._made

    def _unindex(self, key: SaveKey) -> None:
        mine = self.by_run.get(key[0])
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self.by_run[key[0]]
        self.settle(key)

    def track(self, key: SaveKey) -> None:
        """Record ``key`` (held) as possibly in flight: a writer or a commit of it started."""
        n = self.by_run.get(key[0], {}).get(key)
        if n is not None:
            self.live.setdefault((key[0], key[2]), {})[key] = n

    def settle(self, key: SaveKey) -> None:
        """``key``'s save is no longer in flight (or no longer held): out of the in-flight index."""
        mine = self.live.get((key[0], key[2]))
        if mine is not None and mine.pop(key, None) is not None and not mine:
            del self.live[(key[0], key[2])]

    def order(self, key: SaveKey) -> Optional[int]:
        """The creation number of ``key``'s record (``None``: none held); a later record has a larger one."""
        return self.by_run.get(key[0], {}).get(key)

    def live_of(self, run_id: str, dirname: str) -> List[Tuple[int, SaveKey]]:
        """``(creation number, key)`` of the records of ``run_id`` and ``dirname`` that may be in flight, oldest
        first."""
        return sorted((n, k) for k, n in self.live.get((run_id, dirname), {}).items())

    def live_of_run(self, run_id: str) -> Iterator[SaveKey]:
        """The keys of ``run_id``'s records that may be in flight (a copy: the caller may settle them)."""
        return iter([k for (rid, _), keys in self.live.items() if rid == run_id for k in keys])

    def live_of_dir(self, dirname: str) -> Iterator[SaveKey]:
        """The keys of the records of any run under ``dirname`` that may be in flight."""
        return iter([k for (_, d), keys in self.live.items() if d == dirname for k in keys])

    def of_run(self, run_id: str) -> List[SaveKey]:
        """The keys of ``run_id``'s records, oldest first (a copy)."""
        return list(self.by_run.get(run_id, {}))
