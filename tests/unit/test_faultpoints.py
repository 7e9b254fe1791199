"""The fault points' ``action=wait`` (a test seam: holds a phase until the test creates a file)."""
import threading

import pytest

from snapckpt._internal import faultpoints


def test_wait_holds_the_point_until_the_file_exists(arm, tmp_path):
    release = tmp_path / "release"
    arm(f"commit.before_rename:step=2:action=wait:path={release}:secs=30")
    faultpoints.point("commit.before_rename", step=1, rank=None)  # another step: no wait
    timer = threading.Timer(0.3, release.touch)
    timer.start()
    faultpoints.point("commit.before_rename", step=2, rank=None)
    assert release.exists()  # created by the timer only: the point returned after it


def test_wait_without_a_path_is_refused(arm):
    arm("commit.before_rename:action=wait")
    with pytest.raises(ValueError, match="action=wait needs path="):
        faultpoints.point("commit.before_rename", step=1, rank=None)
