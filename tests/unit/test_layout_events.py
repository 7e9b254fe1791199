"""Names of the plain layout (snapckpt/ondisk/layout.py) and the event records (snapckpt/events.py)."""
from __future__ import annotations

import dataclasses

import pytest

from snapckpt.events import Event, SaveStats, StorageType
from snapckpt.ondisk import layout
from snapckpt.ondisk.manifest import validate_dirname, validate_file_name


def test_step_dirnames_sort_by_step_and_match_the_pattern():
    names = [layout.step_dirname(s) for s in (0, 7, 100, 99_999_999, 123_456_789_012)]
    assert names[:3] == ["step_00000000", "step_00000007", "step_00000100"]
    assert names[-1] == "step_123456789012"  # past 8 digits it grows, never truncates
    assert all(layout.STEP_DIR_PATTERN.fullmatch(n) for n in names)
    assert sorted(names[:4]) == names[:4]
    for other in ("step_1", "step_0000001", "step_00000001.tmp", ".step_00000001", "step_0000000x"):
        assert not layout.STEP_DIR_PATTERN.fullmatch(other), other


def test_layout_names_pass_the_manifest_name_checks():
    assert validate_dirname(layout.step_dirname(5)) == "step_00000005"
    assert validate_file_name(layout.rank_filename(3)) == "rank_00003.pt"
    assert layout.rank_filename(123456) == "rank_123456.pt" and layout.TRACKER == "latest"


def test_storage_type_is_a_str_enum():
    assert StorageType("disk") is StorageType.DISK and StorageType.MEMORY == "memory"
    assert f"{StorageType.MEMORY}/{StorageType.DISK}" == "memory/disk"
    with pytest.raises(ValueError):
        StorageType("tape")


def test_event_and_stats_records_are_frozen_with_optional_fields():
    stats = SaveStats(step=4, tier=StorageType.DISK, tensor_nbytes=10, slot_nbytes=64, prepare_secs=0.1,
                      wait_slot_secs=0.0, copy_secs=0.2, blocking_secs=0.3)
    e = Event("snapshot_taken", 4, StorageType.DISK, rank=1, stats=stats)
    assert (e.reason, e.error, e.stats.copy_secs) == (None, None, 0.2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.step = 5
    assert Event("skipped", 4, StorageType.MEMORY, 0, reason="slots busy") == \
        Event("skipped", 4, StorageType.MEMORY, 0, reason="slots busy")


# moved whole from tests/test_user_errors.py
def test_storage_type_prints_as_its_value():
    assert f"{StorageType.MEMORY}" == "memory" and str(StorageType.DISK) == "disk"
