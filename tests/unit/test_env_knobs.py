"""The environment settings (snapckpt/_internal/env.py): a ``SNAPCKPT_*`` variable that snapckpt does not read is
named in a warning with the closest setting, so that a misspelled one (``SNAPCKPT_REMOTEDIR``) does not silently
train without what it meant to turn on."""
from __future__ import annotations

import os
import re

from snapckpt._internal import env


def test_a_misspelled_setting_is_named_with_the_closest_known_one(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SNAPCKPT_")]:
        monkeypatch.delenv(name)
    assert env.unknown_knobs() == []
    monkeypatch.setenv("SNAPCKPT_REMOTEDIR", "s3://b/run")
    monkeypatch.setenv("SNAPCKPT_SHM_DIR", "/dev/shm")  # a setting: not named
    monkeypatch.setenv("SNAPCKPT_BENCH_FSYNC", "0")  # the benchmarks' own: not named
    monkeypatch.setenv("SNAPCKPT_XYZZY", "1")
    got = env.unknown_knobs()
    assert len(got) == 2, got
    assert "SNAPCKPT_REMOTEDIR is not a snapckpt setting and is ignored (did you mean SNAPCKPT_REMOTE_DIR?)" in got[0]
    assert "SNAPCKPT_XYZZY is not a snapckpt setting and is ignored;" in got[1]


def test_the_known_settings_are_those_the_module_reads():
    src = open(env.__file__).read().split('"""', 2)[2]  # the code, not the docstring
    read = set(re.findall(r'environ(?:\.get)?\(\s*"(SNAPCKPT_[A-Z_]+)"', src))
    assert read == set(env.KNOBS), read ^ set(env.KNOBS)
    doc = env.__doc__
    assert all(f"``{k}``" in doc for k in env.KNOBS), [k for k in env.KNOBS if f"``{k}``" not in doc]


def test_every_setting_is_in_the_operations_pages_table():
    # A user looks a variable up in docs/operations.md; SNAPCKPT_NATIVE(_DIR) and SNAPCKPT_STREAM_PERSIST were read
    # by the library but missing there.
    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")
    rows = set(re.findall(r"^\| `(SNAPCKPT_[A-Z_]+)` \|", open(page).read(), re.M))
    assert set(env.KNOBS) <= rows, sorted(set(env.KNOBS) - rows)
