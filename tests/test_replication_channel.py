"""The peer channel of the peer-memory tier (snapckpt/persister/channel.py, replication.py), unit level:
real TCP sockets on 127.0.0.1, a real replica store in a tmpfs-like directory, no training job.

The end-to-end behaviour (a lost node resumed from a peer replica) is tested on the multi-node rig in
tests/test_multinode.py."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading

import pytest
import xxhash

from snapckpt.ondisk.manifest import SIDECAR, fail_marker_name
from snapckpt.persister import channel
from snapckpt.persister.arena import SlotFiles
from snapckpt.persister.replication import Replicator, _put, replica_file_name
from snapckpt.persister.slots import Run, SlotTable

RUN = "0123456789abcdef" + "a" * 12
SECRET = bytes(range(32))


@pytest.fixture
def replicator(tmp_path):
    lock = threading.RLock()
    arena = SlotFiles(str(tmp_path / "arena"))
    table = SlotTable(arena, lock)
    rep = Replicator(arena.directory, table, lock)
    run = Run(RUN, 2, [0], True, str(tmp_path / "ckpt"), None, 60.0, True, False)
    with lock:
        rep.configure(run, SECRET, [])
    port = rep.listen("127.0.0.1")
    yield rep, port
    rep.shutdown()
    table.shutdown()


def _meta(step):
    return {"step": step, "run_id": RUN, "world_size": 2, "dir_id": "d", "index_offset": 64, "index_nbytes": 10,
            "dirname": f"step_{step:08d}", "tracker_name": "latest", "tracker_content": f"step_{step:08d}",
            "persistable": True}


def test_wrong_secret_is_refused_and_logged(replicator, caplog):
    """A peer that does not know the run's secret (or names a run this persister does not replicate) is
    refused before any data: the client gets AuthError, the server logs the refusal, nothing is stored."""
    rep, port = replicator
    caplog.set_level(logging.WARNING, logger="snapckpt.persister")
    with pytest.raises(channel.AuthError, match="refused"):
        channel.connect("127.0.0.1", port, RUN, b"\x00" * 32)
    with pytest.raises(channel.AuthError, match="refused"):
        channel.connect("127.0.0.1", port, "f" * 28, SECRET)  # a run it does not serve
    assert any("refused a peer connection" in r.getMessage() and "does not know the secret" in r.getMessage()
               for r in caplog.records), caplog.text
    assert any("does not replicate" in r.getMessage() for r in caplog.records), caplog.text
    assert rep.replicas == {} and not [n for n in os.listdir(rep.arena_dir) if n.startswith("p")]


def test_replica_replaced_only_when_complete(replicator):
    """With the right secret a snapshot is stored as the rank's replica (its bytes and checksum); a newer
    one whose bytes do not match their checksum is refused and the complete older replica stays."""
    rep, port = replicator
    sock = channel.connect("127.0.0.1", port, RUN, SECRET)
    try:
        data = os.urandom(3 << 20)
        checksum = _put(sock, 1, _meta(3), memoryview(data))
        assert checksum == xxhash.xxh3_64(data).hexdigest()
        path = os.path.join(rep.arena_dir, replica_file_name(1))
        with open(path, "rb") as f:
            assert f.read() == data
        assert [(h["rank"], h["step"], h["kind"]) for h in rep.holdings()] == [(1, 3, "replica")]
        # a damaged send of step 6: the wrong checksum in the trailer
        channel.send_frame(sock, {"op": "put", "rank": 1, **_meta(6)}, 1024)
        channel.send_payload(sock, memoryview(b"x" * 1024))
        channel.send_frame(sock, {"checksum": "0" * 16})
        reply, _ = channel.recv_header(sock)
        assert not reply["ok"] and "checksum mismatch" in reply["error"]
    finally:
        sock.close()
    assert rep.replica_of(1, 3, RUN) is not None and rep.replica_of(1, 6, RUN) is None
    with open(path, "rb") as f:
        assert f.read() == data
    assert not os.path.exists(path + ".part")


def test_a_snapshot_replaced_while_still_queued_is_reported_lagging(replicator):
    """A sender holds one snapshot per rank besides the one in flight: a newer snapshot of the rank replaces
    a queued one, which is then never sent and reported as ``replica_lagging`` (for the rank's events), to
    that run only (break-it run: a restarted job's first snapshot reported the previous run's notes)."""
    from snapckpt.persister.replication import _Sender
    from snapckpt.persister.slots import Slot

    rep, port = replicator
    run = Run(RUN, 2, [0], True, "/nonexistent", None, 60.0, True, False)
    sender = _Sender(rep, run, 1, "127.0.0.1", port)  # not started: as if a send were in flight
    older, newer = Slot(0, "s0", step=3, seq=1), Slot(1, "s1", step=6, seq=2)
    sender.offer(0, older)
    assert rep.drain_notes(RUN, 0) == []
    sender.offer(0, newer)
    notes = rep.drain_notes(RUN, 0)
    assert [(n["kind"], n["step"]) for n in notes] == [("replica_lagging", 3)]
    assert "still in flight when step 6 came" in notes[0]["reason"]
    assert sender.queue == {0: (newer, 2, 6)}
    # a restarted job (a new run) on the same persister never reports the earlier run's notes
    sender.offer(0, Slot(0, "s0", step=9, seq=3))
    assert rep.drain_notes("a-later-run", 0) == [] and rep.drain_notes(RUN, 0) == []


def test_a_replica_damaged_while_held_is_never_served_or_written_as_intact(replicator, tmp_path, caplog):
    """Bytes of a held replica that change after it arrived (a stray write into shared memory): a peer's fetch
    gets the checksum taken on arrival, which no longer matches what it receives, so the fetch is refused;
    the stand-in crash flush refuses to write it as a committed part. A sender that vanishes mid-transfer
    leaves no ``.part`` file behind (break-it run: a damaged replica was loaded and committed)."""
    import time

    from snapckpt.persister import replica_flush

    rep, port = replicator
    data = os.urandom(1 << 20)
    sock = channel.connect("127.0.0.1", port, RUN, SECRET)
    try:
        _put(sock, 1, _meta(3), memoryview(data))
    finally:
        sock.close()
    path = os.path.join(rep.arena_dir, replica_file_name(1))
    with open(path, "r+b") as f:  # flip bytes in the middle
        f.seek(len(data) // 2)
        f.write(bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64]))

    sock = channel.connect("127.0.0.1", port, RUN, SECRET)
    try:
        channel.send_frame(sock, {"op": "get", "rank": 1, "step": 3, "run_id": RUN})
        header, nbytes = channel.recv_header(sock)
        assert header["ok"] and header["kind"] == "replica" and nbytes == len(data)
        got = bytearray(nbytes)
        hasher = xxhash.xxh3_64()
        channel.recv_payload_into(sock, memoryview(got), hasher)
        trailer, _ = channel.recv_header(sock)
    finally:
        sock.close()
    assert trailer["checksum"] == xxhash.xxh3_64(data).hexdigest() != hasher.hexdigest()  # the fetcher refuses

    held = rep.replica_of(1, 3, RUN)
    run = Run(RUN, 2, [0], True, str(tmp_path / "ckpt"), None, 60.0, True, False)
    with pytest.raises(ValueError, match="no longer matches the checksum taken when it arrived"):
        replica_flush._write(run, held, 3, str(tmp_path / "partial"), "test")
    assert not os.path.exists(tmp_path / "partial")
    # the stand-in leaves the rank's failure marker instead, so the commit fails now, not at its timeout
    assert replica_flush.write_or_fail(run, held, 3, str(tmp_path / "partial"), "test") is False
    assert os.listdir(tmp_path / "partial") == [SIDECAR]
    assert os.listdir(tmp_path / "partial" / SIDECAR) == [os.path.basename(fail_marker_name(1))]
    marker = json.loads((tmp_path / "partial" / fail_marker_name(1)).read_text())
    assert marker["step"] == 3 and "no longer matches the checksum" in json.dumps(marker["error"])

    caplog.set_level(logging.WARNING, logger="snapckpt.persister")
    sock = channel.connect("127.0.0.1", port, RUN, SECRET)
    channel.send_frame(sock, {"op": "put", "rank": 0, **_meta(6)}, 1 << 20)
    channel.send_payload(sock, memoryview(b"y" * 1000))
    sock.close()  # gone mid-transfer
    part = os.path.join(rep.arena_dir, replica_file_name(0)) + ".part"
    deadline = time.monotonic() + 10  # the receiving thread opens the part file, then meets the closed socket
    dropped = lambda: [r for r in caplog.records if "went away mid-transfer" in r.getMessage()]  # noqa: E731
    while not dropped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dropped() and not os.path.exists(part)


def test_commit_notices_travel_over_the_channel_and_only_wake(replicator):
    """Commit notices (persister/commit_notices.py): node 1's ``part_done`` reaches the committer's node and
    calls its wake callback with the save and its generation; ``commit_ended`` goes to every other node, saying
    committed or failed (``committed`` / ``aborted``); a notice naming
    another run than the one its connection authenticated for is ignored, and so is one without a generation;
    a node that posted port 0 (no channel) is skipped, not waited for."""
    from snapckpt.persister.commit_notices import CommitNotices

    rep, port = replicator
    got, aborts, commits, arrived = [], [], [], threading.Event()

    def on_notice(run_id, step, dirname, gen, aborted=False, committed=False):
        got.append((run_id, step, dirname, gen))
        aborts.append(aborted)
        commits.append(committed)
        arrived.set()

    receiver = CommitNotices({RUN: SECRET}.get, on_notice)  # the committer's node (node 0)
    rep.on_notice = receiver.receive
    sender = CommitNotices({RUN: SECRET}.get, lambda *a: None)  # node 1
    sender.configure(RUN, 1, 0, {0: ("127.0.0.1", port), 1: ("127.0.0.1", 1), 2: ("127.0.0.1", 0)})
    try:
        sender.part_done(RUN, 6, "step_00000006", 2, [3, 2])
        assert arrived.wait(10) and got == [(RUN, 6, "step_00000006", 2)]
        arrived.clear()
        sock = channel.connect("127.0.0.1", port, RUN, SECRET)
        channel.send_frame(sock, {"op": "part_done", "run_id": "f" * 28, "step": 7, "dirname": "step_00000007",
                                  "gen": 1})
        channel.send_frame(sock, {"op": "commit_ended", "run_id": RUN, "step": 7, "dirname": "step_00000007",
                                  "state": "committed"})  # no generation: malformed, dropped
        channel.send_frame(sock, {"op": "commit_ended", "run_id": RUN, "step": 7, "dirname": "step_00000007",
                                  "gen": 1, "state": "committed"})
        assert arrived.wait(10) and got[1:] == [(RUN, 7, "step_00000007", 1)]  # the other run's was dropped
        sock.close()
        assert receiver.received == 2
        # the committer's side: commit_ended goes to nodes 0 and 1 of a 3-node map, not to node 2 (port 0)
        committer = CommitNotices({RUN: SECRET}.get, lambda *a: None)
        committer.configure(RUN, 1, 1, {0: ("127.0.0.1", port), 1: ("127.0.0.1", 1), 2: ("127.0.0.1", 0)})
        arrived.clear()
        committer.commit_ended(RUN, 8, "step_00000008", 1, "committed")
        assert arrived.wait(10) and got[-1] == (RUN, 8, "step_00000008", 1) and aborts[-1] is False and commits[-1]
        arrived.clear()
        committer.commit_ended(RUN, 9, "step_00000009", 3, "failed")  # ends the watchers' wait (an abort)
        assert arrived.wait(10) and got[-1] == (RUN, 9, "step_00000009", 3) and aborts[-1] is True and not commits[-1]
        assert commits[0] is False  # a part_done notice says nothing of the commit
        committer.shutdown()
        assert sorted(n for _, n in committer.links) == [0]
    finally:
        sender.shutdown()


def test_commit_ended_reports_whether_every_other_node_got_it(replicator):
    """``commit_ended(..., delivered=)`` (a late commit's retirement waits for it, Scheduler._commit_task):
    ``True`` once the notice was sent to every other node; ``False`` at once where a node has no channel
    (port 0), and once a node's notice is lost (nothing listens at its address)."""
    from snapckpt.persister.commit_notices import CommitNotices

    rep, port = replicator
    arrived = threading.Event()
    rep.on_notice = CommitNotices({RUN: SECRET}.get, lambda *a, **k: arrived.set()).receive
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    outcomes = {}
    for name, addrs in (("reached", {0: ("127.0.0.1", port), 1: ("127.0.0.1", 1)}),
                        ("no_channel", {0: ("127.0.0.1", port), 1: ("127.0.0.1", 1), 2: ("127.0.0.1", 0)}),
                        ("lost", {0: ("127.0.0.1", port), 1: ("127.0.0.1", 1), 2: ("127.0.0.1", dead)})):
        committer = CommitNotices({RUN: SECRET}.get, lambda *a: None)
        committer.configure(RUN, 1, 1, addrs)
        got, done = [], threading.Event()
        committer.commit_ended(RUN, 8, "step_00000008", 1, "committed",
                               delivered=lambda sent, got=got, done=done: (got.append(sent), done.set()))
        assert done.wait(30)
        committer.shutdown()
        outcomes[name] = got
    assert outcomes == {"reached": [True], "no_channel": [False], "lost": [False]}
    assert arrived.is_set()


def test_notice_links_end_once_the_run_is_over_on_the_node(replicator, tmp_path):
    """A node's notice link (a thread and a kept socket per run and target node) ends once the run is over
    on that node (:meth:`Scheduler.release_if_over`: no local rank connected, no save of it pending here),
    not at the persister's exit; a later notice of the run opens a new link."""
    from snapckpt.persister.commit_notices import CommitNotices
    from snapckpt.persister.scheduler import Result, Scheduler

    rep, port = replicator
    arrived = threading.Event()
    rep.on_notice = CommitNotices({RUN: SECRET}.get, lambda *a, **k: arrived.set()).receive
    sender = CommitNotices({RUN: SECRET}.get, lambda *a: None)  # node 1
    sender.configure(RUN, 1, 0, {0: ("127.0.0.1", port)})
    lock = threading.RLock()
    sched = Scheduler(SlotTable(None, lock), lock)
    sched.notices = sender
    run = Run(RUN, 2, [1], False, str(tmp_path), None, 60.0, True, False)
    try:
        sender.part_done(RUN, 6, "step_00000006", 1, [1])
        assert arrived.wait(10)
        link = sender.links[(RUN, 0)]
        run.connected.add(1)
        res = sched.results[(RUN, 6, "step_00000006")] = Result()
        with lock:
            sched.release_if_over(run)  # rank 1 is connected
            run.connected.clear()
            sched.release_if_over(run)  # the commit of step 6 is pending
        link.join(0.5)
        assert link.is_alive() and sender.links
        res.state = "committed"
        with lock:
            sched.release_if_over(run)
        link.join(10)
        assert not link.is_alive() and link.sock is None and not sender.links
        arrived.clear()
        sender.part_done(RUN, 7, "step_00000007", 1, [1])  # the run's node map is kept
        assert arrived.wait(10) and sender.links[(RUN, 0)] is not link
    finally:
        sender.shutdown()
        sched.shutdown()


def _greeter(magic):
    """A listener on 127.0.0.1 that greets each connection with ``magic`` and a challenge, then reads until closed
    (a persister of another snapckpt version, or another program); returns its port and what it was sent."""
    srv = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(magic + os.urandom(32))
            while data := conn.recv(4096):
                received.append(data)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], received


def test_a_peer_persister_of_another_snapckpt_version_is_refused_naming_both_versions(replicator, caplog):
    """Persisters of two snapckpt versions in one job (a node upgraded, another not) would misread each other's
    notices (version 1 sent no save generation). The client reads the version in the server's greeting and
    refuses before it sends anything: a PeerVersionError naming both versions and the fix. A commit notice to
    such a node is reported lost at WARNING, not retried; a listener that is not snapckpt at all stays a plain
    ChannelError."""
    from snapckpt.persister.commit_notices import CommitNotices

    assert channel.MAGIC == b"SNAPCKPT-PEER3\n" and channel.PEER_PROTOCOL == 3
    port, received = _greeter(b"SNAPCKPT-PEER1\n")
    with pytest.raises(channel.PeerVersionError,
                       match=r"peer protocol 1, this one 3: the job's nodes run different snapckpt versions"):
        channel.connect("127.0.0.1", port, RUN, SECRET)
    assert received == []  # not even the run id
    port, _ = _greeter(b"HTTP/1.1 400 \r\n")
    with pytest.raises(channel.ChannelError, match="not a snapckpt persister") as e:
        channel.connect("127.0.0.1", port, RUN, SECRET)
    assert not isinstance(e.value, channel.PeerVersionError)

    port, _ = _greeter(b"SNAPCKPT-PEER2\n")
    caplog.set_level(logging.INFO, logger="snapckpt.persister")
    committer = CommitNotices({RUN: SECRET}.get, lambda *a: None)
    committer.configure(RUN, 0, 0, {0: ("127.0.0.1", 1), 1: ("127.0.0.1", port)})  # node 0 sends to node 1
    got, done = [], threading.Event()
    committer.commit_ended(RUN, 8, "step_00000008", 1, "committed",
                           delivered=lambda sent: (got.append(sent), done.set()))
    assert done.wait(30)
    committer.shutdown()
    assert got == [False]
    lost = [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert [r.levelno for r in lost] == [logging.WARNING] and "peer protocol 2, this one 3" in lost[0].getMessage()
