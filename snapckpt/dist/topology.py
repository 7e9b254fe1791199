"""Who is where: rank, world size and the ranks on this node, from ``torch.distributed`` itself.

No launcher variable (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``...) is read (case C6): the ranks gather a host
identity (host name plus kernel boot id, so that two containers of one host that share ``/dev/shm``
share one node persister) and group by it.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Tuple


__all__ = ["Topology", "host_identity"]


def host_identity() -> str:
    """``hostname/boot_id`` of this machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class Topology:
    """Placement of this process.

    Attributes:
        rank, world_size: global rank and world size (0 and 1 without a process group).
        local_ranks: global ranks on this node, ascending (this rank included).
        node_index: index of this node among all nodes (ordered by their lowest rank).
        num_nodes: number of nodes.
    """

    rank: int
    world_size: int
    local_ranks: Tuple[int, ...]
    node_index: int
    num_nodes: int

    @property
    def local_rank(self) -> int:
        """Index of this rank among the ranks of its node."""
        return self.local_ranks.index(self.rank)

    @classmethod
    def from_hosts(cls, rank: int, hosts: list) -> "Topology":
        """Build from every rank's host identity (``hosts[r]`` for rank ``r``)."""
        mine = hosts[rank]
        order = []
        for h in hosts:
            if h not in order:
                order.append(h)
        local = tuple(r for r, h in enumerate(hosts) if h == mine)
        return cls(rank, len(hosts), local, order.index(mine), len(order))
