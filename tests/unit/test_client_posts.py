"""The persister client's posts (snapckpt/persister/client.py): a checked post (a MEMORY save's ``ready``) returns
without its answer; the next request reads that answer first, in the persister's order, and raises its refusal with
the post named; dropped answers (plain posts, interrupted requests) are skipped. A fake persister on a socketpair
answers by hand, so the order of lines is the test's."""
from __future__ import annotations

import os
import socket

import pytest

from snapckpt import errors
from snapckpt.persister import protocol as P
from snapckpt.persister.client import PersisterClient


@pytest.fixture
def pair(tmp_path):
    """``(client, peer)``: a connected client and the fake persister's end (``peer.recv``/``peer.sendall``)."""
    client = PersisterClient(str(tmp_path / "rt"), str(tmp_path / "arena"), "0" * 16, startup_timeout_secs=1.0,
                             request_timeout_secs=2.0, idle_timeout_secs=1.0)
    a, b = socket.socketpair()
    a.settimeout(2.0)
    client.sock, client.rfile = a, a.makefile("rb")
    yield client, b
    client.close()
    b.close()


def _ops(peer: socket.socket, n: int) -> list:
    """The ops of the next ``n`` request lines the client sent."""
    data = b""
    while data.count(b"\n") < n:
        data += peer.recv(1 << 16)
    return [P.decode(line + b"\n")["op"] for line in data.split(b"\n")[:n]]


def test_a_checked_post_returns_before_its_answer_and_the_next_request_reads_it_first(pair):
    client, peer = pair
    client.post("ready", check=True, step=5)  # nothing answered yet: does not block
    assert _ops(peer, 1) == ["ready"]
    peer.sendall(P.encode(P.ok()))
    peer.sendall(P.encode(P.ok(persister_pid=42)))  # the ping's answer, sent ahead
    assert client.request("ping") == {"ok": True, "persister_pid": 42}
    assert _ops(peer, 1) == ["ping"]
    assert not client._owed


def test_the_refusal_of_a_checked_post_is_raised_by_the_next_request_with_the_post_named(pair):
    client, peer = pair
    client.post("stream", step=4)  # a plain post: its answer (even a refusal) is dropped
    client.post("ready", check=True, step=5)
    assert _ops(peer, 2) == ["stream", "ready"]
    peer.sendall(P.encode(P.fail(errors.PersisterError("stream refused"))))
    peer.sendall(P.encode(P.fail(errors.PersisterError("slot 1 of rank 0 is READY(3), not WRITING(5)"))))
    with pytest.raises(errors.PersisterError, match=r"not WRITING\(5\)") as info:
        client.request("ping")
    assert any("ready of step 5" in note for note in getattr(info.value, "__notes__", []))
    # the refused post is settled; the ping was never sent: the next request goes out and reads its own answer
    peer.sendall(P.encode(P.ok(persister_pid=7)))
    assert client.request("ping")["persister_pid"] == 7
    assert _ops(peer, 1) == ["ping"]


def test_close_drops_the_answers_still_owed_and_says_bye(pair):
    client, peer = pair
    client.post("ready", check=True, step=5)
    assert _ops(peer, 1) == ["ready"]
    peer.sendall(P.encode(P.fail(errors.PersisterError("refused"))) + P.encode(P.ok()))
    client.close(bye=True)  # no refusal raised at close (the session logs it: Session.detach)
    assert _ops(peer, 1) == ["bye"]
    assert client.sock is None


def test_a_refused_hello_names_the_persister_pid_from_its_pid_file(pair, tmp_path):
    """Before ``hello``'s reply the client does not know the pid; a refused ``hello`` said "persister pid None".
    The pid comes from the runtime directory's ``persister.pid`` then."""
    client, peer = pair
    os.makedirs(client.runtime_dir, exist_ok=True)
    with open(os.path.join(client.runtime_dir, "persister.pid"), "w") as f:
        f.write("4242\n")
    peer.sendall(P.encode(P.fail(errors.PersisterError("world size 2 differs from the run's 4"))))
    with pytest.raises(errors.PersisterError, match="world size 2") as info:
        client.request("hello", rank=0)
    told = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "persister pid 4242" in told and "pid None" not in told, told


def test_an_older_persister_refusing_the_version_field_is_a_protocol_version_error(pair, tmp_path):
    """A persister of an older snapckpt (no protocol version in its ``hello``) refuses the field itself, with
    a field error that says nothing of the cause. The rank raises ProtocolVersionError naming the persister's
    pid and ``snapckpt stop``, and closes the connection."""
    client, peer = pair
    os.makedirs(client.runtime_dir, exist_ok=True)
    with open(os.path.join(client.runtime_dir, "persister.pid"), "w") as f:
        f.write("4242\n")
    old = P.ProtocolError("op 'hello': fields ['checkpoint_dir', 'protocol'] != expected ['checkpoint_dir']")
    peer.sendall(P.encode(P.fail(old)))
    with pytest.raises(errors.ProtocolVersionError) as info:
        client._hello("token", {"rank": 0})
    msg = str(info.value)
    assert f"this training process runs protocol version {P.PROTOCOL_VERSION}" in msg, msg
    assert "persister (pid 4242) an older snapckpt" in msg and "snapckpt stop" in msg, msg
    assert client.sock is None
