"""The save records of a node persister (``Scheduler.results``) with the two indexes its scans need.

A job that saves every few steps for weeks holds 100,000 records; the scheduler's questions are about the few
saves still in flight (which earlier save of this directory must a writer wait for; which commits of a run to
wake; is a run still busy) and about one run's records (what a rank that died had accepted; which records to
prune). :class:`SaveRecords` is the ``(run id, step, dirname) -> Result`` dict, in creation order as before
(a record removed and added again goes to the end), and keeps alongside, on every insertion and removal:

- ``by_run``: run id -> its records' keys, each with its creation number (increasing, in dict order);
- ``live``: ``(run id, dirname)`` -> the records that may be in flight (``key -> creation number``). A record
  joins on insertion and whenever a writer or a commit of it starts (:meth:`track`), and leaves when it is
  removed or seen over (:meth:`settle`): a superset of the saves in flight, whose own state decides.

The scheduler keeps the records' in-flight rule; this module only holds keys.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

__all__ = ["SaveRecords"]

SaveKey = Tuple[str, int, str]  # (run id, step, dirname): one save


class SaveRecords(dict):
    """``SaveKey -> Result``, indexed by run and, for the saves that may be in flight, by run and directory.

    Only the mutations below are supported (``update``, ``popitem`` and ``|=`` raise ``TypeError``), so that
    the indexes never miss a record.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_run: Dict[str, Dict[SaveKey, int]] = {}
        self.live: Dict[Tuple[str, str], Dict[SaveKey, int]] = {}
        self._made = 0  # creation numbers handed out

    # ------------------------------------------------------------------------------------ mutations
    def __setitem__(self, key: SaveKey, res) -> None:
        if key not in self:  # (a record replaced in place keeps its place, as in a dict)
            self._made += 1
            self.by_run.setdefault(key[0], {})[key] = self._made
        super().__setitem__(key, res)
        self.track(key)

    def setdefault(self, key: SaveKey, default=None):
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def __delitem__(self, key: SaveKey) -> None:
        super().__delitem__(key)
        self._unindex(key)

    _MISSING = object()

    def pop(self, key: SaveKey, default=_MISSING):
        if key in self:
            res = super().pop(key)
            self._unindex(key)
            return res
        if default is SaveRecords._MISSING:
            raise KeyError(key)
        return default

    def clear(self) -> None:
        super().clear()
        self.by_run.clear()
        self.live.clear()

    def update(self, *args, **kwargs):
        raise TypeError("SaveRecords.update: set records one by one")

    def popitem(self):
        raise TypeError("SaveRecords.popitem: pop a record by its key")

    def __ior__(self, other):
        raise TypeError("SaveRecords |=: set records one by one")

    def _unindex(self, key: SaveKey) -> None:
        mine = self.by_run.get(key[0])
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self.by_run[key[0]]
        self.settle(key)

    # ----------------------------------------------------------------------------------- the index
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
