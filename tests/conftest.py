"""Shared fixtures: an isolated snapckpt environment per test, checked for leaks at teardown."""
from __future__ import annotations

import importlib.util
import random

import pytest

from _harness import isolated_snap_env, release_ports, wait_until


def pytest_addoption(parser):
    """Options of the fault matrix (tests/test_fault_matrix.py)."""
    parser.addoption("--fault-points", type=int, default=1,
                     help="random fault points per integration in test_fault_matrix.py (default 1, the CI "
                          "budget; 50+ for a long run)")
    parser.addoption("--fault-seed", type=int, default=None,
                     help="seed of the random fault points (default: random, printed in the report header)")


def pytest_configure(config):
    seed = config.getoption("--fault-seed")
    if seed is None and hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller's seed
        seed = config.workerinput["fault_seed"]
    config.fault_seed = seed if seed is not None else random.randrange(1 << 31)


if importlib.util.find_spec("xdist") is not None:
    def pytest_configure_node(node):
        """pytest-xdist: every worker draws the same fault points (they must collect the same tests)."""
        node.workerinput["fault_seed"] = node.config.fault_seed


def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup``: give every ``xdist_group`` test the ``@<group>`` node-id suffix the scheduler groups
    by. pytest-xdist 3.8 sets it through ``item._nodeid``, which pytest 9 no longer reads (the id is
    ``item._id``), so its groups were silently ignored: a group's tests ran on every worker, each rebuilding
    the group's module-scoped fixtures and caches. Does nothing where xdist's own suffix took effect."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):  # pytest >= 9
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix


def pytest_report_header(config):
    return f"fault matrix: --fault-seed {config.fault_seed} --fault-points {config.getoption('--fault-points')}"


@pytest.fixture(autouse=True)
def _fault_points_read_per_test():
    """Fault points parse ``SNAPCKPT_FAULT_POINT`` once per process: a test that arms one in this process (a
    Checkpointer in the test, its rank-side points) must not leave it armed for the next tests of the worker
    (armed, the persister's writer wraps its sink and never writes straight from the slot: a test of that failed
    after one that armed a point)."""
    from snapckpt._internal import faultpoints

    faultpoints._specs, faultpoints._hits = None, {}
    yield
    faultpoints._specs, faultpoints._hits = None, {}


@pytest.fixture(autouse=True)
def _ports_reserved_per_test():
    """The TCP ports a test drew (``free_port``: rendezvous, servers) stay reserved for every process on the
    host until the test has torn down (autouse: set up first, so torn down after the test's own fixtures
    killed its jobs); then they are free for the next draws."""
    yield
    release_ports()


@pytest.fixture
def snap_env(tmp_path, monkeypatch):
    """Isolated runtime/shm directories (inherited by child processes through the environment).

    At teardown the test's persisters must have exited and its shared memory must be empty (contract 10);
    a test that deliberately leaves a persister behind (kill tests) calls ``snap_env.leftover_ok = True``.
    """
    with isolated_snap_env(str(tmp_path)) as se:
        for k, v in se.env.items():
            monkeypatch.setenv(k, v)
        yield se


@pytest.fixture
def rig(tmp_path):
    """The multi-node rig (``tests/multinode.py``): call ``rig.start(n)``; the checkpoint directory
    ``rig.ckpt_dir`` is shared by every node.

    At teardown every node's persister must have exited and its memory tier must be empty, unless the test
    sets ``rig.leftover_ok = True`` (kill tests); then every process of every node is killed and the rig's
    directories removed, and no process of any node may be left.
    """
    from multinode import Rig, rig_available

    why = rig_available()
    if why:
        pytest.fail(why)  # CI runs as root; a skip would hide the multi-node tests
    r = Rig(str(tmp_path), str(tmp_path / "ckpt"))
    r.leftover_ok = False
    try:
        yield r
        if not r.leftover_ok:
            for node in r.nodes:
                if node.alive:
                    assert wait_until(lambda: not node.persisters(), timeout=15), \
                        f"{node.name}: persister outlived the test: {node.persisters()}"
                    assert wait_until(lambda: not node.shm_files(), timeout=5), \
                        f"{node.name}: shared-memory files outlived the test: {node.shm_files()}"
    finally:
        r.close()
        stray = [n.name for n in r._all if n.pids()]
        assert not stray, f"processes of {stray} outlived the rig's teardown"


@pytest.fixture
def s3_bucket(monkeypatch):
    """A fresh bucket on the session's S3 server (moto on 127.0.0.1, tests/s3server.py), with the standard
    AWS variables set for this process and every child it starts (ranks, persisters)."""
    import s3server
    bucket = s3server.new_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    for k, v in s3server.CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "SNAPCKPT_REMOTE_DIR"):
        monkeypatch.delenv(k, raising=False)
    yield bucket


def pytest_sessionfinish(session, exitstatus):
    import sys
    if "s3server" in sys.modules:
        sys.modules["s3server"].stop()
