"""Environment knobs (snapckpt/_internal/env.py), topology and the one-process coordinator
(snapckpt/dist/), and RNG capture/restore (snapckpt/rng.py): all without torch.distributed initialized."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from snapckpt import rng
from snapckpt._internal import env
from snapckpt.dist.coordination import Coordinator, LocalCoordinator, make_coordinator
from snapckpt.dist.topology import Topology, host_identity

ENV_KNOBS = ("SNAPCKPT_SHM_DIR", "SNAPCKPT_RUNTIME_DIR", "XDG_RUNTIME_DIR", "SNAPCKPT_LOG_LEVEL",
             "SNAPCKPT_REMOTE_BLOCK_NBYTES",
             "SNAPCKPT_FAULT_WRITE_DELAY_SECS", "SNAPCKPT_FAULT_POINT", "SNAPCKPT_FAULT_STORAGE")


@pytest.fixture
def clean_env(monkeypatch):
    for k in ENV_KNOBS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# ------------------------------------------------------------------------------------------ env
def test_defaults_without_any_knob(clean_env):
    assert env.shm_dir() == "/dev/shm" and env.runtime_dir() == "/tmp" and env.log_level() == "INFO"
    assert env.fault_write_delay_secs() == 0.0 and env.fault_point() == "" and env.fault_storage() == ""


def test_knobs_are_read_at_call_time_and_empty_means_unset(clean_env):
    clean_env.setenv("SNAPCKPT_SHM_DIR", "")
    assert env.shm_dir() == "/dev/shm"
    clean_env.setenv("SNAPCKPT_SHM_DIR", "/mnt/tmpfs")
    assert env.shm_dir() == "/mnt/tmpfs"
    clean_env.setenv("XDG_RUNTIME_DIR", "/run/user/1")
    assert env.runtime_dir() == "/run/user/1"
    clean_env.setenv("SNAPCKPT_RUNTIME_DIR", "/r")
    assert env.runtime_dir() == "/r"  # snapckpt's own knob wins
    clean_env.setenv("SNAPCKPT_LOG_LEVEL", "debug")
    assert env.log_level() == "DEBUG"


@pytest.mark.parametrize("name, fn, raw", [("SNAPCKPT_LOG_LEVEL", env.log_level, "LOUD"),
                                           ("SNAPCKPT_LOG_LEVEL", env.log_level, "5"),
                                           ("SNAPCKPT_REMOTE_BLOCK_NBYTES", env.remote_block_nbytes, "zz"),
                                           ("SNAPCKPT_REMOTE_BLOCK_NBYTES", env.remote_block_nbytes, "16MiB"),
                                           ("SNAPCKPT_REMOTE_BLOCK_NBYTES", env.remote_block_nbytes, "0")])
def test_a_garbage_knob_is_a_value_error_naming_it_and_its_values(clean_env, name, fn, raw):
    """Found by a break-it trial: ``SNAPCKPT_LOG_LEVEL=LOUD`` crashed the persister at startup (a traceback
    in persister.log behind a PersisterError); ``SNAPCKPT_REMOTE_BLOCK_NBYTES=zz`` was a bare "invalid literal
    for int()". Each names the variable, the value and what it accepts."""
    clean_env.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}={raw!r} must be .*or unset for the default"):
        fn()


@pytest.mark.parametrize("raw,want", [("0", 0.0), ("0.25", 0.25), ("3", 3.0)])
def test_write_delay_parses_non_negative_numbers(clean_env, raw, want):
    clean_env.setenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS", raw)
    assert env.fault_write_delay_secs() == want


@pytest.mark.parametrize("raw", ["-1", "abc", "1s", "true"])
def test_write_delay_refuses_negative_and_non_numbers(clean_env, raw):
    clean_env.setenv("SNAPCKPT_FAULT_WRITE_DELAY_SECS", raw)
    with pytest.raises(ValueError):
        env.fault_write_delay_secs()


# ------------------------------------------------------------------------------------------ topology
def test_topology_from_hosts_groups_ranks_by_host():
    hosts = ["a", "a", "b", "b"]
    t = Topology.from_hosts(2, hosts)
    assert (t.rank, t.world_size, t.local_ranks, t.node_index, t.num_nodes, t.local_rank) == (2, 4, (2, 3), 1, 2, 0)
    assert Topology.from_hosts(1, hosts).local_rank == 1


def test_topology_interleaved_hosts_order_nodes_by_lowest_rank():
    hosts = ["b", "a", "b", "a", "c"]
    t = Topology.from_hosts(3, hosts)
    assert (t.local_ranks, t.node_index, t.num_nodes, t.local_rank) == ((1, 3), 1, 3, 1)
    assert Topology.from_hosts(0, hosts).node_index == 0 and Topology.from_hosts(4, hosts).node_index == 2


def test_topology_of_one_process_and_host_identity():
    t = Topology.from_hosts(0, [host_identity()])
    assert (t.rank, t.world_size, t.local_ranks, t.node_index, t.num_nodes) == (0, 1, (0,), 0, 1)
    host, _, boot = host_identity().partition("/")
    assert host and host_identity() == host_identity()


# ------------------------------------------------------------------------------------------ coordinator
def test_local_coordinator_is_a_world_of_one_that_copies_through_json():
    c = LocalCoordinator()
    assert isinstance(c, Coordinator) and (c.rank, c.world_size) == (0, 1)
    payload = {"step": 3, "dirs": ("a", "b"), "nested": {"x": [1]}}
    (got,) = c.all_gather("latest", payload, timeout_secs=1)
    assert got == {"step": 3, "dirs": ["a", "b"], "nested": {"x": [1]}}  # what a store round trip gives
    got["nested"]["x"].append(2)
    assert payload["nested"]["x"] == [1]  # a copy, not the caller's object
    with pytest.raises(TypeError):
        c.all_gather("bad", {"t": object()}, timeout_secs=1)


def test_make_coordinator_without_a_process_group_is_local():
    assert not torch.distributed.is_initialized()
    assert type(make_coordinator("job")) is LocalCoordinator
    with pytest.raises(NotImplementedError):
        Coordinator().all_gather("x", {}, 1)


# ------------------------------------------------------------------------------------------ rng
def _draw():
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), np.random.randn(),
            torch.rand(3).tolist(), torch.randn(2).tolist())


def test_rng_capture_restore_replays_python_numpy_and_torch():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gauss value in python's state
    np.random.randn()
    state = rng.capture()
    first = _draw()
    _draw()
    rng.restore(state)
    assert _draw() == first


def test_rng_state_loads_with_weights_only_and_still_restores():
    torch.manual_seed(11)
    state = rng.capture()
    expected = _draw()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    _draw()
    rng.restore(loaded)
    assert _draw() == expected
    assert set(state) >= {"python", "torch", "numpy"}


def test_rng_restore_leaves_missing_entries_alone():
    state = rng.capture()
    del state["numpy"]
    np.random.seed(5)
    want = np.random.rand()
    np.random.seed(5)
    rng.restore(state)
    assert np.random.rand() == want


def test_stream_persist_is_opt_in(monkeypatch):
    """``SNAPCKPT_STREAM_PERSIST``: off unless set to 1/true (it trades blocking time for time to durable)."""
    from snapckpt._internal import env as _env

    monkeypatch.delenv("SNAPCKPT_STREAM_PERSIST", raising=False)
    assert _env.stream_persist() is False
    for raw, want in (("1", True), ("TRUE", True), ("0", False), ("false", False), ("", False)):
        monkeypatch.setenv("SNAPCKPT_STREAM_PERSIST", raw)
        assert _env.stream_persist() is want, raw
    monkeypatch.setenv("SNAPCKPT_STREAM_PERSIST", "yes")
    with pytest.raises(ValueError, match="SNAPCKPT_STREAM_PERSIST='yes' must be 0 or 1"):
        _env.stream_persist()
