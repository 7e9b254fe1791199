"""Checkpoint coordination between ranks, on its own channel (contract 6 (docs/design/contracts.md)).

snapckpt never runs a collective on the training process group. Ranks agree through the
``torch.distributed`` key-value store that the process group was created with (a ``PrefixStore`` under
``snapckpt/``): each rank appends a small JSON record to the round's key and bumps a counter, the last
rank marks the round done, and every rank waits for that mark on the store's server with a deadline
(O(N) store operations per round, see :class:`StoreCoordinator`), so a rank that never arrives yields
:class:`~snapckpt.errors.RankTimeoutError` naming exactly the ranks that did not post (case C5), instead of a hang. Only the thread that called the
collective snapckpt API (``Checkpointer(...)``, ``load``, ``latest_step``) uses it; all ranks make those
calls in the same order, which numbers the rounds.

Keys are ``snapckpt/<job>/attempt<N>/<instance>/<round>/<name>/{records,count,done}``: the launch attempt (torchrun's
restart count) keeps a restarted attempt from reading the records of an earlier one in a store that
survived it (contract 12).

Without an initialized process group, :class:`LocalCoordinator` is a world of one.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from snapckpt._internal import env as _env
from snapckpt.errors import CoordinationError, RankTimeoutError

__all__ = ["Coordinator", "LocalCoordinator", "StoreCoordinator", "make_coordinator"]


class Coordinator:
    """All-gather of small JSON-able records among the ranks of a job, and the named operations built on
    it (the integrations' coordination seam: ``ck.coordinator``).

    Every operation is collective: all ranks call it, in the same order, with the same ``name`` (the name
    only labels the round in errors). Payloads are JSON-able dicts of a few hundred bytes. ``timeout_secs``
    defaults to :attr:`timeout_secs` (the Checkpointer's ``coordination_timeout_secs``).
    """

    rank: int = 0
    world_size: int = 1
    timeout_secs: float = 600.0

    def all_gather(self, name: str, payload: Dict[str, Any], timeout_secs: float) -> List[Dict[str, Any]]:
        """Post ``payload`` and return every rank's payload, indexed by rank.

        Raises:
            RankTimeoutError: some ranks did not post within ``timeout_secs`` (named in the message).
        """
        raise NotImplementedError

    def gather(self, name: str, payload: Dict[str, Any], timeout_secs: Optional[float] = None
               ) -> List[Dict[str, Any]]:
        """:meth:`all_gather` with the default timeout: every rank's ``payload``, indexed by rank."""
        return self.all_gather(name, payload, self.timeout_secs if timeout_secs is None else timeout_secs)

    def broadcast(self, name: str, value: Any = None, timeout_secs: Optional[float] = None) -> Any:
        """Rank 0's ``value`` (JSON-able) on every rank; other ranks' ``value`` is ignored. The way to let one
        process decide what every rank then does (case C2: one rank looks at the shared filesystem)."""
        return self.gather(name, {"v": value if self.rank == 0 else None}, timeout_secs)[0]["v"]

    def agree(self, name: str, error: "Optional[BaseException | str]" = None,
              timeout_secs: Optional[float] = None) -> Dict[int, str]:
        """Every rank's error of one step, so that all ranks take the same branch afterwards: ``{rank:
        "Type: message"}`` of the ranks that passed an error (``{}``: every rank succeeded)."""
        text = "" if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        everyone = self.gather(name, {"error": text}, timeout_secs)
        return {r: p["error"] for r, p in enumerate(everyone) if p["error"]}


class LocalCoordinator(Coordinator):
    """A world of one process."""

    def all_gather(self, name: str, payload: Dict[str, Any], timeout_secs: float) -> List[Dict[str, Any]]:
        return [json.loads(json.dumps(payload))]


class StoreCoordinator(Coordinator):
    """All-gather through a ``torch.distributed.Store`` in O(N) store operations per round.

    Each rank appends its record to one key of the round and bumps the round's counter (2 operations);
    the rank whose increment reaches ``world_size`` marks the round done; every rank waits for that mark
    on the store's server (no polling) and reads the records with one ``get``. A round therefore costs
    about ``4 N + 1`` store operations in all, instead of the ``N**2`` reads of a key per rank; its
    records are ``O(N)`` bytes read once by each rank. The last rank of round ``k`` also deletes the keys
    of round ``k - 1`` (every rank has read them: it posted in round ``k``), so a long job leaves two
    rounds of keys behind, not every round.

    Args:
        store: the process group's store (``TCPStore``/``FileStore``, possibly prefixed).
        rank, world_size: this process's global rank and the world size.
        prefix: key namespace of this Checkpointer instance (job key, launch attempt and instance number).
    """

    def __init__(self, store, rank: int, world_size: int, prefix: str) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(prefix, store)
        self.rank = rank
        self.world_size = world_size
        self.round = 0
        self._prev_base: Optional[str] = None

    def all_gather(self, name: str, payload: Dict[str, Any], timeout_secs: float) -> List[Dict[str, Any]]:
        from datetime import timedelta

        self.round += 1
        base = f"{self.round}/{name}"
        prev, self._prev_base = self._prev_base, base
        # one line per rank; json.dumps never emits a raw newline
        self.store.append(f"{base}/records", json.dumps({"r": self.rank, "p": payload}) + "\n")
        if self.store.add(f"{base}/count", 1) == self.world_size:
            self.store.set(f"{base}/done", "1")
            if prev is not None:
                for key in ("records", "count", "done"):
                    self.store.delete_key(f"{prev}/{key}")
        try:
            self.store.wait([f"{base}/done"], timedelta(seconds=max(timeout_secs, 0.001)))
        except Exception as e:  # the store's timeout error (DistStoreError), or the store went away
            raise self._timeout_error(base, name, timeout_secs, e) from e
        try:
            lines = self.store.get(f"{base}/records").decode().splitlines()
            records = [json.loads(line) for line in lines if line]
        except Exception as e:
            raise CoordinationError(f"could not read the records of snapckpt's {name!r}: {e}") from e
        out: List[Optional[Dict[str, Any]]] = [None] * self.world_size
        for rec in records:
            out[rec["r"]] = rec["p"]
        if any(p is None for p in out) or len(records) != self.world_size:
            raise CoordinationError(
                f"snapckpt's {name!r} got {len(records)} records for a world of {self.world_size} (this is rank "
                f"{self.rank}): two jobs share a store prefix, or ranks call snapckpt's collectives out of order")
        return out  # type: ignore[return-value]

    def broadcast(self, name: str, value: Any = None, timeout_secs: Optional[float] = None) -> Any:
        """Rank 0's ``value`` on every rank, in at most 3 store operations per rank: rank 0 sets the
        round's value and goes on without waiting; every other rank waits for it on the store's server,
        reads it and acknowledges; the rank whose acknowledgement completes the round deletes its keys.

        Raises:
            RankTimeoutError: rank 0 did not post within ``timeout_secs``.
        """
        from datetime import timedelta

        timeout = self.timeout_secs if timeout_secs is None else timeout_secs
        self.round += 1
        base = f"{self.round}/{name}"
        if self.rank == 0:
            self.store.set(f"{base}/value", json.dumps({"v": value}))
            return json.loads(json.dumps(value))
        try:
            self.store.wait([f"{base}/value"], timedelta(seconds=max(timeout, 0.001)))
            got = json.loads(self.store.get(f"{base}/value"))["v"]
        except Exception as e:
            raise RankTimeoutError(
                f"ranks [0] did not reach snapckpt's {name!r} within {timeout:g} s (this is rank {self.rank}); "
                f"the call is collective: every rank must make it, in the same order ({e})") from e
        if self.store.add(f"{base}/acks", 1) == self.world_size - 1:
            self.store.delete_key(f"{base}/value")
            self.store.delete_key(f"{base}/acks")
        return got

    def _timeout_error(self, base: str, name: str, timeout_secs: float, cause: BaseException) -> BaseException:
        """The error of a round that did not complete: the ranks that did not post, by name."""
        try:
            posted = set()
            if self.store.check([f"{base}/records"]):
                for line in self.store.get(f"{base}/records").decode().splitlines():
                    if line:
                        posted.add(json.loads(line)["r"])
        except Exception as e:
            return CoordinationError(f"snapckpt's {name!r} failed: the store is unreachable ({cause}; then {e})")
        missing = [r for r in range(self.world_size) if r not in posted]
        if not missing:
            return CoordinationError(f"snapckpt's {name!r} did not complete although every rank posted ({cause})")
        return RankTimeoutError(
            f"ranks {missing} did not reach snapckpt's {name!r} within {timeout_secs:g} s (this is "
            f"rank {self.rank}); the call is collective: every rank must make it, in the same order")


_instances = 0


def make_coordinator(job: str, timeout_secs: float = 600.0) -> Coordinator:
    """A coordinator for a new Checkpointer of job ``job``: store-based when ``torch.distributed`` is
    initialized, local otherwise; ``timeout_secs`` is its operations' default timeout. Every rank must
    create its Checkpointers in the same order."""
    global _instances
    import torch.distributed as dist

    _instances += 1
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        coord: Coordinator = LocalCoordinator()
    else:
        from snapckpt._internal.compat import check_torch

        check_torch([("torch.distributed.distributed_c10d", "_get_default_store")])
        from torch.distributed.distributed_c10d import _get_default_store

        # The attempt is part of every key: torchrun's rendezvous store outlives a restart of the workers
        # (--max_restarts), and a restarted attempt numbers its rounds from 1 again (contract 12, case G5).
        coord = StoreCoordinator(_get_default_store(), dist.get_rank(), dist.get_world_size(),
                                 f"snapckpt/{job}/attempt{_env.launch_attempt()}/{_instances}/")
    coord.timeout_secs = timeout_secs
    return coord
