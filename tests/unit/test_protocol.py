"""The control protocol between a training process and the node persister
(snapckpt/persister/protocol.py): JSON lines only, a fixed typed schema per op, refusal of any record that
does not match it, and errors carried across the process boundary as records rebuilt with their type."""
from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest

from snapckpt import errors
from snapckpt.persister import protocol as P
from snapckpt.persister.protocol import ProtocolError

#: A value of each field type of the schema (int for an int/float field: JSON has no int/float split).
SAMPLE = {int: 7, str: "s", bool: True, list: [0, 1], dict: {}, (int, float): 1.5}


def good_request(op: str) -> dict:
    msg = {"op": op, **{name: SAMPLE[typ] for name, typ in P.REQUESTS[op].items()}}
    if op == "hello":
        msg["protocol"] = P.PROTOCOL_VERSION
    return msg


@pytest.mark.parametrize("op", sorted(P.REQUESTS))
def test_every_op_round_trips_through_one_json_line_and_validates(op):
    msg = good_request(op)
    line = P.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert b"pickle" not in line and line[:1] == b"{"
    back = P.decode(line)
    assert back == msg
    assert P.validate_request(back) == op


def test_encode_refuses_a_message_over_the_size_limit():
    with pytest.raises(ProtocolError, match="exceeds"):
        P.encode({"op": "fail", "message": "x" * P.MAX_MESSAGE_NBYTES})
    assert len(P.encode({"op": "ping", "pad": "x" * 1000})) < P.MAX_MESSAGE_NBYTES


@pytest.mark.parametrize("line", [b"not json\n", b"\xff\xfe\n", b"{\"op\": \n", b"[" * 100_000 + b"]" * 100_000])
def test_decode_refuses_non_json_with_a_protocol_error(line):
    with pytest.raises(ProtocolError, match="not JSON") as ei:
        P.decode(line)
    assert ei.value.__cause__ is not None  # chained to the parser's error


@pytest.mark.parametrize("line", [b"[1, 2]\n", b"\"ping\"\n", b"3\n", b"null\n"])
def test_decode_refuses_json_that_is_not_an_object(line):
    with pytest.raises(ProtocolError, match="not a JSON object"):
        P.decode(line)


@pytest.mark.parametrize("msg", [{}, {"op": "launch_missiles"}, {"op": 3}, {"op": None}, {"op": ["ping"]}])
def test_unknown_or_missing_op_is_refused(msg):
    with pytest.raises(ProtocolError, match="unknown op"):
        P.validate_request(msg)


def test_missing_and_extra_fields_are_refused():
    msg = good_request("acquire")
    del msg["nbytes"]
    with pytest.raises(ProtocolError, match="fields"):
        P.validate_request(msg)
    msg = good_request("acquire")
    msg["path"] = "/etc/passwd"
    with pytest.raises(ProtocolError, match="fields"):
        P.validate_request(msg)
    with pytest.raises(ProtocolError, match="fields"):
        P.validate_request({"op": "ping", "extra": 1})


@pytest.mark.parametrize("field,value", [
    ("step", True),        # a bool is an int in Python, never in the protocol
    ("step", 1.0),         # a float where an int is required
    ("step", "1"),
    ("step", None),
    ("nbytes", [1]),
])
def test_mistyped_int_fields_are_refused(field, value):
    msg = good_request("acquire")
    msg[field] = value
    with pytest.raises(ProtocolError, match=repr(field)):
        P.validate_request(msg)


def test_bool_float_and_list_fields_are_strictly_typed():
    ready = good_request("ready")
    ready["persist"] = 1  # an int where a bool is required
    with pytest.raises(ProtocolError, match="'persist'"):
        P.validate_request(ready)
    hello = good_request("hello")
    hello["commit_timeout_secs"] = 30  # an int is a valid float field
    assert P.validate_request(hello) == "hello"
    hello["commit_timeout_secs"] = False  # but not a bool
    with pytest.raises(ProtocolError, match="got a bool"):
        P.validate_request(hello)
    hello = good_request("hello")
    hello["local_ranks"] = "0,1"
    with pytest.raises(ProtocolError, match="'local_ranks'"):
        P.validate_request(hello)


@pytest.mark.parametrize("version", [None, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1])
def test_a_hello_of_another_protocol_version_is_refused_with_the_cause_and_the_fix(version):
    """A rank of another snapckpt version than the job's live persister (upgraded meanwhile): refused at
    ``hello`` with ProtocolVersionError naming both versions and ``snapckpt stop``, rebuilt with its type on
    the rank's side; ``None``: an older rank that sends no version."""
    hello = good_request("hello")
    if version is None:
        del hello["protocol"]
    else:
        hello["protocol"] = version
    with pytest.raises(errors.ProtocolVersionError) as info:
        P.validate_request(hello)
    msg = str(info.value)
    assert f"persister (pid {os.getpid()}) protocol version {P.PROTOCOL_VERSION}" in msg, msg
    assert "snapckpt stop" in msg, msg
    assert "this training process runs " + ("an older snapckpt" if version is None
                                            else f"protocol version {version}") in msg, msg
    back = P.error_from_record(P.error_record(info.value))
    assert type(back) is errors.ProtocolVersionError and str(back) == msg


def test_protocol_error_is_a_persister_error():
    assert issubclass(ProtocolError, errors.PersisterError)
    assert issubclass(ProtocolError, errors.SnapckptError) and issubclass(ProtocolError, Exception)


def test_os_error_round_trips_with_errno_subclass_and_filename():
    rec = P.error_record(PermissionError(errno.EACCES, "Permission denied", "/ckpt/step_1"))
    assert rec == {"type": "PermissionError", "message": "Permission denied", "errno": errno.EACCES,
                   "filename": "/ckpt/step_1"}
    json.dumps(rec)  # JSON-safe
    exc = P.error_from_record(rec, context="rank 1, step 5")
    assert type(exc) is PermissionError  # OSError(errno) picks the subclass
    assert exc.errno == errno.EACCES and exc.filename == "/ckpt/step_1"
    assert exc.__notes__[0] == "rank 1, step 5" and exc.__notes__[1].startswith("EACCES")
    lost = P.error_from_record(P.error_record(FileNotFoundError(errno.ENOENT, "No such file")))
    assert type(lost) is FileNotFoundError and lost.filename is None


def test_snapckpt_and_builtin_errors_keep_their_type():
    exc = P.error_from_record(P.error_record(errors.CommitTimeoutError("ranks [1] missing")))
    assert type(exc) is errors.CommitTimeoutError and str(exc) == "ranks [1] missing"
    exc = P.error_from_record(P.error_record(ValueError("bad tag")))
    assert type(exc) is ValueError and str(exc) == "bad tag"
    assert not hasattr(exc, "__notes__")  # no context given, no errno hint


@pytest.mark.parametrize("typ", ["NoSuchError", "UnicodeDecodeError", "SystemExit", "KeyboardInterrupt", "int"])
def test_unknown_odd_or_non_exception_types_become_persist_error(typ):
    """A type this process does not know, a builtin with an unusual constructor, a BaseException that is
    not an Exception, and a builtin that is no exception at all: all become PersistError naming the type."""
    exc = P.error_from_record({"type": typ, "message": "boom", "errno": None, "filename": None})
    assert type(exc) is errors.PersistError
    assert str(exc) == f"{typ}: boom"


@pytest.mark.parametrize("code,word,fix", [
    (errno.ENOSPC, "ENOSPC", "keep_last"), (errno.EDQUOT, "EDQUOT", "quota"), (errno.EFBIG, "EFBIG", "ulimit -f"),
    (errno.EACCES, "EACCES", "write access"), (errno.EPERM, "EPERM", "lsattr"), (errno.EROFS, "EROFS", "read-write"),
    (errno.EIO, "EIO", "dmesg")])
def test_storage_errors_carry_the_cause_and_the_fix(code, word, fix):
    """ENOSPC/EDQUOT: DiskFullError (an OSError too) with the cause and the fix in its message, said once
    however often the record is relayed (part failure -> commit -> trainer); EFBIG, EACCES, EPERM, EROFS,
    EIO: an OSError (of the errno's subclass) with a note naming the cause and the fix."""
    exc = P.error_from_record(P.error_record(OSError(code, "no room", "/ck/f")), context="step 3")
    assert isinstance(exc, OSError) and exc.errno == code and exc.filename == "/ck/f"
    assert exc.__notes__[0] == "step 3"
    if code not in (errno.ENOSPC, errno.EDQUOT):
        assert not isinstance(exc, errors.DiskFullError)
        assert exc.__notes__[1].startswith(word) and "previous checkpoint is intact" in exc.__notes__[1]
        assert fix in exc.__notes__[1]
        return
    assert fix in str(exc)
    assert type(exc) is errors.DiskFullError and len(exc.__notes__) == 1
    assert str(exc).startswith(f"[Errno {code}] no room; {word}") and "previous checkpoint is intact" in str(exc)
    again = P.error_from_record(P.error_record(exc))
    assert str(again) == str(exc) and not hasattr(again, "__notes__")


def test_ok_and_fail_responses():
    assert P.ok(slot=2) == {"ok": True, "slot": 2}
    resp = P.fail(errors.SlotBusyError("all slots held"))
    assert resp["ok"] is False and resp["error"]["type"] == "SlotBusyError"
    assert P.decode(P.encode(resp)) == resp


def test_the_protocol_version_names_the_requests_fields():
    """PROTOCOL_VERSION must change with the requests' fields, or ranks and persisters of two snapckpt versions
    would pass ``hello`` and refuse each other at some later request. When this fails after a change to
    ``REQUESTS``: raise ``PROTOCOL_VERSION`` by one and record the new digest here."""
    def name(typ):
        return [c.__name__ for c in typ] if isinstance(typ, tuple) else typ.__name__

    canon = json.dumps({op: {k: name(v) for k, v in fields.items()} for op, fields in P.REQUESTS.items()},
                       sort_keys=True)
    digests = {2: "57fd52226db8a34c"}
    assert hashlib.sha256(canon.encode()).hexdigest()[:16] == digests.get(P.PROTOCOL_VERSION), \
        f"REQUESTS changed: raise PROTOCOL_VERSION ({P.PROTOCOL_VERSION}) and record the digest"
