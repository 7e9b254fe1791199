"""Setting up the peer channel at a Checkpointer's start: the peer-memory tier (the persister side is
:mod:`snapckpt.persister.replication`) and the commit notices (:mod:`snapckpt.persister.commit_notices`).

Sequence (collective, at construction, after every rank connected to its node persister; one node ends
here at once):

1. rank 0's ``replicas`` (option, ``SNAPCKPT_REPLICAS``, default 1 on several nodes) is broadcast: every
   rank takes the same branch;
2. each rank asks its persister to listen for peers on this node's address (``replica_listen``; the
   persister listens once) and posts that address and port; rank 0 also posts the run's secret, 32 random
   bytes drawn now: the rendezvous store is the only place it travels (one all-gather). With
   ``replicas=0`` a persister that cannot listen posts port 0: its node then gets no commit notices and
   learns of commits from the filesystem's backstop re-check (a second) instead;
3. each rank gives its persister the secret, the target nodes of this node (the ``replicas`` next nodes in
   ring order of node index; none with ``replicas=0``), every node's address, this node's index and the
   committer's (the node of global rank 0) (``replica_peers``).

The result, :class:`PeerMap`, is what the loader needs to fetch a snapshot from another node.
"""
from __future__ import annotations

import logging
import secrets
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from snapckpt._internal import env as _env
from snapckpt.dist.coordination import Coordinator
from snapckpt.dist.topology import Topology
from snapckpt.engine.session import PersisterSession
from snapckpt.errors import PersisterError
from snapckpt.options import CheckpointOptions

__all__ = ["PeerMap", "setup_replicas", "advertised_addr"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerMap:
    """The node persisters' peer addresses of this run.

    Attributes:
        replicas: number of replicas of each node's snapshots (>= 1).
        addrs: node index -> ``(address, TCP port)`` of that node's persister.
        node_of_rank: global rank -> node index (this run's placement).
    """

    replicas: int
    addrs: Dict[int, Tuple[str, int]]
    node_of_rank: Tuple[int, ...]


def advertised_addr() -> str:
    """The address this node's persister listens on: ``SNAPCKPT_REPLICA_ADDR``, else the local address of
    the route to ``MASTER_ADDR`` (the interface the job's own traffic uses), else this host name's address."""
    addr = _env.replica_addr()
    if addr:
        return addr
    master = _env.master_addr()
    if master:
        try:
            family = socket.AF_INET6 if ":" in master else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def setup_replicas(options: CheckpointOptions, topology: Topology, coord: Coordinator, session: PersisterSession,
                   timeout_secs: float) -> Optional[PeerMap]:
    """Steps 1-3 of the module docstring; ``None`` when the run has no peer replicas (one node, or
    ``replicas=0``: the channel then carries the commit notices only).

    Raises:
        ValueError: ``SNAPCKPT_REPLICAS`` is malformed (on rank 0).
        RankTimeoutError: some ranks did not reach the setup in time.
        PersisterError: with replicas, the persister could not listen (the address is not this host's: set
            ``SNAPCKPT_REPLICA_ADDR``).
    """
    if topology.num_nodes < 2:
        return None
    mine = options.resolved_replicas(topology.num_nodes) if coord.rank == 0 else None
    k = int(coord.broadcast("replicas", mine, timeout_secs))
    addr = advertised_addr()
    try:
        port = int(session.request("replica_listen", addr=addr)["port"])
    except (PersisterError, OSError) as e:
        if k > 0:
            raise
        log.warning("rank %d: this node's persister cannot listen for its peers on %s (%s); commits are "
                    "still detected, from the shared filesystem within a second (set SNAPCKPT_REPLICA_ADDR "
                    "to this host's address)", coord.rank, addr, e)
        port = 0
    secret = secrets.token_hex(32) if coord.rank == 0 else ""
    everyone = coord.all_gather("replica peers", {"addr": addr, "port": port, "node": topology.node_index,
                                                  "secret": secret}, timeout_secs)
    addrs: Dict[int, Tuple[str, int]] = {}
    for p in everyone:  # the lowest rank of each node speaks for it (its ranks share one persister)
        addrs.setdefault(int(p["node"]), (str(p["addr"]), int(p["port"])))
    n = topology.num_nodes
    targets: List[Dict[str, object]] = []
    for i in range(1, k + 1):
        node = (topology.node_index + i) % n
        targets.append({"node": node, "addr": addrs[node][0], "port": addrs[node][1]})
    nodes = [{"node": i, "addr": a, "port": p} for i, (a, p) in sorted(addrs.items())]
    session.request("replica_peers", secret=everyone[0]["secret"], targets=targets, nodes=nodes,
                    node=topology.node_index, committer_node=int(everyone[0]["node"]))
    if k <= 0:
        return None
    if coord.rank == 0:
        log.info("peer replicas: each node's memory snapshots are copied to the next %d node(s): %s", k,
                 {i: f"{a}:{p}" for i, (a, p) in sorted(addrs.items())})
    return PeerMap(k, addrs, tuple(int(p["node"]) for p in everyone))
