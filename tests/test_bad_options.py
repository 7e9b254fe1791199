"""Bad option values through the integrations' config paths: refused when the config is read, naming the
field (the core's checks are in tests/unit/test_options_errors.py; this file imports DeepSpeed, so it is not a
unit test)."""
from __future__ import annotations

import pytest


def test_deepspeed_config_section_refuses_an_infinite_timeout_from_json(tmp_path):
    """A DeepSpeed JSON config may hold ``Infinity`` (Python's json reads it): refused when the config is read,
    naming the field, not at the first request to the persister."""
    from snapckpt.integrations.deepspeed.config import _split_config

    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "snapckpt": {"checkpoint_dir": "ck", '
                    '"options": {"request_timeout_secs": Infinity}}}')
    with pytest.raises(ValueError, match="request_timeout_secs"):
        _split_config(str(path))


@pytest.mark.parametrize("options", [{"request_timeout_secs": float("inf")}, {"slot_headroom": float("inf")},
                                     {"commit_timeout_secs": True}])
def test_hf_callback_refuses_bad_option_values_at_construction(options):
    """``SnapckptCallback(**options)``: a value that would fail at the first save (an overflow in a socket wait,
    an arena slot of infinite size) or mean something else (``True`` seconds) is refused by the constructor."""
    from snapckpt.hf import SnapckptCallback

    (name,) = options
    with pytest.raises(ValueError, match=name):
        SnapckptCallback(2, **options)
