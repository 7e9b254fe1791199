"""Guards of the unit suite: a unit test starts no process (no persister, no torchrun) and imports no
training framework. Each test is checked at teardown, so a test that breaks the rule fails by name."""
from __future__ import annotations

import sys

import psutil
import pytest

from snapckpt._internal import faultpoints

FRAMEWORKS = ("deepspeed", "megatron", "transformers", "accelerate", "peft")


@pytest.fixture(autouse=True)
def _pure_unit_test():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    # a pytest-xdist worker may have run an integration test of another module first: only what this
    # test imports counts
    loaded = set(sys.modules)
    yield
    started = [p for p in me.children(recursive=True) if p.pid not in before]
    assert not started, f"a unit test started processes: {[(p.pid, p.name()) for p in started]}"
    imported = sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] in FRAMEWORKS)
    assert not imported, f"a unit test imported a training framework: {imported[:5]}"


@pytest.fixture
def arm(monkeypatch):
    """``arm(spec)``: sets ``SNAPCKPT_FAULT_POINT`` to ``spec`` for this test and makes the fault points read it
    again (they parse it once per process)."""
    def _arm(spec: str) -> None:
        monkeypatch.setenv("SNAPCKPT_FAULT_POINT", spec)
        monkeypatch.setattr(faultpoints, "_specs", None)
        monkeypatch.setattr(faultpoints, "_hits", {})
    return _arm
