"""The built wheel, installed into a fresh virtual environment, as a user gets it.

The wheel is built from a copy of this tree's package files (``pip wheel --no-deps --no-build-isolation``:
no index is needed, the venv's setuptools builds it), installed with pip into a new ``venv`` made without pip, and run there. The
new venv does not see this tree or its editable install; its dependencies (torch, the frameworks) are
those already installed in the project's ``.venv``, reached through a ``.pth`` line that puts that
``site-packages`` directory on ``sys.path`` after the venv's own (a plain path entry: the ``.pth`` files
inside it, the editable install's among them, are not processed). Reinstalling torch would take minutes
and, unpinned, a CUDA build.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

import snapckpt

# scripts/test.sh hands out tests one by one (--dist loadgroup); these share the module-scoped `wheel` build:
# one worker runs them all, so it is made once
pytestmark = pytest.mark.xdist_group("test_packaging")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the package is made of: an in-tree build reuses build/lib, where a module
    # deleted from the tree would survive into the wheel.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("snapckpt", "integrations"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300, cwd=str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return os.path.join(out, wheels[0])


def test_wheel_contents_and_metadata(wheel):
    """The wheel carries py.typed (PEP 561), the Apache-2.0 LICENSE, every package of the tree (the
    integrations under snapckpt.integrations), and states version RANGES: no requirement is an exact pin
    (those live in constraints.txt), torch's range is the one the code checks at import."""
    from snapckpt._internal.compat import SUPPORTED_TORCH

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
        licenses = [n for n in names if n.endswith("/LICENSE")]
        assert licenses, names
        assert "Apache License" in z.read(licenses[0]).decode() and "Version 2.0" in z.read(licenses[0]).decode()
    assert "snapckpt/py.typed" in names
    for pkg in ("snapckpt/cli/ps.py", "snapckpt/persister/control.py", "snapckpt/integrations/deepspeed/engine.py",
                "snapckpt/integrations/megatron/save.py", "snapckpt/integrations/transformers/callback.py",
                "snapckpt/integrations/accelerate.py", "snapckpt/_native/tensor_loops.cpp"):
        assert pkg in names, pkg
    assert not any(n.startswith(("tests/", "integrations/")) for n in names)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if "==" in r.split(";")[0]], requires
    assert any(r.replace(" ", "").startswith(f"torch{SUPPORTED_TORCH.replace(' ', '')}")
               or r.replace(" ", "").startswith("torch<3,>=2.6") for r in requires), requires
    assert "License-Expression: Apache-2.0" in meta, meta[:2000]
    assert "Classifier: Typing :: Typed" in meta
    assert f"Version: {snapckpt.__version__}" in meta


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path):
    """Installed in a new venv, every public module of snapckpt and snapckpt.integrations imports (the
    frameworks are installed here), the console script runs ``--version`` (the wheel's version) and
    ``ls`` on a checkpoint directory, and nothing is imported from this source tree."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = str(env_dir / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "zz_project_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
                        wheel], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    code = r"""
import importlib, json, pkgutil, sys
import snapckpt, snapckpt.integrations
mods, failed = [], {}
for pkg in (snapckpt, snapckpt.integrations):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if any(part.startswith("_") for part in m.name.split(".")[1:]) or m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
            mods.append(m.name)
        except Exception as e:
            failed[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"file": snapckpt.__file__, "mods": mods, "failed": failed,
                  "typed": __import__("os").path.exists(__import__("os").path.join(snapckpt.__path__[0], "py.typed"))}))
"""
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env={**os.environ, "PYTHONPATH": "", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(site), res["file"]  # the installed wheel, not this tree
    assert res["typed"]
    assert res["failed"] == {}, res["failed"]
    for m in ("snapckpt.cli.main", "snapckpt.cli.ps", "snapckpt.persister.server", "snapckpt.deepspeed",
              "snapckpt.hf", "snapckpt.megatron", "snapckpt.integrations.deepspeed.engine",
              "snapckpt.integrations.megatron.save", "snapckpt.integrations.transformers.callback",
              "snapckpt.integrations.accelerate"):
        assert m in res["mods"], (m, res["mods"])

    script = str(env_dir / "bin" / "snapckpt")
    r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == f"snapckpt {snapckpt.__version__}", r.stdout + r.stderr
    empty = tmp_path / "ckpts"
    empty.mkdir()
    r = subprocess.run([script, "ls", str(empty), "--json"], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == {"dir": str(empty), "checkpoints": [], "warnings": [], "other_directories": 0}
