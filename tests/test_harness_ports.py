"""The harness's TCP ports (tests/_ports.py): a port drawn by one process is never drawn by another while it is
reserved, and a launch whose rendezvous port an outside process took is started again on a fresh port (only
for that exact error)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

import _harness
import _ports
from _harness import WORKERS, result_lines
from _ports import PortRetryWarning, RendezvousPortTaken

TESTS = os.path.dirname(os.path.abspath(__file__))


def _bindable_block(n: int) -> int:
    """The first port of ``n`` consecutive ports of 10000-19999 free on 127.0.0.1 now (below the range the
    harness draws from, so that no concurrent test's draw is disturbed)."""
    starts = list(range(10000, 20000 - n, n))
    random.shuffle(starts)
    for lo in starts:
        if all(_ports._bindable(p) for p in range(lo, lo + n)):
            return lo
    raise RuntimeError(f"no {n} consecutive free ports in 10000-19999")


@pytest.fixture
def small_range(tmp_path, monkeypatch):
    """This process draws from 4 free ports with its own lock directory; yields ``(lo, hi)``."""
    lo = _bindable_block(4)
    monkeypatch.setattr(_ports, "PORT_RANGE", (lo, lo + 4))
    monkeypatch.setattr(_ports, "LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(_ports, "_held", {})
    yield lo, lo + 4
    _ports.release_ports(list(_ports._held))  # the patched table: the autouse release sees the real one


DRAWER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import _ports
lo, n = int(sys.argv[3]), int(sys.argv[4])
_ports.PORT_RANGE, _ports.LOCK_DIR = (lo, lo + n), sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()                      # "go": both processes draw at once
ports = []
for _ in range(n // 2):
    try:
        ports.append(_ports.free_port())
    except RuntimeError as e:
        ports.append(str(e))
print(json.dumps(ports), flush=True)
sys.stdin.read()                          # hold every reservation until the parent has both answers
"""


def test_two_processes_drawing_at_once_never_get_the_same_port(tmp_path):
    """Two processes draw 8 ports each at the same moment from the same 16 free ports (the range forced small,
    a private lock directory) and hold them: every port is handed out once, so the 16 draws are the 16 ports.
    (A free_port that checks a port with a bind and releases it hands the same ports to both, and to one
    process twice: all 16 distinct by chance has odds 16!/16**16, about 1 in 10**6.)"""
    n = 16
    lo = _bindable_block(n)
    procs = [subprocess.Popen([sys.executable, "-c", DRAWER, TESTS, str(tmp_path / "locks"), str(lo), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        drawn = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    ports = drawn[0] + drawn[1]
    assert sorted(ports) == list(range(lo, lo + n)), drawn


def test_a_reserved_port_is_drawn_again_only_once_released(small_range):
    """In one process: the 4 ports are drawn once each, a 5th draw raises; a released port can be drawn again;
    a session reservation outlives :func:`release_ports` with no argument."""
    lo, hi = small_range
    got = [_ports.free_port() for _ in range(3)] + [_ports.free_port(session=True)]
    assert sorted(got) == list(range(lo, hi))
    with pytest.raises(RuntimeError, match="no free TCP port"):
        _ports.free_port()
    _ports.release_ports([got[0]])
    assert _ports.free_port() == got[0]
    _ports.release_ports()
    assert _ports.held_ports() == {got[3]: True}
    assert _ports.free_port() in got[:3]


def test_a_bound_port_is_not_drawn(small_range):
    """A port another socket holds (bound outside any reservation) is skipped."""
    lo, hi = small_range
    with socket.socket() as s:
        s.bind(("127.0.0.1", lo))
        assert lo not in [_ports.free_port() for _ in range(3)]


TORCH_MSG = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
             "address. port: {}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def test_port_taken_is_the_stores_bind_failure_on_that_port_only():
    assert _ports.port_taken("Traceback ...\n" + TORCH_MSG.format(23456) + "\n", 23456)
    assert not _ports.port_taken(TORCH_MSG.format(23456), 2345)  # another port
    assert not _ports.port_taken(TORCH_MSG.format(23456), 23457)
    assert not _ports.port_taken("OSError: [Errno 98] Address already in use", 23456)  # not the store's bind
    assert not _ports.port_taken(TORCH_MSG.format(23456).replace("EADDRINUSE", "EACCES"), 23456)


def _launcher(outcomes, killed):
    """A launcher over :func:`retry_on_port_taken` whose launches give ``outcomes`` in turn (an error: raised);
    ``before_retry`` appends the failed launch's result to ``killed``. Returns the launcher's result."""
    left = list(outcomes)

    def once():
        o = left.pop(0)
        if isinstance(o, Exception):
            raise o
        return o
    return _ports.retry_on_port_taken("fake(x.py)", once, before_retry=killed.append)


def test_retry_on_port_taken_relaunches_then_raises_or_hands_back_the_last_launch():
    """Each retry: the failed launch to ``before_retry``, a ``[ports]`` line and a warning at the launcher's
    caller. After ``PORT_RETRIES`` retries the error is raised, or its ``result`` (the failed launch) returned
    where it carries one; any other error is not retried."""
    taken, killed = RendezvousPortTaken, []
    with pytest.warns(PortRetryWarning, match=r"fake\(x.py\): rendezvous port 1 was taken.*retry 1 of 2") as w:
        assert _launcher([taken(1, "", result="run1"), "ok"], killed) == "ok"
    assert killed == ["run1"] and [x.filename for x in w] == [__file__]
    killed.clear()
    with pytest.warns(PortRetryWarning), pytest.raises(RendezvousPortTaken, match="port 3 was taken"):
        _launcher([taken(1, ""), taken(2, ""), taken(3, ""), "not launched"], killed)
    assert killed == [None, None]
    with pytest.warns(PortRetryWarning) as w:
        assert _launcher([taken(p, "", result=f"run{p}") for p in (1, 2, 3)], killed) == "run3"
    assert len(w) == 2
    with pytest.raises(AssertionError, match="other"):
        _launcher([AssertionError("other"), "not launched"], killed)


@pytest.fixture
def taken_first(monkeypatch):
    """A port bound and listened on outside the reservation (what another program would do), handed out by the
    next ``free_port()`` of ``_harness`` and ``multinode``; later draws are real. Yields ``(port, draws)``."""
    import multinode

    port = _ports.free_port()
    draws = []

    def fake(**kw):
        draws.append(port if not draws else _ports.free_port(**kw))
        return draws[-1]

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen(16)
        monkeypatch.setattr(_harness, "free_port", fake)
        monkeypatch.setattr(multinode, "free_port", fake)
        yield port, draws


def test_run_ranks_launches_again_when_the_rendezvous_port_was_taken(snap_env, taken_first):
    port, draws = taken_first
    with pytest.warns(PortRetryWarning, match=f"rendezvous port {port} was taken"):
        outs = _harness.run_ranks("rdzv_worker.py", 2, [], snap_env.env, timeout=120)
    assert [result_lines(o) for o in outs] == [["3"], ["3"]]
    assert len(draws) == 2 and draws[1] != port


def test_finish_names_a_taken_port_and_does_not_wait_for_the_other_ranks(snap_env, taken_first):
    """A direct ``launch`` (the caller holds the processes: no retry): rank 0's failure to bind ends the wait at
    once with :class:`RendezvousPortTaken` (rank 1, connected to the outside listener, would wait 30 min)."""
    port, _ = taken_first
    procs = _harness.launch("rdzv_worker.py", 2, [], snap_env.env)
    with pytest.raises(RendezvousPortTaken, match=f"rendezvous port {port} was taken"):
        _harness.finish(procs, timeout=120)
    assert all(p.returncode is not None for p in procs)


def test_run_ranks_does_not_retry_another_failure(snap_env, monkeypatch):
    """A rank that fails otherwise (here: a script that does not exist) fails the launch, launched once."""
    draws = []
    monkeypatch.setattr(_harness, "free_port", lambda: draws.append(_ports.free_port()) or draws[-1])
    with pytest.raises(AssertionError, match="rank 0 exited 2"):
        _harness.run_ranks("no_such_worker.py", 2, [], snap_env.env, timeout=60)
    assert len(draws) == 1


def _torchrun(port, *rdzv):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *rdzv,
            os.path.join(WORKERS, "rdzv_worker.py")]


def test_torchrun_launches_again_when_the_rendezvous_port_was_taken(snap_env, taken_first):
    """Both launch forms: a c10d rendezvous (``is_host=1``) run to the end, and a static one whose agent is
    handed back once its store listens."""
    port, draws = taken_first
    env = dict(os.environ, **snap_env.env, OMP_NUM_THREADS="1")
    with pytest.warns(PortRetryWarning, match=f"rendezvous port {port} was taken"):
        cp = _harness.run_torchrun(lambda p: _torchrun(p, "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                                       f"127.0.0.1:{p}", "--rdzv_conf", "is_host=1"),
                                   env=env, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert sorted(result_lines(cp.stdout)) == ["3", "3"]
    draws.clear()  # the next draw is the taken port again
    with pytest.warns(PortRetryWarning, match=f"rendezvous port {port} was taken"):
        proc = _harness.start_torchrun(lambda p: _torchrun(p, "--master_addr", "127.0.0.1", "--master_port",
                                                           str(p)), env=env)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert sorted(result_lines(out)) == ["3", "3"]


def test_multinode_launch_again_when_the_rendezvous_port_was_taken(rig, taken_first):
    """Two simulated nodes: node rank 0's agent fails to bind, node 1's (waiting on the outside listener) is
    killed, both start again on a fresh port and the job runs."""
    port, draws = taken_first
    rig.start(2)
    with pytest.warns(PortRetryWarning, match=f"rendezvous port {port} was taken"):
        runs = rig.torchrun_all(os.path.join(WORKERS, "rdzv_worker.py"), [], 1)
    assert rig.wait_all(runs, 120) == [0, 0]
    assert sorted(l for r in runs for l in result_lines(r.output())) == ["3", "3"]
    assert len(draws) == 2
