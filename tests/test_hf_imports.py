"""``snapckpt.hf`` imports: the Accelerate integration works without transformers installed.

``SnapckptCallback`` is a lazy attribute of :mod:`snapckpt.hf` (it needs transformers); the
``AcceleratorCheckpointer`` path (``integrations/accelerate.py`` and the shared
``integrations/transformers/files.py``) never imports transformers at module level.
"""
import subprocess
import sys

CODE = """
import sys
sys.modules["transformers"] = None  # as if transformers were not installed: any import of it fails
from snapckpt.hf import AcceleratorCheckpointer
import snapckpt.integrations.transformers.files, snapckpt.integrations.transformers.resume
print("ACCELERATE OK", AcceleratorCheckpointer.__name__)
try:
    from snapckpt.hf import SnapckptCallback
except ImportError as e:
    print("CALLBACK", type(e).__name__, e)
else:
    print("CALLBACK imported")
"""


def test_accelerate_imports_without_transformers_and_the_callback_names_it():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ACCELERATE OK AcceleratorCheckpointer" in r.stdout, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("CALLBACK"))
    assert "Error" in line and "transformers" in line, line


def test_callback_is_still_importable_from_snapckpt_hf():
    from snapckpt.hf import AcceleratorCheckpointer, SnapckptCallback
    import snapckpt.hf as hf

    assert SnapckptCallback.__name__ == "SnapckptCallback" and AcceleratorCheckpointer is not None
    assert set(hf.__all__) <= set(dir(hf))
