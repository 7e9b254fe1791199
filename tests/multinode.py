"""Multi-node test rig: N simulated nodes on this host, sharing one checkpoint directory.

Each node is a long-lived *holder* process started with ``unshare --uts --mount --propagation private``:
its own host name (``node0``, ``node1``...), a private tmpfs on ``/dev/shm`` (its memory tier) and on the
snapckpt runtime directory (its persister's socket, lock and token), and optionally private tmpfs mounts
over other paths (a checkpoint directory that is node-local by mistake, case G7). Commands run inside a
node through ``nsenter --target <holder> --uts --mount``; the network namespace stays shared, so every
node reaches the rendezvous on 127.0.0.1 (nodes with their own addresses, network namespaces and veth
pairs, are not built yet). Every process of a node is found by its mount namespace,
whoever started it (torchrun, its workers, the persister the first rank spawned), while that namespace lives:
once a node is lost or closed its namespace's inode may be reused by another test's node, so a gone node
finds no process (a teardown that scanned by a stale inode killed a concurrent test's torchrun in CI).

* :meth:`Rig.lose_node` kills every process of the node with SIGKILL (trainers, agent, persister, holder);
  with its last process its mount namespace and its tmpfs mounts disappear: a lost node.
* :meth:`Rig.kill_trainers` kills the node's training processes (torchrun and its workers) only; its
  persister lives on. :meth:`Rig.kill_all_trainers` does it for every node in one sweep.
* :meth:`Rig.replace_node` starts a fresh node under the same name (empty memory).
* :meth:`Rig.wait_all` waits for every node's agent at once and fails as soon as one exits non-zero (an agent
  whose workers succeeded waits up to 300 s in torchrun's exit barrier: node 1's failure looked like node 0
  hanging); :meth:`Rig.hang_report` (on a failure or a timeout) SIGABRTs what still runs, whose Python stacks
  then end its output (``PYTHONFAULTHANDLER``), and gathers every node's output and persister log.

Needs root (``unshare --mount`` and ``nsenter``), as CI runs. Use the ``rig`` fixture of
``tests/conftest.py``; teardown kills every process of every node and checks none is left.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence

import psutil

from _harness import REPO, wait_until
from _ports import RendezvousPortTaken, free_port, port_taken, retry_on_port_taken, wait_listening

__all__ = ["Node", "NodeRun", "Rig", "rig_available"]


def _mnt_ns(pid: int) -> Optional[str]:
    """The mount namespace of ``pid`` (``mnt:[inode]``), None when the process is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def rig_available() -> Optional[str]:
    """None when this host can run the rig; else why not (the reason a test reports)."""
    if os.geteuid() != 0:
        return "the multi-node rig needs root (unshare --mount, nsenter), as CI runs"
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"the multi-node rig needs {tool} (util-linux)"
    return None


class NodeRun:
    """One command (usually a torchrun agent) running inside a node; output goes to a log file."""

    def __init__(self, node: "Node", proc: subprocess.Popen, log_path: str, what: str) -> None:
        self.node, self.proc, self.log_path, self.what = node, proc, log_path, what

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def output(self) -> str:
        """Everything the command printed so far (stdout and stderr)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait(self, timeout: float = 120) -> int:
        """Wait for the command; return its exit status. On timeout raise with every node's state
        (:meth:`Rig.hang_report`: the trainers' stacks, then they are killed)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.node.name}: {self.what} hung past {timeout} s\n"
                                 + self.node.rig.hang_report()) from None


class Node:
    """One simulated node: a namespace holder process and the paths private to it.

    Attributes:
        index: the node's index ``i`` (its host name is ``node<i>``).
        env: environment of every process run in the node (``SNAPCKPT_RUNTIME_DIR`` / ``SNAPCKPT_SHM_DIR``
            point inside the node's private tmpfs mounts).
        holder: the holder process (its pid anchors the node's namespaces).
        mnt_ns: the node's mount namespace (``mnt:[inode]``).
    """

    def __init__(self, rig: "Rig", index: int, private_paths: Sequence[str] = ()) -> None:
        self.rig, self.index, self.name = rig, index, f"node{index}"
        self.private_paths = list(private_paths)
        self.runs: List[NodeRun] = []
        self.env = dict(rig.env)
        self.env.update({"SNAPCKPT_RUNTIME_DIR": rig.runtime_dir, "SNAPCKPT_SHM_DIR": rig.shm_dir})
        mounts = [rig.runtime_dir, *self.private_paths]
        for p in mounts:
            os.makedirs(p, exist_ok=True)  # a mount point must exist; on the host it stays empty
        script = (f"set -e; hostname {self.name}; mount -t tmpfs -o mode=0700 tmpfs /dev/shm; "
                  + "".join(f"mount -t tmpfs -o mode=0700 tmpfs '{p}'; " for p in mounts)
                  + f"mkdir -p -m 0700 '{rig.shm_dir}'; echo ready; exec sleep infinity")
        self.holder = subprocess.Popen(["unshare", "--uts", "--mount", "--propagation", "private", "--",
                                        "bash", "-c", script],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            rest = self.holder.communicate(timeout=10)[0] if self.holder.poll() is not None else ""
            self.holder.kill()
            raise RuntimeError(f"{self.name}: the namespace holder did not start: {line}{rest}")
        self.holder.stdout.close()
        self.mnt_ns = _mnt_ns(self.holder.pid)
        self.gone = False  # set once no process is left in the namespace (lost or closed)
        assert self.mnt_ns and self.mnt_ns != _mnt_ns(os.getpid()), f"{self.name}: no private mount namespace"

    # -- inside the node -------------------------------------------------------------------------

    def path(self, p: str) -> str:
        """``p`` as this node sees it, reachable from the host (``/proc/<holder>/root/<p>``)."""
        return f"/proc/{self.holder.pid}/root{p}"

    def popen(self, argv: Sequence[str], log_name: str, env: Optional[Dict[str, str]] = None) -> NodeRun:
        """Start ``argv`` inside the node (cwd: the repository), output to ``<rig.tmp>/<log_name>``."""
        e = dict(os.environ)
        e.update(self.env)
        e.update(env or {})
        log_path = os.path.join(self.rig.tmp, log_name)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["nsenter", "--target", str(self.holder.pid), "--uts", "--mount",
                                     f"--wd={REPO}", "--", *argv],
                                    env=e, stdout=log, stderr=subprocess.STDOUT)
        run = NodeRun(self, proc, log_path, " ".join(argv[:6]))
        self.runs.append(run)
        return run

    def run(self, argv: Sequence[str], timeout: float = 60, env: Optional[Dict[str, str]] = None) -> str:
        """Run ``argv`` inside the node to completion; return its output; raise if it fails."""
        e = dict(os.environ)
        e.update(self.env)
        e.update(env or {})
        cp = subprocess.run(["nsenter", "--target", str(self.holder.pid), "--uts", "--mount",
                             f"--wd={REPO}", "--", *argv], env=e, capture_output=True, text=True,
                            timeout=timeout)
        assert cp.returncode == 0, f"{self.name}: {argv} exited {cp.returncode}:\n{cp.stdout}{cp.stderr}"
        return cp.stdout

    def run_torchrun(self, script: str, args: Sequence[str], nproc_per_node: int, nnodes: int,
                     node_rank: int, master_port: int, env: Optional[Dict[str, str]] = None,
                     max_restarts: int = 0) -> NodeRun:
        """Start ``torchrun --nnodes N --node-rank i --master-addr 127.0.0.1 --master-port P
        --nproc-per-node K script args`` in this node (static rendezvous; node rank 0 hosts the store)."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts), script, *args]
        e = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        e.update(env or {})
        n = len(self.runs)
        return self.popen(argv, f"{self.name}-{os.getpid()}-{id(self)}-run{n}.log", e)

    # -- processes ---------------------------------------------------------------------------------

    def pids(self) -> List[int]:
        """Every live (non-zombie) process in this node's mount namespace, the holder included.

        Namespaces are read from ``/proc`` and psutil is asked about the matches only (tests poll this while
        they wait; a ``psutil.process_iter`` over every process cost about 10x the CPU)."""
        out = []
        if self.gone:  # its namespace is freed: the kernel may give its inode to another test's node
            return out
        for name in os.listdir("/proc"):
            if not name.isdigit() or _mnt_ns(int(name)) != self.mnt_ns:
                continue
            try:
                if psutil.Process(int(name)).status() != psutil.STATUS_ZOMBIE:
                    out.append(int(name))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def persisters(self) -> List[int]:
        """Pids of the node's persister processes."""
        return [pid for pid in self.pids() if _is_persister(pid)]

    def trainers(self) -> List[int]:
        """Pids of the node's training processes: everything but the holder and the persister."""
        return [pid for pid in self.pids() if pid != self.holder.pid and not _is_persister(pid)]

    def shm_files(self) -> List[str]:
        """Files under the node's shared-memory directory (its memory tier), as the node sees them."""
        root = self.path(self.rig.shm_dir)
        out = []
        for r, _, files in os.walk(root):
            out += [os.path.join(r, f)[len(self.path("")):] for f in files]
        return out

    def persister_log(self) -> str:
        """The text of the node's persister logs (under its private runtime directory)."""
        out = ""
        for path in glob.glob(self.path(f"{self.rig.runtime_dir}/snapckpt-*/*/persister.log")):
            with open(path, errors="replace") as f:
                out += f.read()
        return out

    @property
    def alive(self) -> bool:
        return self.holder.poll() is None

    def _reap(self) -> None:
        for r in self.runs:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                r.proc.kill()
        try:
            self.holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self, pids: Sequence[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _is_persister(pid: int) -> bool:
    try:
        return "snapckpt.persister" in psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class Rig:
    """N simulated nodes sharing ``ckpt_dir`` (see the module docstring).

    Attributes:
        nodes: the nodes, ``nodes[i]`` named ``node<i>`` (a replaced node takes the same index).
        ckpt_dir: the shared checkpoint directory (a plain host directory: the shared filesystem).
        tmp: a host directory for logs and loss files.
        runtime_dir, shm_dir: the same paths in every node, each node with its own contents.
    """

    def __init__(self, tmp: str, ckpt_dir: str) -> None:
        why = rig_available()
        if why:
            raise RuntimeError(why)
        key = uuid.uuid4().hex[:8]
        self.tmp, self.ckpt_dir = tmp, ckpt_dir
        self.base = f"/tmp/mn-{key}"  # short: the persister's AF_UNIX socket lives under runtime_dir
        self.runtime_dir = f"{self.base}/run"
        self.shm_dir = f"/dev/shm/snapckpt-mn-{key}"
        # a SIGABRT makes every Python process of a node print each thread's stack first (hang_report)
        self.env: Dict[str, str] = {"PYTHONFAULTHANDLER": "1"}
        self.nodes: List[Node] = []
        self._all: List[Node] = []

    def start(self, n: int, private_paths: Optional[Dict[int, Sequence[str]]] = None) -> List[Node]:
        """Start nodes ``0..n-1``; ``private_paths[i]`` lists paths node ``i`` mounts a private tmpfs over."""
        private_paths = private_paths or {}
        for i in range(n):
            self._add(Node(self, i, private_paths.get(i, ())))
        return self.nodes

    def _add(self, node: Node) -> None:
        self._all.append(node)
        if node.index < len(self.nodes):
            self.nodes[node.index] = node
        else:
            self.nodes.append(node)

    def port(self) -> int:
        """A reserved port (``free_port``) for a rendezvous the test starts itself (prefer :meth:`torchrun_all`,
        which retries a launch whose port was taken)."""
        return free_port()

    def torchrun_all(self, script: str, args: Sequence[str], nproc_per_node: int,
                     env: Optional[Dict[str, str]] = None, port: Optional[int] = None,
                     node_ranks: Optional[Sequence[int]] = None, nodes: Optional[Sequence[int]] = None,
                     node_env: Optional[Dict[int, Dict[str, str]]] = None,
                     store_timeout: float = 120) -> List[NodeRun]:
        """Start one torchrun agent per node on a fresh port; node ``i`` gets node rank ``node_ranks[i]``
        (default ``i``; a permutation moves every rank to another node, as a restart on a new allocation can).
        ``nodes``: the indices of the nodes that take part (default all; ``node_ranks`` follows their order);
        ``node_env[i]``: more environment for node ``i``.

        Returns once node rank 0's agent listens on the port (it hosts the store), or has exited, or
        ``store_timeout`` seconds passed. With no ``port`` given, a launch whose node rank 0 failed because the
        port was taken (``port_taken``: that exact error) is started again on a fresh port, at most
        ``PORT_RETRIES`` times, each retry noted: the other agents, waiting on that port, are killed first."""
        idx = list(nodes) if nodes is not None else list(range(len(self.nodes)))
        ranks = list(node_ranks) if node_ranks is not None else list(range(len(idx)))
        assert sorted(ranks) == list(range(len(idx))), ranks
        def once() -> List[NodeRun]:
            p = port or free_port()
            runs = [self.nodes[i].run_torchrun(script, args, nproc_per_node, len(idx), ranks[k], p,
                                               dict(env or {}, **(node_env or {}).get(i, {})))
                    for k, i in enumerate(idx)]
            host = runs[ranks.index(0)]
            if wait_listening(host.proc.pid, p, store_timeout) or host.returncode is None:
                return runs
            out = host.output()
            if not port and port_taken(out, p):
                raise RendezvousPortTaken(p, out, result=runs)
            return runs

        def kill(runs: List[NodeRun]) -> None:
            for r in runs:
                if r.returncode is None:
                    r.proc.kill()
                r.proc.wait(timeout=30)
        return retry_on_port_taken(f"Rig.torchrun_all({os.path.basename(script)})", once, before_retry=kill)

    def kill_trainers(self, i: int) -> List[int]:
        """SIGKILL every training process of node ``i`` (torchrun agent and workers) at once; its
        persister and holder live. Returns the pids killed (after they are gone)."""
        node = self.nodes[i]
        pids = node.trainers()
        node.kill(pids)
        assert wait_until(lambda: not set(pids) & set(node.trainers()), 15), f"{node.name}: trainers survived"
        return pids

    def wait_all(self, runs: Sequence[NodeRun], timeout: float = 120) -> List[int]:
        """Wait for every run (one per node, e.g. from :meth:`torchrun_all`), all within ``timeout`` seconds;
        return their exit statuses. Raises with :meth:`hang_report` when one exits non-zero while another
        still runs (torchrun's agent whose workers succeeded waits up to 300 s in its exit barrier for the
        other nodes' agents: waiting on node 0 alone made node 1's failure look like a hang of node 0), or
        when the timeout passes."""
        deadline = time.monotonic() + timeout
        while any(r.returncode is None for r in runs):
            failed = [r for r in runs if r.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                what = (f"{failed[0].node.name} exited {failed[0].returncode} while other nodes still ran"
                        if failed else f"not every node exited within {timeout} s")
                raise AssertionError(what + "\n" + self.hang_report())
            time.sleep(0.2)
        return [r.returncode for r in runs]

    def hang_report(self) -> str:
        """Every node's state for a failure message: the trainers still running get SIGABRT (their Python
        stacks go to the run's output: ``PYTHONFAULTHANDLER``), then SIGKILL; then each node's newest run
        (exit status, output tail) and persister log tail."""
        trainers = [(n, n.trainers()) for n in self.nodes]
        for n, pids in trainers:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
        for n, pids in trainers:
            wait_until(lambda: not set(pids) & set(n.trainers()), 10, 0.1)
            n.kill(n.trainers())
        out = []
        for n in self.nodes:
            run = n.runs[-1] if n.runs else None
            if run is not None:
                try:
                    run.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                out.append(f"--- {n.name}: {run.what} exit status {run.returncode}; output (the stacks of the "
                           f"processes it still had, from SIGABRT, at the end):\n{run.output()[-8000:]}")
            out.append(f"--- {n.name} persister log (tail):\n{n.persister_log()[-3000:]}")
        return "\n".join(out)

    def kill_all_trainers(self) -> None:
        """SIGKILL the training processes of every node in one sweep (no node gets a head start)."""
        per = [(n, n.trainers()) for n in self.nodes]
        for n, pids in per:
            n.kill(pids)
        for n, pids in per:
            assert wait_until(lambda: not set(pids) & set(n.trainers()), 15), f"{n.name}: trainers survived"

    def lose_node(self, i: int) -> None:
        """Node ``i`` is lost: SIGKILL every process in its mount namespace (trainers, persister, holder).
        With its last process the namespace and its private tmpfs mounts (memory tier, runtime directory)
        are gone; asserted by no process being left in that namespace."""
        node = self.nodes[i]
        for _ in range(5):  # a process may fork while we kill
            pids = node.pids()
            if not pids:
                break
            node.kill(pids)
            wait_until(lambda: not node.pids(), 5)
        assert not node.pids(), f"{node.name}: processes survived the node loss: {node.pids()}"
        node._reap()
        node.gone = True

    def replace_node(self, i: int, private_paths: Sequence[str] = ()) -> Node:
        """Start a fresh node under the name ``node<i>`` (the old one must be lost first)."""
        assert not self.nodes[i].alive, f"node{i} is still up: lose it first"
        node = Node(self, i, private_paths)
        self._add(node)
        return node

    def close(self) -> List[str]:
        """Kill every process of every node; remove the rig's directories. Returns the names of nodes
        that still had processes (the caller decides whether that is a leak)."""
        leftover = []
        for node in self._all:
            others = [pid for pid in node.pids() if pid != node.holder.pid]
            if others:
                leftover.append(f"{node.name}: pids {others} (persisters {node.persisters()})")
            if node.alive or node.pids():
                for _ in range(5):
                    pids = node.pids()
                    if not pids:
                        break
                    node.kill(pids)
                    wait_until(lambda: not node.pids(), 5)
            node._reap()
            node.gone = not node.pids()
        shutil.rmtree(self.base, ignore_errors=True)
        return leftover


def loss_lines(text: str) -> Dict[int, str]:
    """``{step: loss repr}`` from ``step N loss X`` lines (the later line wins for a repeated step)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            out[int(parts[1])] = parts[3]
    return out
