"""The O_DIRECT writer (snapckpt/storage/direct.py) under a file-size limit, which needs a child process
(RLIMIT_FSIZE); its in-process tests (exact bytes, the buffered fallback) are in tests/unit/test_direct_io.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from snapckpt.storage.direct import BUFFER_NBYTES


def test_file_size_limit_raises_efbig_from_the_background_write(tmp_path):
    """RLIMIT_FSIZE below the file's size (a stand-in for a full disk): the caller gets OSError EFBIG (from
    the background write of a full buffer, or from the padded tail), never a silent short file."""
    path = tmp_path / "big.bin"
    script = textwrap.dedent(f"""
        import errno, resource, sys
        from snapckpt.storage.direct import BUFFER_NBYTES, open_direct
        resource.setrlimit(resource.RLIMIT_FSIZE, (BUFFER_NBYTES + 5000, resource.RLIM_INFINITY))
        try:
            with open_direct({str(path)!r}) as f:
                for _ in range(4):
                    f.write(b"x" * BUFFER_NBYTES)
        except OSError as e:
            print("errno", errno.errorcode[e.errno])
            sys.exit(0)
        print("no error")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "errno EFBIG", out.stdout + out.stderr
    assert os.path.getsize(path) <= BUFFER_NBYTES + 5000
