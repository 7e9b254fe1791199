"""The docs check that scripts/test.sh (and so CI) runs: scripts/check_docs.sh must fail on a warning of
``mkdocs build --strict``. With ``--quiet`` (what test.sh used) mkdocs 1.6 hid the warnings from strict mode as
well, and a page linking to an anchor that a regenerated results page no longer had built "without a warning"."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MKDOCS = os.path.join(os.path.dirname(sys.executable), "mkdocs")  # installed by scripts/setup.sh


def _site(tmp_path, broken: bool) -> str:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(os.path.join(REPO, "docs"), root / "docs")
    shutil.copy(os.path.join(REPO, "mkdocs.yml"), root / "mkdocs.yml")
    (root / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "mkdocs_hooks.py"), root / "scripts")  # mkdocs.yml's hooks
    for pkg in ("snapckpt", "integrations"):  # mkdocstrings imports the API pages' modules from here
        os.symlink(os.path.join(REPO, pkg), root / pkg)
    if broken:
        with open(root / "docs" / "api.md", "a") as f:
            f.write("\n[a link](index.md#no-such-anchor-on-that-page)\n")
    return str(root)


@pytest.mark.parametrize("broken", [False, True], ids=["intact", "broken_anchor"])
def test_check_docs_fails_on_a_broken_anchor_and_passes_the_docs_as_they_are(tmp_path, broken):
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "check_docs.sh"), _site(tmp_path, broken)],
                       env={**os.environ, "MKDOCS": MKDOCS}, capture_output=True, text=True, timeout=300)
    if broken:
        assert r.returncode == 1, r.stdout + r.stderr
        assert "no-such-anchor-on-that-page" in r.stdout + r.stderr and "fix the docs" in r.stderr
    else:
        assert r.returncode == 0, r.stdout + r.stderr
