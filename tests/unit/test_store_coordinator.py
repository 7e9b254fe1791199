"""The store coordinator (snapckpt/dist/coordination.py) over a real ``TCPStore`` and ``FileStore``: ranks
are threads here, each with its own store client, as torch gives each process one (contract 6)."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from snapckpt.dist.coordination import StoreCoordinator
from snapckpt.errors import RankTimeoutError

PREFIX = "snapckpt/job/attempt0/1/"


def _stores(kind: str, n: int, tmp_path):
    if kind == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, n, True, timedelta(seconds=30), wait_for_workers=False)
        return [server] + [dist.TCPStore("127.0.0.1", server.port, n, False, timedelta(seconds=30))
                           for _ in range(n - 1)]
    return [dist.FileStore(str(tmp_path / "store"), n) for _ in range(n)]


def _run_ranks(stores, rounds):
    n = len(stores)
    results, errors = [None] * n, []

    def rank(r):
        try:
            c = StoreCoordinator(stores[r], r, n, PREFIX)
            results[r] = [c.all_gather("latest", {"rank": r, "round": k}, timeout_secs=30) for k in range(rounds)]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("kind,n", [("tcp", 16), ("file", 4)])
def test_every_rank_gets_every_record_in_rank_order_and_old_rounds_are_deleted(kind, n, tmp_path):
    stores = _stores(kind, n, tmp_path)
    keys_before = stores[0].num_keys()
    results = _run_ranks(stores, rounds=6)
    for r in range(n):
        for k in range(6):
            assert results[r][k] == [{"rank": q, "round": k} for q in range(n)], (r, k)
    # only the last round's three keys (records, count, done) remain, not one per rank per round
    assert stores[0].num_keys() - keys_before == 3


def test_a_rank_that_never_posts_is_named_at_the_deadline(tmp_path):
    stores = _stores("tcp", 3, tmp_path)
    got = {}

    def rank(r):
        try:
            StoreCoordinator(stores[r], r, 3, PREFIX).all_gather("latest", {}, timeout_secs=1.0)
        except RankTimeoutError as e:
            got[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(got) == {0, 1}
    assert all("ranks [2] did not reach snapckpt's 'latest' within 1 s" in m for m in got.values()), got
    stores[0].set("still", "usable")  # the store survives a timed-out wait
    assert stores[1].get("still") == b"usable"
