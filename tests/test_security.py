"""Security (issue 7, item 3): owner-only and per-job files, an authenticating persister, no unpickling of
snapckpt's own records, paths that never leave the checkpoint directory, explicit trust for native files.

Trust model under test: one user on one host. Other users get no access at all (owner-only directories,
sockets, tokens, shared memory; a socket peer of another uid is refused); processes of the same user that
are not this job's ranks must present this job's secret token; nothing snapckpt reads back as its own
record (manifest, part markers, arena index, control messages) is ever unpickled; native checkpoint files
are unpickled only with the trust decision of ``weights_only``.

Single-rank Checkpointers in the test process (no torch.distributed), real persister processes; the
DeepSpeed tags run in one DeepSpeed process (tests/workers/security_worker.py).
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import stat
import struct

import psutil
import pytest
import torch
import xxhash

from _harness import run_ranks, result_lines, wait_until
from snapckpt import Checkpointer, StorageType
from snapckpt.errors import (CheckpointCorruptError, CommitTimeoutError,
                             PersisterError, UnsafeCheckpointError)
from snapckpt.ondisk.manifest import MANIFEST
from snapckpt.persister import protocol as P
from snapckpt.persister.client import job_dirs, job_key
from snapckpt.persister.commit import CommitRequest, commit
from snapckpt.persister.server import HELLO_TIMEOUT_SECS
from snapckpt.storage.posix import PosixStorage

OPTS = dict(persister_idle_timeout_secs=5, commit_timeout_secs=30, request_timeout_secs=30,
            coordination_timeout_secs=30, fsync=False)
NOBODY = 65534


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


class Boom:
    """A malicious pickle: unpickling it creates the directory ``path`` (proof that it ran)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _evil(tmp) -> tuple:
    marker = os.path.join(str(tmp), "PWNED")
    return marker, pickle.dumps(Boom(marker), protocol=2)


def _job_dirs(snap_env, ck: Checkpointer) -> tuple:
    return job_dirs(snap_env.runtime_root, snap_env.shm_root, ck.job)


def _fix_manifest(step_dir: str, name: str) -> None:
    """Re-record size and checksum of ``name`` in the manifest (what an attacker with write access does)."""
    mpath = os.path.join(step_dir, MANIFEST)
    with open(mpath) as f:
        m = json.load(f)
    with open(os.path.join(step_dir, name), "rb") as f:
        data = f.read()
    m["files"][name].update(nbytes=len(data), xxh3_64=xxhash.xxh3_64(data).hexdigest())
    with open(mpath, "w") as f:
        json.dump(m, f)


# ------------------------------------------------------------------------------ owner-only, per job
def test_security_owner_only_files_per_job_and_umask(snap_env):
    """Owner-only and per job: three jobs on one host (A and C in one directory, C with another job_id,
    both started under umask 022; B in its own directory, started under umask 077). Right: everything
    under the runtime and shared-memory roots is owner-only (directories 0700; socket, token, locks, log
    and slot files 0600) whatever the umask; each job has its own persister, runtime directory, socket,
    token (different secrets) and arena, and each rank maps only its own job's slot files. Checkpoint
    files and directories follow the umask of the process that started the persister, as torch.save and
    the frameworks' own saves do: 0644/0755 for A, 0600/0700 for B."""
    old = os.umask(0o022)
    try:
        a_dir, b_dir = os.path.join(snap_env.ckpt_dir, "a"), os.path.join(snap_env.ckpt_dir, "b")
        jobs = [Checkpointer(a_dir, **OPTS)]
        os.umask(0o077)
        jobs.append(Checkpointer(b_dir, **OPTS))
        os.umask(0o022)
        jobs.append(Checkpointer(a_dir, job_id="c", **OPTS))
        try:
            for i, ck in enumerate(jobs):
                ck.save({"w": torch.full((1000,), float(i))}, 1, StorageType.MEMORY)
                ck.save({"w": torch.full((1000,), float(i))}, 2 + i, StorageType.DISK).wait()
            for root in (snap_env.runtime_root, snap_env.shm_root):
                for d, dirs, files in os.walk(root):
                    assert _mode(d) == 0o700, f"{d} is {oct(_mode(d))}"
                    for n in files:
                        p = os.path.join(d, n)
                        assert _mode(p) == 0o600, f"{p} is {oct(_mode(p))}"
            dirs = [_job_dirs(snap_env, ck) for ck in jobs]
            assert len({rt for rt, _ in dirs}) == 3 and len({ar for _, ar in dirs}) == 3
            assert len({ck.persister_pid for ck in jobs}) == 3
            tokens = []
            for ck, (rt, arena) in zip(jobs, dirs):
                mapped = {m.path for m in ck._maps.maps.values()}
                assert mapped and all(os.path.dirname(p) == arena for p in mapped), (arena, mapped)
                assert stat.S_ISSOCK(os.stat(os.path.join(rt, "persister.sock")).st_mode)
                for n in ("persister.sock", "token", "spawn.lock", "persister.pid"):
                    assert _mode(os.path.join(rt, n)) == 0o600, n
                with open(os.path.join(rt, "token")) as f:
                    tokens.append(f.read())
            assert len(set(tokens)) == 3 and all(len(t) == 32 for t in tokens)
            for d, step, dmode, fmode in ((a_dir, 2, 0o755, 0o644), (b_dir, 3, 0o700, 0o600)):
                step_dir = os.path.join(d, f"step_{step:08d}")
                assert _mode(step_dir) == dmode and _mode(os.path.join(step_dir, "rank_00000.pt")) == fmode
                assert _mode(os.path.join(step_dir, MANIFEST)) == fmode
                assert _mode(os.path.join(d, "latest")) == fmode
        finally:
            for ck in jobs:
                ck.close()
    finally:
        os.umask(old)


def _as_nobody(fn) -> dict:
    """Run ``fn()`` in a forked child with uid/gid 65534; return its dict result (errors as type names)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only os calls, then _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = {"child_error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_security_other_user_gets_nothing(snap_env):
    """Another user of the host (uid 65534, the tests run as root like the rest of the suite): connecting
    to the job's socket, reading its token, listing or opening its arena and slot files are all refused
    by the kernel (owner-only modes); the job keeps working. The test's runtime and shared-memory roots
    are made world-accessible (1777) like /tmp and /dev/shm, so that only snapckpt's own modes protect."""
    os.chmod(snap_env.runtime_root, 0o1777)
    os.chmod(snap_env.shm_root, 0o1777)
    with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
        ck.save({"w": torch.ones(1000)}, 1, StorageType.MEMORY)
        rt, arena = _job_dirs(snap_env, ck)
        slot = os.path.join(arena, sorted(os.listdir(arena))[0])

        def attempts() -> dict:
            out = {}
            for what, call in (
                    ("connect", lambda: socket.socket(socket.AF_UNIX).connect(os.path.join(rt, "persister.sock"))),
                    ("token", lambda: open(os.path.join(rt, "token")).read()),
                    ("list_arena", lambda: os.listdir(arena)),
                    ("open_slot", lambda: open(slot, "rb").read(1))):
                try:
                    call()
                    out[what] = "allowed"
                except OSError as e:
                    out[what] = type(e).__name__
            return out

        got = _as_nobody(attempts)
        assert got == {"connect": "PermissionError", "token": "PermissionError", "list_arena": "PermissionError",
                       "open_slot": "PermissionError"}, got
        assert torch.equal(ck.load()["w"], torch.ones(1000)) and ck.last_load.step == 1


# ------------------------------------------------------------------------------------ authentication
def _hello(token: str, job: str, ckpt: str) -> dict:
    return {"op": "hello", "protocol": P.PROTOCOL_VERSION, "token": token, "job": job, "run_id": job + "0" * 12, "rank": 0, "world_size": 1,
            "local_ranks": [0], "committer": True, "pid": os.getpid(), "checkpoint_dir": ckpt,
            "slots_per_rank": 2, "keep_last": -1, "commit_timeout_secs": 5.0, "flush_on_crash": False,
            "fsync": False, "dir_id": "", "remote_dir": "",
            "peer_timeout_secs": 10.0}


def _attack(sock_path: str, payload: bytes) -> tuple:
    """Send ``payload`` on a fresh connection; return (first reply line or None, whether the persister then
    closed the connection)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock_path)
    try:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the persister hung up mid-way (an oversized line or a flood)
        rfile = s.makefile("rb")
        try:
            line = rfile.readline()
            rest = rfile.readline() if line else b""
        except ConnectionResetError:
            line, rest = b"", b""
        rfile.close()
        return (json.loads(line) if line else None), rest == b""
    finally:
        s.close()


def test_security_persister_authenticates_and_survives_attacks(snap_env):
    """The persister authenticates with a secret, not a path: raw AF_UNIX clients of the same user with no
    hello, a wrong token, another job's token, this job's token with another job's key, and malformed
    messages (not JSON, not UTF-8, a JSON list, an unknown or mistyped op, extra fields, 100 000 levels of
    nesting, a malicious pickle, a 2 MiB line, a flood of 20 000 requests never read) each get at most one
    refusal ({"ok": false} naming the cause) and are disconnected. The pickle never runs. Right: the same
    persister process then serves the real job: its memory snapshot loads, and a DISK save commits and
    loads. A raw connection that stays open and silent throughout is dropped after HELLO_TIMEOUT_SECS, so
    the persister still exits once the job has closed."""
    marker, evil = _evil(snap_env.tmp)
    other = Checkpointer(os.path.join(snap_env.ckpt_dir, "other"), **OPTS)
    try:
        with Checkpointer(snap_env.ckpt_dir, **OPTS) as ck:
            ck.save({"w": torch.ones(1000)}, 1, StorageType.MEMORY)
            pid = ck.persister_pid
            rt, _ = _job_dirs(snap_env, ck)
            ort, _ = _job_dirs(snap_env, other)
            sock_path = os.path.join(rt, "persister.sock")
            with open(os.path.join(rt, "token")) as f:
                token = f.read()
            with open(os.path.join(ort, "token")) as f:
                other_token = f.read()
            idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            idle.settimeout(30)
            idle.connect(sock_path)
            line = lambda obj: (json.dumps(obj) + "\n").encode()  # noqa: E731
            refused = {
                "no hello": (line({"op": "held"}), "hello"),
                "wrong token": (line(_hello("0" * 32, ck.job, snap_env.ckpt_dir)), "authentication"),
                "other job's token": (line(_hello(other_token, ck.job, snap_env.ckpt_dir)), "authentication"),
                "other job's key": (line(_hello(token, other.job, snap_env.ckpt_dir)), "authentication"),
                "token of wrong type": (line({**_hello(token, ck.job, snap_env.ckpt_dir), "token": 1}), "token"),
                "extra field": (line({**_hello(token, ck.job, snap_env.ckpt_dir), "x": 1}), "fields"),
                "not json": (b"this is not json\n", "not JSON"),
                "not utf-8": (b"\xff\xfe\x00garbage\n", "not JSON"),
                "json list": (b"[1, 2]\n", "not a JSON object"),
                "unknown op": (b'{"op": "format_disk"}\n', "unknown op"),
                "mistyped op": (b'{"op": 7}\n', "unknown op"),
                "deep nesting": (b"[" * 100_000 + b"\n", "not JSON"),
                "pickle": (evil + b"\n", "not JSON"),
            }
            for what, (payload, cause) in refused.items():
                reply, closed = _attack(sock_path, payload)
                assert reply is not None and reply["ok"] is False and cause in reply["error"]["message"], \
                    (what, reply)
                assert closed, f"{what}: the connection stayed open after the refusal"
            reply, closed = _attack(sock_path, b"x" * (2 << 20))  # no newline: over the 1 MiB message limit
            assert reply is None and closed
            # a flood never read: one refusal at most (it may be lost when the persister hangs up), then closed
            reply, closed = _attack(sock_path, b'{"op": "held"}\n' * 20_000)
            assert closed and (reply is None or "hello" in reply["error"]["message"]), reply
            assert not os.path.exists(marker), "a pickle sent to the persister was unpickled"
            assert ck.persister_pid == pid and psutil.pid_exists(pid)
            out = ck.load()
            assert (ck.last_load.step, ck.last_load.tier) == (1, StorageType.MEMORY)
            assert torch.equal(out["w"], torch.ones(1000))
            ck.save({"w": torch.zeros(10)}, 2, StorageType.DISK).wait()
            assert ck.latest_step() == 2 and torch.equal(ck.load(step=2)["w"], torch.zeros(10))
        # the idle connection never said hello: dropped after HELLO_TIMEOUT_SECS, it cannot keep the
        # persister alive once the job has closed
        assert wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                          timeout=HELLO_TIMEOUT_SECS + 20), "a silent connection kept the persister alive"
        assert idle.recv(1) == b""
        idle.close()
    finally:
        other.close()


# ----------------------------------------------------------------------- snapckpt's own files: JSON only
def test_security_planted_pickles_in_own_records_never_run(snap_env, tmp_path):
    """snapckpt's own records are JSON and never unpickled. A malicious pickle planted (a) as a committed
    checkpoint's manifest.json, (b) as a rank's part marker in a partial directory, (c) as the index of a
    memory snapshot in the arena slot. Right: it never runs; (a) the load finds nothing and the error names
    the manifest's path; (b) the commit times out naming the marker's path; (c) the memory snapshot is
    unreadable and the error names the slot file. (A pickle sent as a control message: the test above.)"""
    marker, evil = _evil(tmp_path)
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save({"w": torch.ones(100)}, 1, StorageType.DISK).wait()
    mpath = os.path.join(d, "step_00000001", MANIFEST)
    with open(mpath, "wb") as f:
        f.write(evil)
    assert wait_until(lambda: not snap_env.persisters(), 15)
    with Checkpointer(d, **OPTS) as ck:
        with pytest.raises(CheckpointCorruptError) as ei:
            ck.load()
        assert mpath in str(ei.value), str(ei.value)
        # (c) a memory snapshot whose index is replaced by a pickle
        ck.save({"w": torch.full((100,), 3.0)}, 3, StorageType.MEMORY)
        (slot,) = [s for s in ck._request("held")["slots"] if s["step"] == 3]
        with open(slot["path"], "r+b") as f:
            magic, version, step, off, n = struct.unpack("<8sIqQQ", f.read(36))
            f.seek(off)
            f.write(evil)
            f.seek(0)
            f.write(struct.pack("<8sIqQQ", magic, version, step, off, len(evil)))
        with pytest.raises(CheckpointCorruptError) as ei:
            ck.load()
        assert slot["path"] in str(ei.value) and "index" in str(ei.value), str(ei.value)
    # (b) a part marker that is a pickle: the committer never counts it, and names it at the deadline
    run = "feedfacefeedfacefeedface0000"
    side = os.path.join(d, f".step_00000009.partial-{run}", ".snapckpt")
    os.makedirs(side)
    with open(os.path.join(side, "part_00000.json"), "wb") as f:
        f.write(evil)
    req = CommitRequest(checkpoint_dir=d, dirname="step_00000009", step=9, run_id=run, world_size=1,
                        timeout_secs=0.5, keep_last=None, tracker_name="", tracker_content="")
    with pytest.raises(CommitTimeoutError) as ei:
        commit(PosixStorage(fsync=False), PosixStorage(), req)
    assert os.path.join(side, "part_00000.json") in str(ei.value), str(ei.value)
    assert not os.path.exists(os.path.join(d, "step_00000009"))
    assert not os.path.exists(marker), "a planted pickle was executed"


def test_security_native_files_trust_decision(snap_env, tmp_path):
    """weights_only is the trust decision for native files. A rank file replaced by a malicious torch.save
    archive, with size and CRC-32 re-recorded in the manifest (an attacker with write access to the
    directory). Right: with the default weights_only=True the load raises UnsafeCheckpointError naming the
    file and the option, the pickle never runs, and no older checkpoint is silently loaded instead."""
    marker, _ = _evil(tmp_path)
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save({"w": torch.ones(100)}, 1, StorageType.DISK).wait()
        ck.save({"w": torch.ones(100)}, 2, StorageType.DISK).wait()
    step_dir = os.path.join(d, "step_00000002")
    torch.save({"w": Boom(marker)}, os.path.join(step_dir, "rank_00000.pt"))
    _fix_manifest(step_dir, "rank_00000.pt")
    assert wait_until(lambda: not snap_env.persisters(), 15)
    with Checkpointer(d, **OPTS) as ck:
        with pytest.raises(UnsafeCheckpointError) as ei:
            ck.load()
        msg = str(ei.value)
        assert os.path.join(step_dir, "rank_00000.pt") in msg and "weights_only" in msg, msg
    assert not os.path.exists(marker), "torch.load ran the planted pickle"


# ---------------------------------------------------------------------------------- tags and paths
ODD_TAGS = ["run 1: [a]-é", "with space", "colon:s", "(paren) {brace} [bracket]", "ünï 步 🚀"]


def test_security_odd_tags_round_trip_and_escapes_refused(snap_env):
    """Tags with spaces, colons, brackets and non-ASCII save, commit, are named by the tracker and load
    back, from memory and (after a restart) from disk. Refused before anything is written: a dirname or
    tracker name with '..', '/' or NUL, and file names that are absolute, contain '..', '\\', an empty
    component or NUL or take snapckpt's own record names (a file in a sub-directory is allowed and lands
    inside); nothing appears outside the checkpoint directory (itself named with
    spaces, a colon, brackets and non-ASCII)."""
    d = os.path.join(snap_env.tmp, "ckpt dir: [ü] (1)")
    parent = os.path.dirname(d)
    before = set(os.listdir(parent))
    with Checkpointer(d, **OPTS) as ck:
        before = set(os.listdir(parent))
        for kw in (dict(dirname="../escape"), dict(dirname="/abs"), dict(dirname="a\x00b"),
                   dict(dirname="ok", tracker_name="../latest"), dict(dirname="ok", tracker_name="/tmp/x")):
            with pytest.raises(ValueError):
                ck.save_files({"rank_00000.pt": {"w": torch.ones(3)}}, 4, StorageType.DISK,
                               **{"tracker_name": "latest", "tracker_content": "x", **kw})
        for name in ("../x.pt", "/etc/x.pt", "a/../../b.pt", "a//b.pt", "a/", "a\\b.pt", "nul\x00.pt",
                     "a/.snapckpt/x", ".snapckpt/manifest.json", ".snapckpt/part_00000.json", ".snapckpt", "..",
                     ".snapckpt/../../x"):
            with pytest.raises(ValueError):
                ck.save_files({name: {"w": torch.ones(3)}}, 4, StorageType.DISK, dirname="ok",
                               tracker_name=None)
        assert set(os.listdir(parent)) == before and not os.path.exists(os.path.join(d, "ok"))
        # a file in a sub-directory of the checkpoint (DeepSpeed's global_stepN/ in a Trainer folder) stays inside
        ck.save_files({"sub/b.pt": {"w": torch.ones(3)}}, 5, StorageType.DISK, dirname="ok", tracker_name=None).wait()
        assert os.path.isfile(os.path.join(d, "ok", "sub", "b.pt")) and set(os.listdir(parent)) == before
        for i, tag in enumerate(ODD_TAGS):
            ck.save_files({"rank_00000.pt": {"w": torch.full((5,), float(i))}}, 10 + i, StorageType.DISK,
                           dirname=tag, tracker_name="latest", tracker_content=tag).wait()
            assert os.path.isfile(os.path.join(d, tag, MANIFEST))
            with open(os.path.join(d, "latest"), encoding="utf-8") as f:
                assert f.read() == tag
            out = ck.load(step=10 + i)
            assert torch.equal(out["w"], torch.full((5,), float(i))), tag
    assert set(os.listdir(parent)) == before
    assert wait_until(lambda: not snap_env.persisters(), 15)
    with Checkpointer(d, **OPTS) as ck:  # a new persister: memory is gone, disk remains
        for i, tag in enumerate(ODD_TAGS):
            out, cand = ck.load_with(lambda c: c.files(), dirname=tag)
            assert cand.tier == StorageType.DISK and torch.equal(out["rank_00000.pt"]["w"],
                                                                torch.full((5,), float(i))), tag
    on_disk = torch.load(os.path.join(d, ODD_TAGS[-1], "rank_00000.pt"), weights_only=True)
    assert torch.equal(on_disk["w"], torch.full((5,), float(len(ODD_TAGS) - 1)))


def test_security_manifest_naming_outside_files_is_refused(snap_env, tmp_path):
    """A manifest edited to list '../../outside.pt' (a malicious archive beside the checkpoint directory,
    with the right size and CRC-32) for rank 0. Right: even with weights_only=False (full trust) the
    loader never opens a path outside the checkpoint: the checkpoint is skipped as damaged, the error
    names the manifest and the bad name, and the archive's pickle never runs."""
    marker, _ = _evil(tmp_path)
    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save({"w": torch.ones(100)}, 1, StorageType.DISK).wait()
    outside = os.path.join(os.path.dirname(d), "outside.pt")
    torch.save({"w": Boom(marker)}, outside)
    step_dir = os.path.join(d, "step_00000001")
    mpath = os.path.join(step_dir, MANIFEST)
    with open(mpath) as f:
        m = json.load(f)
    with open(outside, "rb") as f:
        data = f.read()
    m["files"] = {"../../outside.pt": {"rank": 0, "nbytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest(),
                                       "kind": "torch"}}
    with open(mpath, "w") as f:
        json.dump(m, f)
    assert wait_until(lambda: not snap_env.persisters(), 15)
    with Checkpointer(d, weights_only=False, **OPTS) as ck:
        with pytest.raises(CheckpointCorruptError) as ei:
            ck.load()
        assert mpath in str(ei.value) and "outside" in str(ei.value), str(ei.value)
    assert not os.path.exists(marker)


def test_security_symlinks_planted_in_checkpoint_dir_are_not_followed(snap_env, tmp_path):
    """Symbolic links planted in the checkpoint directory where snapckpt writes or deletes: the step
    directory about to be committed and the tracker ``latest`` link to a victim directory and file
    outside; an old 'committed checkpoint' is a link to a valid checkpoint kept elsewhere. Right: the commit
    replaces the links themselves (the step is a real directory, ``latest`` a regular file naming it) and
    retention (keep_last=1) removes the link only; the victims' contents are intact."""
    d = snap_env.ckpt_dir
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    victim_latest = tmp_path / "victim-latest.txt"
    victim_latest.write_text("keep me too")
    elsewhere = str(tmp_path / "elsewhere")
    with Checkpointer(elsewhere, **OPTS) as ck:  # a valid checkpoint directory outside d
        ck.save({"w": torch.ones(3)}, 2, StorageType.DISK).wait()
    os.makedirs(d)
    os.symlink(victim, os.path.join(d, "step_00000007"))
    os.symlink(victim_latest, os.path.join(d, "latest"))
    os.symlink(os.path.join(elsewhere, "step_00000002"), os.path.join(d, "step_00000002"))
    assert wait_until(lambda: not snap_env.persisters(), 15)
    with Checkpointer(d, keep_last=1, **OPTS) as ck:
        ck.save({"w": torch.full((3,), 7.0)}, 7, StorageType.DISK).wait()
        ck.save({"w": torch.full((3,), 8.0)}, 8, StorageType.DISK).wait()
        assert torch.equal(ck.load(step=8)["w"], torch.full((3,), 8.0))
    assert (victim / "precious.txt").read_text() == "keep me" and sorted(os.listdir(victim)) == ["precious.txt"]
    assert victim_latest.read_text() == "keep me too"
    assert not os.path.islink(os.path.join(d, "latest"))
    with open(os.path.join(d, "latest")) as f:
        assert f.read() == "step_00000008"
    assert sorted(n for n in os.listdir(d) if n.startswith("step_")) == ["step_00000008"]
    assert os.path.isfile(os.path.join(elsewhere, "step_00000002", MANIFEST)), "retention followed a link"


@pytest.mark.parametrize("where", ["arena_link", "runtime_link", "arena_foreign"])
def test_security_planted_job_directories_are_refused(snap_env, tmp_path, where):
    """The job's directories have predictable names in shared places (/tmp, /dev/shm). Another user plants
    (a) a symbolic link where the arena directory goes, pointing at a victim directory, (b) a link where the
    runtime directory goes, (c) a directory of its own (uid 65534) where the arena goes. Right: the
    Checkpointer refuses with PersisterError naming the path and the fix, never adopting it; the victim
    directory keeps its files (a persister that adopted the link would delete them at exit)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "r00000-s0").write_text("looks like a slot")
    (victim / "precious.txt").write_text("keep me")
    rt, arena = job_dirs(snap_env.runtime_root, snap_env.shm_root, job_key(snap_env.ckpt_dir, None))
    if where == "arena_link":
        os.symlink(victim, arena)
        target, why = arena, "symbolic link"
    elif where == "runtime_link":
        os.symlink(victim, os.path.dirname(rt))
        target, why = os.path.dirname(rt), "symbolic link"
    else:
        os.mkdir(arena, 0o777)
        os.chown(arena, NOBODY, NOBODY)
        target, why = arena, "belongs to uid"
    with pytest.raises(PersisterError) as ei:
        Checkpointer(snap_env.ckpt_dir, **dict(OPTS, persister_startup_timeout_secs=30))
    assert target in str(ei.value) and why in str(ei.value), str(ei.value)
    assert sorted(os.listdir(victim)) == ["precious.txt", "r00000-s0"]
    assert wait_until(lambda: not snap_env.persisters(), 10)
    if where != "runtime_link":
        os.unlink(arena) if where == "arena_link" else os.rmdir(arena)


# ---------------------------------------------------------------------------------------- DeepSpeed
def test_security_deepspeed_tags_and_sidecar(snap_env):
    """DeepSpeed's user-given ``tag=``: tags with spaces, colons, brackets other than '[' (DeepSpeed's own
    loader globs a tag's files, so '[' is refused with that reason) and non-ASCII save to disk and load back
    by tag; '../x', '/abs', 'a/b', NUL and hidden tags are refused before anything is written outside the
    checkpoint directory, and ``load_checkpoint(tag=)`` refuses such tags too (even '../<the directory>',
    which exists). snapckpt's RNG sidecar is loaded with weights_only=True although DeepSpeed's own
    files need weights_only=False: a malicious pickle planted there (size and CRC-32 re-recorded) never runs
    and the load raises UnsafeCheckpointError naming the sidecar."""
    outs = run_ranks("security_worker.py", 1, ["ds_tags", snap_env.ckpt_dir, snap_env.tmp], snap_env.env,
                     timeout=170)
    (res,) = [json.loads(x) for x in result_lines(outs[0])]
    assert res["loaded"] == res["tags"], res
    for bad, err in res["refused"].items():
        assert err is not None, f"tag {bad!r} was accepted"
    assert "glob" in res["refused"]["[x"], res["refused"]["[x"]
    assert all(res["load_refused"].values()), res["load_refused"]
    assert res["outside_unchanged"], res
    assert res["sidecar"]["type"] == "UnsafeCheckpointError" and ".snapckpt/deepspeed_rank_00000.pt" in \
        res["sidecar"]["message"], res["sidecar"]
    assert not res["marker_exists"], "the planted sidecar pickle ran"
