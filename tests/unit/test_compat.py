"""Version seams (snapckpt/_internal/compat.py): notes on Python 3.10, the private-PyTorch check."""
from __future__ import annotations

import errno
import io

import pytest
import torch

from snapckpt._internal import compat
from snapckpt._internal.compat import SUPPORTED_TORCH, UnsupportedTorchError, add_note, check_torch
from snapckpt.persister import protocol as P


def test_add_note_uses_add_note_where_python_has_it():
    e = ValueError("bad tag")
    add_note(e, "step 3")
    assert e.__notes__ == ["step 3"] and str(e) == "bad tag"


def test_python_310_path_keeps_notes_and_shows_them_in_the_message():
    """Python 3.10 has no BaseException.add_note (before, a full disk became an AttributeError there): the
    note goes to __notes__ as on 3.11, and into the message, since 3.10 tracebacks do not print notes."""
    e = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_1")
    compat._add_note_310(e, "persister pid 7, op status")
    compat._add_note_310(e, "ENOSPC: free space")
    assert e.__notes__ == ["persister pid 7, op status", "ENOSPC: free space"]
    assert e.errno == errno.ENOSPC and e.filename == "/ckpt/step_1"
    assert str(e) == ("[Errno 28] No space left on device; persister pid 7, op status; ENOSPC: free space: "
                      "'/ckpt/step_1'")
    v = ValueError("bad tag")
    compat._add_note_310(v, "rank 1")
    assert str(v) == "bad tag\nrank 1" and v.__notes__ == ["rank 1"]
    k = KeyError("a", "b")  # arguments that are not one string: the message is left alone
    compat._add_note_310(k, "note")
    assert k.args == ("a", "b") and k.__notes__ == ["note"]


def test_protocol_rebuilt_errors_carry_their_notes():
    exc = P.error_from_record(P.error_record(OSError(errno.EFBIG, "too large")), context="step 3")
    assert exc.__notes__[0] == "step 3" and exc.__notes__[1].startswith("EFBIG")  # ENOSPC: in the message


def test_installed_torch_passes_the_check():
    check_torch()
    check_torch([("torch.distributed.distributed_c10d", "_get_default_store")])


def test_missing_private_torch_name_names_the_supported_range():
    """A PyTorch without an API snapckpt uses (a name this one lacks stands for an older release) is
    refused with the names missing, the installed version and the range to install."""
    with pytest.raises(UnsupportedTorchError) as ei:
        check_torch([("torch._C", "PyTorchFileWriter"), ("torch.serialization", "no_such_api"),
                     ("torch.no_such_module", "x")])
    msg = str(ei.value)
    assert SUPPORTED_TORCH in msg and torch.__version__ in msg
    assert "torch.serialization.no_such_api" in msg and "torch.no_such_module.x" in msg
    assert "PyTorchFileWriter" not in msg
    assert isinstance(ei.value, ImportError)


def test_torch_file_writer_writes_an_archive_torch_load_reads():
    buf = io.BytesIO()
    w = compat.torch_file_writer(buf, 64)
    w.write_record("data.pkl", b"\x80\x02K\x07.", 5)  # pickle protocol 2 of the int 7
    w.write_record("byteorder", "little", 6)
    w.write_end_of_file()
    del w
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == 7
