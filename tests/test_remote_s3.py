"""The remote tier (remote_dir="s3://..."), against a real S3 server on 127.0.0.1 (moto's server mode,
tests/s3server.py): uploads in the native layout committed by their manifest object, a fresh node resuming
from the remote tier, kill -9 of the persister mid-upload, and a missing bucket refused at start."""
from __future__ import annotations

import json
import os
import shutil
import stat
import time
from typing import Optional

import pytest

from _harness import result_lines, run_ranks, wait_until

pytestmark = pytest.mark.timeout(300)  # a hang guard: on a loaded 2-core machine under -n 2 the round trip took 82 s


def _results(outs):
    return [json.loads(result_lines(o)[-1]) for o in outs]


def _remote_layout(bucket, prefix="run"):
    """{relative key: size} under the test's remote directory."""
    return {k[len(prefix) + 1:]: v for k, v in bucket.keys(prefix + "/").items()}


def _persister_logs(snap_env) -> str:
    out = []
    for root, _, files in os.walk(snap_env.runtime_root):
        out += [open(os.path.join(root, f), errors="replace").read() for f in files if f == "persister.log"]
    return "\n".join(out)


def test_H1_H4_round_trip_native_layout_and_fresh_node_resume(snap_env, s3_bucket):
    """2 ranks save steps 1 and 2 to disk with remote_dir set: the server holds both in the native layout,
    each with its manifest object (sizes and checksums equal to the local manifest) and the tracker object
    naming step 2. With the local directory deleted (a fresh node), a restart resumes step 2 from the remote
    tier, bitwise equal, and the local directory is rebuilt as a committed checkpoint. A bit flipped in rank 1's
    local file then: the remote copy replaces the local one and step 2 loads again on both ranks."""
    url = s3_bucket.url("run")
    outs = run_ranks("remote_worker.py", 2, ["save", snap_env.ckpt_dir, url, "1,2"], snap_env.env, timeout=90)
    assert all(r["saved"] == [1, 2] for r in _results(outs))
    # the upload runs in the background; a clean close lets the persister finish it before it exits
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    keys = _remote_layout(s3_bucket)
    for step in (1, 2):
        d = f"step_{step:08d}"
        local = json.load(open(os.path.join(snap_env.ckpt_dir, d, ".snapckpt", "manifest.json")))
        remote = json.loads(s3_bucket.get(f"run/{d}/.snapckpt/manifest.json"))
        assert remote["files"] == local["files"] and remote["step"] == step
        for name, rec in local["files"].items():
            assert keys[f"{d}/{name}"] == rec["nbytes"] == os.path.getsize(os.path.join(snap_env.ckpt_dir, d, name))
        assert sorted(n for n in keys if n.startswith(d + "/") and "/.snapckpt/" not in n) == \
            sorted(f"{d}/rank_{r:05d}.pt" for r in range(2))
    assert s3_bucket.get("run/latest") == b"step_00000002"
    assert not s3_bucket.multipart_uploads()

    shutil.rmtree(snap_env.ckpt_dir)  # a fresh node: no local copy, no memory tier (the persister is gone)
    res = _results(run_ranks("remote_worker.py", 2, ["load", snap_env.ckpt_dir, url], snap_env.env, timeout=90))
    assert all(r == {"latest": 2, "step": 2, "tier": "disk", "equal": True} for r in res), res
    d = os.path.join(snap_env.ckpt_dir, "step_00000002")
    assert sorted(os.listdir(d)) == [".snapckpt", "rank_00000.pt", "rank_00001.pt"]
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read() == "step_00000002"
    assert not [n for n in os.listdir(snap_env.ckpt_dir) if ".download-" in n]

    # a bit of rank 1's local file flips: rank 1's read fails its checksum, rank 0 replaces the local copy by the
    # remote one while rank 1 waits, and both read step 2 again (not step 1)
    path = os.path.join(d, "rank_00001.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(data)
    res = _results(run_ranks("remote_worker.py", 2, ["load", snap_env.ckpt_dir, url], snap_env.env, timeout=90))
    assert all(r == {"latest": 2, "step": 2, "tier": "disk", "equal": True} for r in res), res
    assert open(path, "rb").read() != bytes(data)
    assert not [n for n in os.listdir(snap_env.ckpt_dir) if ".download-" in n]


def test_H3_kill_persister_mid_upload_keeps_previous_remote_checkpoint(snap_env, s3_bucket):
    """The persister is SIGKILLed in the middle of uploading step 2 (a multipart upload in flight: 12 MiB
    rank files in 5 MiB parts). Step 1 stays committed remotely; the half-uploaded step 2 has no manifest
    and is never taken for a checkpoint: a fresh node resumes step 1, bitwise equal, and its persister
    deletes the orphan prefix and aborts the stuck multipart upload. Back on the first node (its local
    directory with step 2, committed there but never uploaded), the next persister catches up: step 2 is
    uploaded at its start (the same manifest as the local one, the tracker object names it)."""
    snap_env.leftover_ok = True  # the killed persister leaves its arena behind by design
    url = s3_bucket.url("run")
    env = dict(snap_env.env, SNAPCKPT_REMOTE_BLOCK_NBYTES=str(5 << 20),
               SNAPCKPT_FAULT_POINT="remote.mid_upload:step=2:occurrence=2")
    nbytes = 12 << 20
    run_ranks("remote_worker.py", 2, ["save", snap_env.ckpt_dir, url, "1,2", str(nbytes)], env, timeout=90)
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    log = _persister_logs(snap_env)
    keys = _remote_layout(s3_bucket)
    assert "step_00000001/.snapckpt/manifest.json" in keys
    assert "step_00000002/.snapckpt/manifest.json" not in keys, keys
    assert "step_00000002/.snapckpt/remote.json" in keys  # the interrupted upload had begun
    assert s3_bucket.multipart_uploads("run/"), f"no multipart upload in flight at the kill; log: {log[-2000:]}"
    assert s3_bucket.get("run/latest") == b"step_00000001"

    aside = snap_env.ckpt_dir + ".first-node"
    os.rename(snap_env.ckpt_dir, aside)  # a fresh node: an empty local directory
    env.pop("SNAPCKPT_FAULT_POINT")
    res = _results(run_ranks("remote_worker.py", 2, ["load", snap_env.ckpt_dir, url, "", str(nbytes)], env,
                             timeout=90))
    assert all(r == {"latest": 1, "step": 1, "tier": "disk", "equal": True} for r in res), res
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    keys = _remote_layout(s3_bucket)
    assert not [k for k in keys if k.startswith("step_00000002/")], keys
    assert not s3_bucket.multipart_uploads("run/")
    assert "step_00000001/.snapckpt/manifest.json" in keys

    shutil.rmtree(snap_env.ckpt_dir)
    os.rename(aside, snap_env.ckpt_dir)  # the first node again: step 2 committed locally, never uploaded
    res = _results(run_ranks("remote_worker.py", 2, ["load", snap_env.ckpt_dir, url, "", str(nbytes)], env,
                             timeout=90))
    assert all(r == {"latest": 2, "step": 2, "tier": "disk", "equal": True} for r in res), res
    # the tracker object is written last (the persister, idle, is killed at teardown)
    assert wait_until(lambda: s3_bucket.get("run/latest") == b"step_00000002", timeout=60)
    local = json.load(open(os.path.join(snap_env.ckpt_dir, "step_00000002", ".snapckpt", "manifest.json")))
    assert json.loads(s3_bucket.get("run/step_00000002/.snapckpt/manifest.json"))["files"] == local["files"]
    assert local["tracker"] == {"name": "latest", "content": "step_00000002"}
    assert s3_bucket.get("run/latest") == b"step_00000002"
    assert not s3_bucket.multipart_uploads("run/")
    assert "step 2 (step_00000002) was committed locally but never uploaded" in _persister_logs(snap_env)


def test_missing_bucket_is_refused_at_start(snap_env, s3_bucket):
    """remote_dir naming a bucket that does not exist: every rank's Checkpointer raises
    RemoteStorageError at construction, naming the URL and the fix, with no credential in it; nothing
    was written locally, not even the checkpoint directory the constructor had created."""
    url = f"s3://{s3_bucket.name}-missing/run"
    assert not os.path.exists(snap_env.ckpt_dir)
    outs = run_ranks("remote_worker.py", 2, ["start", snap_env.ckpt_dir, url], snap_env.env, timeout=90)
    assert not os.path.exists(snap_env.ckpt_dir), os.listdir(snap_env.ckpt_dir)
    for o in outs:
        line = [l for l in o.splitlines() if l.startswith("ERROR ")]
        assert line, o
        assert line[0].startswith("ERROR RemoteStorageError"), line
        assert url in line[0] and "bucket does not exist" in line[0] and "create it" in line[0]
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in o and os.environ["AWS_ACCESS_KEY_ID"] not in o


def test_wrong_credentials_are_refused_at_start(snap_env, s3_bucket, monkeypatch):
    """A key the server does not know (moto with its IAM authentication on, answering 403
    InvalidAccessKeyId as AWS does): the Checkpointer raises RemoteStorageError at construction, before any
    training or persister, naming the URL, the cause and where credentials come from, never the key or the
    secret; nothing was written, locally or in the bucket."""
    import s3server
    from snapckpt import Checkpointer
    from snapckpt.errors import RemoteStorageError

    url = s3_bucket.url("run")
    key, secret = "AKIAWRONGKEY00000000", "wrong-secret-0123456789abcdefghijklmnopqrst"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with s3server.enforce_auth():
        with pytest.raises(RemoteStorageError) as ei:
            Checkpointer(snap_env.ckpt_dir, remote_dir=url, persister_idle_timeout_secs=20)
    msg = str(ei.value)
    assert msg.startswith(f"remote_dir {url!r}: access denied (PermissionError: "), msg
    assert "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in msg and "~/.aws/credentials" in msg
    assert key not in msg and secret not in msg
    assert not snap_env.persisters()
    assert not os.path.exists(snap_env.ckpt_dir)  # not even the directory the constructor had created
    assert not s3_bucket.keys("run/")  # no probe, no owner record: nothing was written with the wrong key


def _two_steps_uploaded(snap_env, s3_bucket) -> tuple:
    """Save steps 1 and 2 (DISK) with ``remote_dir`` = the bucket's ``run/`` and wait until the persister
    exited (every upload done); return ``(url, Checkpointer options, {step: state})``."""
    import torch

    from snapckpt import Checkpointer, StorageType

    url = s3_bucket.url("run")
    opts = dict(remote_dir=url, persister_idle_timeout_secs=20)
    states = {s: {"w": torch.randn(256, generator=torch.Generator().manual_seed(s)), "step": s} for s in (1, 2)}
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        for s in (1, 2):
            ck.save(states[s], s, StorageType.DISK).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)  # uploads done
    return url, opts, states


def _local_checkpoint(root: str, step: int, files: dict, modes: Optional[dict] = None) -> tuple:
    """A committed local checkpoint ``root/step_N`` of ``files`` ({name: bytes}, rank 0), ``modes`` ({name:
    permission bits}) recorded in the manifest; return (path, manifest)."""
    import xxhash
    from snapckpt.ondisk.manifest import MANIFEST, build_manifest
    d = os.path.join(root, f"step_{step:08d}")
    os.makedirs(os.path.join(d, ".snapckpt"))
    for name, data in files.items():
        open(os.path.join(d, name), "wb").write(data)
    m = build_manifest(step=step, dirname=os.path.basename(d), world_size=1, run_id="r",
                       parts={0: {n: {"nbytes": len(b), "xxh3_64": xxhash.xxh3_64(b).hexdigest(), "kind": "bytes",
                                      "mode": (modes or {}).get(n)} for n, b in files.items()}})
    open(os.path.join(d, MANIFEST), "w").write(json.dumps(m))
    return d, m


def test_H1_store_commit_record_retention_and_corrupt_download(tmp_path, s3_bucket):
    """The store's rules, in-process: a prefix without a manifest object is not a checkpoint; a file changed
    since its local commit is not uploaded (nothing committed remotely); retention deletes the oldest
    (manifest first, no prefix left); a download of an object damaged in the store fails its checksum and
    leaves nothing in the local directory; a download gives a file the mode its manifest records."""
    from snapckpt.errors import CheckpointCorruptError
    from snapckpt.storage.remote import RemoteStore
    store = RemoteStore(s3_bucket.url("run"))
    src = str(tmp_path / "src")
    for step in (1, 2, 3):
        d, m = _local_checkpoint(src, step, {"a.bin": bytes([step]) * 1000, "b.bin": b"x" * step}, {"b.bin": 0o600})
        store.upload(d, os.path.basename(d), m, run_id="r", tracker_name="latest", tracker_content=os.path.basename(d))
    assert [c.step for c in store.list_committed()] == [1, 2, 3]
    assert s3_bucket.get("run/latest") == b"step_00000003"

    # an interrupted upload: data and marker, no manifest
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="run/step_00000009/a.bin", Body=b"half")
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="run/step_00000009/.snapckpt/remote.json", Body=b"{}")
    assert [c.step for c in store.list_committed()] == [1, 2, 3]

    # a local file changed after its commit: refused, no manifest object written for it
    d4, m4 = _local_checkpoint(src, 4, {"a.bin": b"good"})
    open(os.path.join(d4, "a.bin"), "wb").write(b"evil")
    with pytest.raises(CheckpointCorruptError, match="changed since it was committed"):
        store.upload(d4, "step_00000004", m4, run_id="r")
    assert "run/step_00000004/.snapckpt/manifest.json" not in s3_bucket.keys("run/")
    assert not s3_bucket.multipart_uploads()

    assert store.apply_retention(2, protect=["step_00000003"]) == ["step_00000001"]
    assert not [k for k in s3_bucket.keys("run/") if k.startswith("run/step_00000001/")]
    assert store.clean_orphans() == ["step_00000004", "step_00000009"]
    assert sorted({k.split("/")[1] for k in s3_bucket.keys("run/")}) == ["latest", "step_00000002", "step_00000003"]

    # damage an object in the store, keeping its size: the download refuses it, nothing is left locally
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="run/step_00000003/a.bin", Body=b"\0" * 1000)
    dest = str(tmp_path / "dest")
    os.makedirs(dest)
    c3 = [c for c in store.list_committed() if c.step == 3][0]
    with pytest.raises(CheckpointCorruptError, match="a.bin"):
        store.download(c3, dest, fsync=False)
    assert os.listdir(dest) == []
    c2 = [c for c in store.list_committed() if c.step == 2][0]
    store.download(c2, dest, fsync=False)
    assert open(os.path.join(dest, "step_00000002", "a.bin"), "rb").read() == bytes([2]) * 1000
    umask = os.umask(0)
    os.umask(umask)
    assert {n: stat.S_IMODE(os.stat(os.path.join(dest, "step_00000002", n)).st_mode) for n in ("a.bin", "b.bin")} \
        == {"a.bin": 0o666 & ~umask, "b.bin": 0o600}
    assert open(os.path.join(dest, "latest")).read() == "step_00000002"


def test_remote_retention_never_deletes_what_the_tracker_object_names(tmp_path, s3_bucket):
    """Step 1 uploaded with its tracker, steps 2 and 3 without (DeepSpeed's save_latest=False): the tracker
    object still names step 1, so keep_last=1 keeps it (a resume from the store loads it) and deletes step 2."""
    from snapckpt.storage.remote import RemoteStore
    store = RemoteStore(s3_bucket.url("run"))
    for step in (1, 2, 3):
        d, m = _local_checkpoint(str(tmp_path / "src"), step, {"a.bin": bytes([step]) * 100})
        tracker = {"tracker_name": "latest", "tracker_content": os.path.basename(d)} if step == 1 else {}
        if tracker:  # as the local commit records the tracker it wrote
            m["tracker"] = {"name": "latest", "content": os.path.basename(d)}
        store.upload(d, os.path.basename(d), m, run_id="r", **tracker)
    assert s3_bucket.get("run/latest") == b"step_00000001"
    assert store.apply_retention(1) == ["step_00000002"]
    assert [c.step for c in store.list_committed()] == [1, 3]


def _requests(store, fn) -> dict:
    """{kind: count} of the store requests ``fn()`` makes through ``store``: manifest reads and listings."""
    counts = {"manifest reads": 0, "listings": 0}
    read, find, ls = store._read, store.fs.find, store.fs.ls

    def counted(kind, fn, path, *a, **kw):
        if kind != "manifest reads" or path.endswith("manifest.json"):
            counts[kind] += 1
        return fn(path, *a, **kw)
    store._read = lambda p: counted("manifest reads", read, p)
    store.fs.find = lambda p, *a, **kw: counted("listings", find, p, *a, **kw)
    store.fs.ls = lambda p, *a, **kw: counted("listings", ls, p, *a, **kw)
    try:
        fn()
    finally:
        store._read, store.fs.find, store.fs.ls = read, find, ls
    return counts


def _upload_requests(store, d, m) -> dict:
    """:func:`_requests` of one upload of ``d`` (with its tracker)."""
    return _requests(store, lambda: store.upload(d, os.path.basename(d), m, run_id="r", tracker_name="latest",
                                                 tracker_content=os.path.basename(d)))


def test_an_upload_reads_the_same_few_objects_however_many_checkpoints_the_store_holds(tmp_path, s3_bucket):
    """An upload with a tracker looks for a checkpoint saved later (the tracker rule) with one listing of the
    store and a read of the manifests it has not seen, not a read and a listing per remote checkpoint: its
    requests do not grow with the checkpoints kept there (keep_last=None keeps every one)."""
    from snapckpt.storage.remote import RemoteStore
    store = RemoteStore(s3_bucket.url("run"))
    counts = {}
    for step in range(1, 8):
        d, m = _local_checkpoint(str(tmp_path / "src"), step, {"a.bin": bytes([step]) * 10, "b.bin": b"b"})
        counts[step] = _upload_requests(store, d, m)
    assert counts[7] == counts[3], counts
    assert s3_bucket.get("run/latest") == b"step_00000007"


def test_list_committed_reports_damaged_prefixes_every_time_and_reads_only_changed_manifests(tmp_path, s3_bucket):
    """``list_committed`` (the load's and retention's listing) is one listing of the store plus a read of the
    manifests it has not seen: its requests do not grow with the checkpoints kept there. A damaged prefix (a
    manifest that does not parse, a data object missing or of another size) is still described in
    ``problems`` on every call, naming the object; a prefix without a manifest (an upload in flight) and a hidden
    one are skipped silently; a manifest replaced since (another ETag) is read again."""
    from snapckpt.storage.remote import RemoteStore
    store = RemoteStore(s3_bucket.url("run"))
    for step in range(1, 5):
        d, m = _local_checkpoint(str(tmp_path / "src"), step, {"a.bin": bytes([step]) * 100, "b.bin": b"b"})
        store.upload(d, os.path.basename(d), m, run_id="r")
    put = lambda key, body: s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=f"run/{key}", Body=body)
    put("step_00000002/.snapckpt/manifest.json", b"{not json")
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key="run/step_00000003/b.bin")
    put("step_00000004/a.bin", b"short")
    put("step_00000009/.snapckpt/remote.json", b"{}")  # an upload in flight
    put(".trash/step_00000005/.snapckpt/manifest.json", b"{not json")
    url = store.url

    def listed(problems):
        return [c.step for c in store.list_committed(problems)]

    want = [f"{url}/step_00000002: manifest is not valid JSON (9 bytes)",
            f"{url}/step_00000003: {url}/step_00000003/b.bin is missing (listed in the manifest)",
            f"{url}/step_00000004: {url}/step_00000004/a.bin is 5 bytes, the manifest says 100"]
    for _ in range(2):
        problems = []
        assert listed(problems) == [1]
        assert [p[:len(w)] for p, w in zip(problems, want)] == want and len(problems) == 3, problems
        assert problems[0].endswith(f"[{url}/step_00000002/.snapckpt/manifest.json]"), problems

    few = _requests(store, lambda: listed([]))  # the damaged manifest read again, each damaged prefix listed again
    assert few == {"manifest reads": 1, "listings": 3}, few
    for step in range(5, 12):
        d, m = _local_checkpoint(str(tmp_path / "src"), step, {"a.bin": bytes([step]) * 10})
        store.upload(d, os.path.basename(d), m, run_id="r")
    listed([])
    assert _requests(store, lambda: listed([])) == few
    d1, m1 = _local_checkpoint(str(tmp_path / "again"), 1, {"a.bin": b"again"})
    RemoteStore(url).upload(d1, "step_00000001", m1, run_id="r2")  # another persister saves step 1 again
    assert _requests(store, lambda: listed([])) == {"manifest reads": 2, "listings": 3}
    assert [c.manifest["files"]["a.bin"]["nbytes"] for c in store.list_committed() if c.step == 1] == [5]


def test_an_upload_sees_a_checkpoint_saved_again_later_by_another_persister(tmp_path, s3_bucket):
    """The manifests an upload remembers are read again once they change: step 1 saved again (another
    persister, after a restart) later than step 3 is saved, so step 3's upload leaves the tracker at step 1."""
    from snapckpt.storage.remote import RemoteStore
    store, other = RemoteStore(s3_bucket.url("run")), RemoteStore(s3_bucket.url("run"))
    ckpt = {}
    for step in (1, 2, 3):
        ckpt[step] = _local_checkpoint(str(tmp_path / "src"), step, {"a.bin": bytes([step]) * 10})
        ckpt[step][1]["tracker"] = {"name": "latest", "content": f"step_{step:08d}"}
    for step in (1, 2):
        d, m = ckpt[step]
        assert store.upload(d, os.path.basename(d), m, run_id="r", tracker_name="latest",
                            tracker_content=os.path.basename(d))
    d1, m1 = _local_checkpoint(str(tmp_path / "again"), 1, {"a.bin": b"again" * 10})
    m1["requested_unix"] = ckpt[3][1]["requested_unix"] + 1
    m1["tracker"] = {"name": "latest", "content": "step_00000001"}
    assert other.upload(d1, "step_00000001", m1, run_id="r2", tracker_name="latest", tracker_content="step_00000001")
    d3, m3 = ckpt[3]
    assert not store.upload(d3, "step_00000003", m3, run_id="r", tracker_name="latest",
                            tracker_content="step_00000003")
    assert s3_bucket.get("run/latest") == b"step_00000001"


def test_H2_full_upload_queue_skips_oldest_with_an_event(snap_env, s3_bucket):
    """Uploads slower than saves: the upload of step 1 is held up (a fault point sleeps 8 s before its
    manifest) while steps 1-5 are committed locally without waiting for it. The queue keeps 2 waiting
    uploads and drops the oldest waiting one when a newer arrives (which ones depends on when the uploader
    thread took step 1; at least one is dropped): every dropped step is an ``upload_skipped`` event on both
    ranks and a warning in the persister's log, and is not on the server; every other step is committed
    there; the newest (5) always is, and the tracker object names it."""
    url = s3_bucket.url("run")
    env = dict(snap_env.env, SNAPCKPT_FAULT_POINT="remote.before_manifest:step=1:action=sleep:secs=8")
    res = _results(run_ranks("remote_worker.py", 2, ["save", snap_env.ckpt_dir, url, "1,2,3,4,5"], env,
                             timeout=90))
    skipped = sorted(s for k, s in res[0]["events"] if k == "upload_skipped")
    for r in res:
        assert sorted(s for k, s in r["events"] if k == "upload_skipped") == skipped, r["events"]
        assert sorted(s for k, s in r["events"] if k == "committed") == [1, 2, 3, 4, 5]
    assert skipped and 5 not in skipped, res[0]["events"]
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    keys = _remote_layout(s3_bucket)
    committed = sorted(int(k[5:13]) for k in keys if k.endswith(".snapckpt/manifest.json"))
    assert committed == sorted(set(range(1, 6)) - set(skipped)), (keys, skipped)
    assert s3_bucket.get("run/latest") == b"step_00000005"
    log = _persister_logs(snap_env)
    for s in skipped:
        assert f"upload of step {s} " in log and "skipped" in log
    assert sorted(n for n in os.listdir(snap_env.ckpt_dir) if not n.startswith(".")) == \
        ["latest"] + [f"step_{s:08d}" for s in range(1, 6)]  # the local tier has every step


def test_H2_commits_ending_out_of_order_upload_in_request_order(snap_env, s3_bucket, monkeypatch):
    """Commits run in parallel and a later one may end first (CI saw step 4's upload before step 2's, so the
    server briefly held step 4 alone and would have ended with ``latest`` naming step 2): step 1's commit is
    held 3 s before its tracker (a fault point) while step 2 commits. Both are uploaded and committed on the
    server, the tracker object names step 2 there as it does locally, and step 1's late upload says it did
    not move it back."""
    import torch

    from snapckpt import Checkpointer, StorageType

    url = s3_bucket.url("run")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "commit.before_tracker:step=1:action=sleep:secs=3")  # the persister's
    with Checkpointer(snap_env.ckpt_dir, remote_dir=url, persister_idle_timeout_secs=20) as ck:
        h1 = ck.save({"w": torch.ones(64), "step": 1}, 1, StorageType.DISK)
        ck.save({"w": torch.ones(64) * 2, "step": 2}, 2, StorageType.DISK).wait()
        h1.wait()
        # (the log goes with the persister: read it while the Checkpointer keeps it)
        assert wait_until(lambda: "remote: uploaded step 1 " in _persister_logs(snap_env), timeout=60), \
            _persister_logs(snap_env)
        log = _persister_logs(snap_env)
    assert "hit commit.before_tracker rank=None step=1" in log, log
    assert log.index("remote: uploaded step 2") < log.index("remote: uploaded step 1"), log  # the order forced
    keys = _remote_layout(s3_bucket)
    assert {k.split("/")[0] for k in keys if k.endswith("manifest.json")} == {"step_00000001", "step_00000002"}
    assert open(os.path.join(snap_env.ckpt_dir, "latest")).read() == "step_00000002"
    assert s3_bucket.get("run/latest") == b"step_00000002"
    assert "uploaded step 1 " in log and "(latest not moved back: a later save's upload wrote it)" in log, log


def test_H2_uploads_wait_in_request_order_and_the_oldest_is_dropped(tmp_path, s3_bucket, monkeypatch):
    """The uploader in-process, its thread held while jobs arrive out of request order: a job queues before
    the waiting ones requested after it, so steps upload in request order and the tracker object ends at the
    newest; when the queue is full the job dropped is the oldest by request order (the one arriving, if it is
    the oldest), never a newer one; a job older than the one that last wrote the tracker object uploads
    without moving it (remote retention, keep_last=2, keeps the newest two)."""
    from snapckpt.persister import uploader as U

    monkeypatch.setattr(U, "QUEUE_DEPTH", 2)
    src, url = str(tmp_path / "src"), s3_bucket.url("run")
    ck = {s: _local_checkpoint(src, s, {"a.bin": bytes([s]) * 100}) for s in range(1, 7)}

    def job(step, order, keep_last=None):
        d, m = ck[step]
        return U.UploadJob("run1", url, d, os.path.basename(d), m, keep_last, "latest", os.path.basename(d),
                           order=order)

    up = U.Uploader(lambda: None)
    with up._cond:  # the uploader thread cannot take a job until all four arrived
        for step, order in ((4, 4), (2, 2), (3, 3), (1, 1)):  # 3 drops 2 (queue full); 1 arrives oldest: dropped
            up.submit(job(step, order))
        assert [j.manifest["step"] for j in up._queue] == [3, 4]
    up.shutdown()
    assert [(n["kind"], n["step"]) for n in up.notes_for("run1")] == [("upload_skipped", 2), ("upload_skipped", 1)]
    assert "step 4 will be uploaded instead" in up.notes_for("run1")[1]["reason"]
    assert s3_bucket.get("run/latest") == b"step_00000004"
    up = U.Uploader(lambda: None)
    up.submit(job(6, 6, keep_last=2))
    assert wait_until(lambda: s3_bucket.get("run/latest") == b"step_00000006", 30)
    up.submit(job(5, 5, keep_last=2))  # after 6 wrote the tracker object: behind it
    up.shutdown()
    committed = sorted(k.split("/")[0] for k in _remote_layout(s3_bucket) if k.endswith("manifest.json"))
    assert s3_bucket.get("run/latest") == b"step_00000006"
    assert committed == ["step_00000005", "step_00000006"], committed


def test_H3_catch_up_follows_the_save_order_and_moves_the_tracker_past_earlier_runs_uploads(tmp_path, s3_bucket):
    """The catch-up (a clean-up job with ``checkpoint_dir``) in-process. (1) A rewind: step 10 uploaded, then
    steps 5 and 6 saved after it and never uploaded: both are caught up and the tracker object names step 6,
    as the local tracker does (before: steps were compared, so nothing was, and ``latest`` stayed at step 10).
    (2) Steps 20 and 7 saved in that order, neither uploaded: 7 is uploaded last and the tracker names it
    (before: by step, so it ended at 20). (3) The same uploader (a persister that outlived a run of the job)
    uploaded step 1 for the earlier run, then step 2's upload failed: the next run's catch-up uploads step 2,
    the tracker object names it and retention (``keep_last=1``) keeps it (before: its order 0 was behind
    step 1's, so ``latest`` stayed at step 1, which retention had deleted)."""
    import time

    from snapckpt.persister import uploader as U

    def local(root, step, saved):
        d, m = _local_checkpoint(root, step, {"a.bin": bytes([step]) * 100})
        m.update(requested_unix=saved, created_unix=saved, tracker={"name": "latest", "content": os.path.basename(d)})
        open(os.path.join(d, ".snapckpt", "manifest.json"), "w").write(json.dumps(m))
        return d, m

    def catch_up(up, url, root, keep_last=None):
        up.submit(U.UploadJob("run2", url, "", "", None, keep_last, checkpoint_dir=root, before_unix=time.time()))

    def committed(prefix):
        return sorted(k.split("/")[1] for k in s3_bucket.keys(prefix + "/") if k.endswith("manifest.json"))

    t = time.time() - 100
    src, url = str(tmp_path / "a"), s3_bucket.url("a")
    d, m = local(src, 10, t)
    up = U.Uploader(lambda: None)
    up.submit(U.UploadJob("run1", url, d, os.path.basename(d), m, None, "latest", os.path.basename(d), order=1))
    up.shutdown()
    local(src, 5, t + 1), local(src, 6, t + 2)
    up = U.Uploader(lambda: None)
    catch_up(up, url, src)
    up.shutdown()
    assert committed("a") == ["step_00000005", "step_00000006", "step_00000010"]
    assert s3_bucket.get("a/latest") == b"step_00000006"

    src, url = str(tmp_path / "b"), s3_bucket.url("b")
    local(src, 20, t), local(src, 7, t + 1)
    up = U.Uploader(lambda: None)
    catch_up(up, url, src)
    up.shutdown()
    assert committed("b") == ["step_00000007", "step_00000020"]
    assert s3_bucket.get("b/latest") == b"step_00000007"

    src, url = str(tmp_path / "c"), s3_bucket.url("c")
    d, m = local(src, 1, t)
    up = U.Uploader(lambda: None)
    up.submit(U.UploadJob("run1", url, d, os.path.basename(d), m, 1, "latest", os.path.basename(d), order=1))
    assert wait_until(lambda: s3_bucket.keys("c/latest") and s3_bucket.get("c/latest") == b"step_00000001", 30)
    local(src, 2, t + 1)  # its upload failed (run1 went on, ended)
    catch_up(up, url, src, keep_last=1)
    up.shutdown()
    assert committed("c") == ["step_00000002"]
    assert s3_bucket.get("c/latest") == b"step_00000002"


def test_H2_uploader_reports_failures_and_retired_checkpoints(tmp_path, s3_bucket, monkeypatch):
    """The persister's uploader, in-process: an upload to a bucket that disappeared is retried, then given
    up with an ``upload_failed`` note naming the URL and the cause (no credential); a checkpoint retired by
    local retention before its turn is an ``upload_skipped`` note, not a failure; the first success after the
    failure is an ``uploaded`` note (the remote tier caught up); one retired during its
    upload (its directory renamed away, as retention does, after the first file was opened) is skipped at
    once (no retry) and what it had sent is removed; a transient read error of a local file (EIO) is
    retried as a network fault is, and the checkpoint is committed; every job ends (the persister's count
    of pending work returns to zero)."""
    import errno

    from snapckpt.persister import uploader as U
    from snapckpt.storage.remote import RemoteStore
    monkeypatch.setattr(U, "BACKOFF_SECS", 0.01)
    monkeypatch.setattr(U, "QUEUE_DEPTH", 4)  # the four jobs wait together: none is dropped
    src = str(tmp_path / "src")
    d, m = _local_checkpoint(src, 1, {"a.bin": b"a" * 100})
    d3, m3 = _local_checkpoint(src, 3, {"a.bin": b"c" * 100, "b.bin": b"d" * 100})
    d4, m4 = _local_checkpoint(src, 4, {"a.bin": b"e" * 100})
    calls = []
    real_put = RemoteStore._put_file

    def put(self, local, dirname, name, rec, step):
        calls.append((step, name))
        if step == 3 and calls.count((3, name)) == 1 and name == "a.bin":
            os.rename(d3, d3 + ".retired")  # local retention retires step 3 in the middle of its upload
        if step == 4 and calls.count((4, name)) == 1:
            raise OSError(errno.EIO, "Input/output error", local)  # a transient read error of the local disk
        return real_put(self, local, dirname, name, rec, step)

    monkeypatch.setattr(RemoteStore, "_put_file", put)
    done = []
    up = U.Uploader(lambda: done.append(1))
    gone = f"s3://{s3_bucket.name}-gone/run"
    up.submit(U.UploadJob("run1", gone, d, "step_00000001", m, None, "latest", "step_00000001"))
    up.submit(U.UploadJob("run1", s3_bucket.url("run"), str(tmp_path / "retired"), "step_00000002",
                          {**m, "step": 2}, None))
    up.submit(U.UploadJob("run1", s3_bucket.url("run"), d3, "step_00000003", m3, None, "latest", "step_00000003"))
    up.submit(U.UploadJob("run1", s3_bucket.url("run"), d4, "step_00000004", m4, None, "latest", "step_00000004"))
    up.shutdown()
    notes = up.notes_for("run1")
    assert [(n["kind"], n["step"]) for n in notes] == [("upload_failed", 1), ("upload_skipped", 2),
                                                        ("upload_skipped", 3), ("uploaded", 4)], notes
    assert notes[0]["reason"] == f"{gone}: FileNotFoundError: The specified bucket does not exist"
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in json.dumps(notes)
    assert "deleted before its upload began (by retention" in notes[1]["reason"]
    assert "deleted during its upload (by retention" in notes[2]["reason"]
    assert calls.count((3, "a.bin")) == 1  # not retried
    assert calls.count((4, "a.bin")) == 2  # retried once, then sent
    assert len(done) == 4
    assert sorted(s3_bucket.keys("run/")) == ["run/latest", "run/step_00000004/.snapckpt/manifest.json",
                                              "run/step_00000004/.snapckpt/remote.json", "run/step_00000004/a.bin"]
    assert s3_bucket.get("run/step_00000004/a.bin") == b"e" * 100


def test_H4_newest_step_across_disk_and_remote_with_keep_last(snap_env, s3_bucket):
    """One process, keep_last=2 on both tiers: steps 1-3 are saved and uploaded, the remote tier keeps
    steps 2 and 3. With local step 3 lost (step 2 still on disk, no memory tier), the remote's step 3 is the
    newest complete step: it is downloaded next to step 2 and loaded, bitwise equal. When disk holds a newer
    step than the remote tier, disk wins and nothing is downloaded."""
    import torch

    from snapckpt import Checkpointer, StorageType
    url = s3_bucket.url("run")
    opts = dict(remote_dir=url, keep_last=2, persister_idle_timeout_secs=20)
    states = {s: {"w": torch.randn(256, generator=torch.Generator().manual_seed(s)), "step": s} for s in (1, 2, 3, 4)}
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        for s in (1, 2, 3):
            ck.save(states[s], s, StorageType.DISK).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)  # uploads done
    remote = sorted({k.split("/")[1] for k in s3_bucket.keys("run/") if k.endswith("manifest.json")})
    assert remote == ["step_00000002", "step_00000003"]  # remote retention: manifest first, then the data
    assert not [k for k in s3_bucket.keys("run/") if k.startswith("run/step_00000001/")]

    shutil.rmtree(os.path.join(snap_env.ckpt_dir, "step_00000003"))
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        assert ck.latest_step() == 3
        got = ck.load()
        assert ck.last_load.step == 3 and ck.last_load.tier == StorageType.DISK
        assert torch.equal(got["w"], states[3]["w"]) and got["step"] == 3
        assert sorted(n for n in os.listdir(snap_env.ckpt_dir) if n.startswith("step_")) == \
            ["step_00000002", "step_00000003"]
        ck.save(states[4], 4, StorageType.DISK).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key="run/step_00000004/.snapckpt/manifest.json")
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        got = ck.load()
        assert ck.last_load.step == 4 and torch.equal(got["w"], states[4]["w"])


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_H2_server_errors_are_retried_then_reported_and_the_next_upload_recovers(tmp_path, s3_bucket, monkeypatch,
                                                                             fault):
    """A fault proxy in front of the server answers every request with 503 Slow Down (or resets every
    connection): the uploader retries (botocore's own retries, then its backoff), then gives up with an
    ``upload_failed`` note naming the URL and the cause; the local checkpoint is untouched. Once the server
    answers again, the next upload commits normally."""
    import s3server
    from snapckpt.persister import uploader as U
    monkeypatch.setattr(U, "BACKOFF_SECS", 0.01)
    monkeypatch.setattr(U, "RETRIES", 1)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's retries per request (default 5 in s3fs)
    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        src = str(tmp_path / "src")
        d1, m1 = _local_checkpoint(src, 1, {"a.bin": b"a" * 1000})
        before = open(os.path.join(d1, "a.bin"), "rb").read()
        url = s3_bucket.url("run")
        proxy.mode = fault
        up = U.Uploader(lambda: None)
        up.submit(U.UploadJob("run1", url, d1, "step_00000001", m1, None, "latest", "step_00000001"))
        up.shutdown()
        notes = up.notes_for("run1")
        assert [(n["kind"], n["step"]) for n in notes] == [("upload_failed", 1)], notes
        assert notes[0]["reason"].startswith(url + ": "), notes
        assert {"503": "Service Unavailable", "reset": "EndpointConnectionError"}[fault] in notes[0]["reason"], notes
        assert proxy.failed >= 2  # retried
        assert open(os.path.join(d1, "a.bin"), "rb").read() == before
        proxy.mode = "pass"
        assert not s3_bucket.keys("run/step_00000001/.snapckpt/manifest.json")
        d2, m2 = _local_checkpoint(src, 2, {"a.bin": b"b" * 1000})
        up = U.Uploader(lambda: None)
        up.submit(U.UploadJob("run1", url, d2, "step_00000002", m2, None, "latest", "step_00000002"))
        up.shutdown()
        assert up.notes_for("run1") == []
        assert s3_bucket.get("run/latest") == b"step_00000002"
    finally:
        proxy.close()


def test_H3_a_damaged_newest_remote_step_falls_back_to_the_next_intact_one(snap_env, s3_bucket):
    """A fresh node (empty local directory, no memory tier) whose newest remote checkpoint was damaged in
    the store (a data object overwritten with zeros of the same size): the download of step 2 fails its
    checksum, is named in a warning, and step 1 is downloaded and loaded bitwise; never a fresh start while
    an intact checkpoint exists. With every remote step damaged, latest_step() raises
    CheckpointCorruptError naming them (not None, which would start training from step 0). A hidden
    directory left by a killed download is removed at the next start."""
    import torch

    from snapckpt import Checkpointer
    from snapckpt.errors import CheckpointCorruptError

    url, opts, states = _two_steps_uploaded(snap_env, s3_bucket)

    def damage(step):
        data = [k for k in s3_bucket.keys(f"run/step_{step:08d}/") if "/.snapckpt/" not in k]
        assert data, s3_bucket.keys("run/")
        size = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=data[0])["ContentLength"]
        s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=data[0], Body=b"\0" * size)

    damage(2)
    shutil.rmtree(snap_env.ckpt_dir)
    leftover = os.path.join(snap_env.ckpt_dir, ".step_00000002.download-0123456789ab")  # a killed download's
    os.makedirs(os.path.join(leftover, ".snapckpt"))
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        assert ck.latest_step() == 1
        assert not os.path.exists(leftover)
        got = ck.load()
        assert ck.last_load.step == 1 and torch.equal(got["w"], states[1]["w"])
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)

    damage(1)
    shutil.rmtree(snap_env.ckpt_dir)
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        with pytest.raises(CheckpointCorruptError, match="step_00000002"):
            ck.latest_step()


def test_two_jobs_on_one_remote_directory_the_second_is_refused_at_start(snap_env, s3_bucket):
    """Job A (checkpoint_dir A) owns s3://.../shared once it started there; job B (another checkpoint_dir)
    pointed at the same remote directory is refused at start with RemoteStorageError naming A's directory
    and the fix (before: B's checkpoints replaced A's and a fresh node of A loaded B's state). Job A on a
    fresh node (same path, empty) is still the same job."""
    import torch

    from snapckpt import Checkpointer, StorageType
    from snapckpt.errors import RemoteStorageError

    url = s3_bucket.url("shared")
    a, b = os.path.join(snap_env.tmp, "job_a"), os.path.join(snap_env.tmp, "job_b")
    opts = dict(remote_dir=url, persister_idle_timeout_secs=20)
    with Checkpointer(a, **opts) as ck:
        ck.save({"w": torch.ones(4)}, 1, StorageType.DISK).wait()
    with pytest.raises(RemoteStorageError, match="is the remote tier of another job") as ei:
        Checkpointer(b, **opts)
    assert os.path.realpath(a) in str(ei.value) and ".snapckpt-owner.json" in str(ei.value)
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)
    shutil.rmtree(a)
    with Checkpointer(a, **opts) as ck:  # a fresh node of job A
        assert ck.latest_step() == 1


def test_H_remote_only_round_trip_crash_flush_kill_mid_upload_and_fallback(snap_env, s3_bucket, capsys):
    """Remote-only mode, ``Checkpointer("s3://...")`` with no local directory, 2 ranks, keep_last=2, 6 MiB
    rank files in 5 MiB parts:

    1. steps 1-3 are saved to DISK, step 4 to MEMORY, then both ranks are SIGKILLed: the persister flushes
       step 4 from memory to the store. The store holds steps 3 and 4 only (retention, manifest first), in
       the native layout, every object matching its manifest's size and checksum, no part marker or
       multipart upload left; the tracker object names step 4; nothing was created locally.
    2. restarted ranks resume step 4 from the memory tier, bitwise; their DISK save of step 7 is cut by a
       SIGKILL of the persister in the middle of a multipart upload: step 7 has no manifest (not a
       checkpoint), the tracker still names step 4.
    3. a fresh persister (memory tier gone), with one object of step 4 damaged in the store (same size):
       the load refuses step 4 (checksum) and resumes step 3 from the store, bitwise, on both ranks; the
       persister's start removed step 7's objects and aborted its multipart upload.

    ``snapckpt ls URL`` shows steps 3 and 4 committed (the tracker on 4) and step 7 incomplete; ``snapckpt
    verify URL`` finds the damaged object of step 4 (exit 1) and step 3 intact."""
    from snapckpt.cli.main import main as cli
    import xxhash

    snap_env.leftover_ok = True  # the killed persister leaves its arena behind by design
    url = s3_bucket.url("run")
    nbytes = 6 << 20
    env = dict(snap_env.env, SNAPCKPT_REMOTE_BLOCK_NBYTES=str(5 << 20),
               SNAPCKPT_FAULT_POINT="remote.mid_upload:step=7")
    cwd_before = set(os.listdir("."))
    outs = run_ranks("remote_worker.py", 2, ["only-save", "-", url, "1,2,3", str(nbytes)], env, timeout=120,
                     check=False)
    assert all(result_lines(o) for o in outs), [o[-3000:] for o in outs]
    assert all(r == {"saved": [1, 2, 3], "latest": 4} for r in _results(outs)), outs
    # the crash flush commits step 4 in the background
    assert wait_until(lambda: s3_bucket.keys("run/step_00000004/.snapckpt/manifest.json"), timeout=60), \
        _persister_logs(snap_env)[-3000:]
    assert wait_until(lambda: s3_bucket.get("run/latest") == b"step_00000004", timeout=30)
    assert wait_until(lambda: not s3_bucket.keys("run/step_00000002/"), timeout=30)  # retention after step 4
    keys = _remote_layout(s3_bucket)
    assert sorted(k for k in keys if not k.startswith(".snapckpt-owner")) == sorted(
        ["latest"] + [f"step_0000000{s}/{n}" for s in (3, 4) for n in
                      (".snapckpt/manifest.json", ".snapckpt/remote.json", "rank_00000.pt", "rank_00001.pt")]), keys
    for s in (3, 4):
        m = json.loads(s3_bucket.get(f"run/step_0000000{s}/.snapckpt/manifest.json"))
        assert m["step"] == s and m["world_size"] == 2 and sorted(m["files"]) == ["rank_00000.pt", "rank_00001.pt"]
        for name, rec in m["files"].items():
            data = s3_bucket.get(f"run/step_0000000{s}/{name}")
            assert len(data) == rec["nbytes"] > nbytes and xxhash.xxh3_64(data).hexdigest() == rec["xxh3_64"]
    assert not s3_bucket.multipart_uploads("run/")
    assert set(os.listdir(".")) == cwd_before  # no local folder named "s3:" (or anything else)

    res = _results(run_ranks("remote_worker.py", 2, ["only-resume", "-", url, "7", str(nbytes)], env,
                             timeout=120))
    assert all(r["step"] == 4 and r["tier"] == "memory" and r["equal"] for r in res), res
    assert all(r["save_error"] for r in res), res  # the persister died under the save
    assert wait_until(lambda: not snap_env.persisters(), timeout=30)
    assert "SNAPCKPT_FAULT_POINT hit remote.mid_upload" in _persister_logs(snap_env)
    keys = _remote_layout(s3_bucket)
    assert "step_00000007/.snapckpt/remote.json" in keys and "step_00000007/.snapckpt/manifest.json" not in keys
    assert s3_bucket.multipart_uploads("run/step_00000007/"), keys
    assert s3_bucket.get("run/latest") == b"step_00000004"

    capsys.readouterr()
    assert cli(["ls", url, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert {n: (r["state"], r["step"], r["trackers"]) for n, r in rows.items()} == {
        "step_00000003": ("committed", 3, []), "step_00000004": ("committed", 4, ["latest"]),
        "step_00000007": ("incomplete", 7, [])}, rows

    name = "run/step_00000004/rank_00001.pt"
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=name, Body=b"\0" * keys[name[4:]])
    assert cli(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "OK       step 3" in out and "DAMAGED  step 4" in out and f"{url}/step_00000004/rank_00001.pt" in out, out
    env.pop("SNAPCKPT_FAULT_POINT")
    res = _results(run_ranks("remote_worker.py", 2, ["only-load", "-", url, "", str(nbytes)], env, timeout=120))
    assert all(r == {"step": 3, "tier": "disk", "equal": True} for r in res), res
    assert not [k for k in _remote_layout(s3_bucket) if k.startswith("step_00000007/")]
    assert not s3_bucket.multipart_uploads("run/")


def test_H_remote_only_a_commit_ending_behind_a_later_one_is_not_kept_by_keep_last_1(snap_env, s3_bucket,
                                                                                     monkeypatch):
    """Remote-only, ``keep_last=1``: step 1's commit is held before its manifest (a fault point) while step 2
    commits; step 1's commit then ends behind step 2's. The tracker object stays at step 2 and step 1 is not
    protected from retention (the uploader's rule for an upload behind a later one): the store holds step 2
    alone. Before, step 1's own retention protected it, so the store kept both until the next commit."""
    import torch

    from snapckpt import Checkpointer, StorageType

    url = s3_bucket.url("run")
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "remote.before_manifest:step=1:action=sleep:secs=3")
    with Checkpointer(url, keep_last=1, persister_idle_timeout_secs=20) as ck:
        h1 = ck.save({"w": torch.ones(64)}, 1, StorageType.DISK)
        ck.save({"w": torch.ones(64) * 2}, 2, StorageType.DISK).wait()
        assert not h1.done()  # held: its commit ends after step 2's
        h1.wait()
        assert ck.latest_step() == 2
    committed = sorted(k.split("/")[0] for k in _remote_layout(s3_bucket) if k.endswith("manifest.json"))
    assert committed == ["step_00000002"], committed
    assert s3_bucket.get("run/latest") == b"step_00000002"


def test_H_remote_only_refusals_at_construction(snap_env, s3_bucket):
    """Remote-only mode refuses at construction, before any persister or training: a missing bucket
    (RemoteStorageError naming the URL and the fix, no credential), a scheme fsspec does not know, a URL
    with remote_dir too, and a URL that pathlib mangled (CheckpointDirError naming the cause); nothing is
    created locally."""
    import pathlib

    from snapckpt import Checkpointer
    from snapckpt.errors import CheckpointDirError, RemoteStorageError

    cwd_before = set(os.listdir("."))
    url = f"s3://{s3_bucket.name}-missing/run"
    with pytest.raises(RemoteStorageError) as ei:
        Checkpointer(url, persister_idle_timeout_secs=20)
    msg = str(ei.value)
    assert msg.startswith(f"checkpoint_dir {url!r}: the bucket does not exist") and "create it" in msg, msg
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in msg and os.environ["AWS_ACCESS_KEY_ID"] not in msg
    with pytest.raises(CheckpointDirError, match="nosuchscheme.*remote-only mode"):
        Checkpointer("nosuchscheme://bucket/run", persister_idle_timeout_secs=20)
    with pytest.raises(CheckpointDirError, match="remote_dir .* is set too"):
        Checkpointer(s3_bucket.url("run"), remote_dir=s3_bucket.url("other"), persister_idle_timeout_secs=20)
    with pytest.raises(CheckpointDirError, match="pathlib.Path made it s3:/"):
        Checkpointer(pathlib.Path(s3_bucket.url("run")), persister_idle_timeout_secs=20)
    assert not snap_env.persisters()
    assert set(os.listdir(".")) == cwd_before
    assert not s3_bucket.keys("run/")


def test_cli_on_a_store_it_cannot_list_names_what_to_check(monkeypatch, capsys):
    """``snapckpt ls`` and ``verify`` of a URL whose store refuses the listing (here: no credentials at all) exit 2
    with the cause and what to check, as the API's probe error does (they printed the cause alone). No server is
    needed: the client fails before any request."""
    from snapckpt.cli.main import main as cli

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for cmd in ("ls", "verify"):
        with pytest.raises(SystemExit) as ei:
            cli([cmd, "s3://nobucket/run"])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "cannot be listed: NoCredentialsError" in err and "the endpoint (AWS_ENDPOINT_URL" in err, err


def test_H_remote_only_missing_bucket_is_named_by_the_cli_and_by_a_save_after_its_deletion(snap_env, s3_bucket,
                                                                                             capsys):
    """A missing bucket is never read as an empty prefix: ``snapckpt ls`` and ``verify`` of a URL whose bucket
    does not exist exit 2 naming the cause and the fix (``ls`` said "no checkpoints" and exited 0), and a save
    after the bucket was deleted mid-run fails with RemoteStorageError naming the URL, the cause and the fix
    (it was s3fs's bare FileNotFoundError)."""
    import torch

    from snapckpt import Checkpointer
    from snapckpt.cli.main import main as cli
    from snapckpt.errors import RemoteStorageError

    missing = f"s3://{s3_bucket.name}-missing/run"
    for cmd in ("ls", "verify"):
        with pytest.raises(SystemExit) as ei:
            cli([cmd, missing])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert f"{missing!r}: the bucket does not exist" in err and "create it" in err, err
    url = s3_bucket.url("run")
    with Checkpointer(url, persister_idle_timeout_secs=20) as ck:
        ck.save({"w": torch.arange(10.0)}, 1).wait()
        for key in s3_bucket.keys():
            s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key=key)
        s3_bucket.client.delete_bucket(Bucket=s3_bucket.name)
        with pytest.raises(RemoteStorageError, match=f"checkpoint_dir '{url}': the bucket does not exist.*create it"):
            ck.save({"w": torch.arange(10.0)}, 2).wait()


def test_H_remote_only_snapckpt_stop_flushes_to_the_store(snap_env, s3_bucket, capsys):
    """``snapckpt stop URL`` finds the persister serving a remote-only Checkpointer by its URL (trailing slash
    or not), which flushes the step held only in memory to the store and exits; stop reports it committed,
    and the store holds it with its manifest and the tracker object."""
    import torch

    from snapckpt import Checkpointer, StorageType
    from snapckpt.cli.main import main as cli

    url = s3_bucket.url("run")
    ck = Checkpointer(url, persister_idle_timeout_secs=20)
    try:
        ck.save({"w": torch.arange(1000.0)}, 1, StorageType.MEMORY)
        capsys.readouterr()
        assert cli(["stop", url + "/", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [f for s in out["stopped"] for f in s["flushed"]] == [
            {"checkpoint_dir": url, "step": 1, "committed": True}], out
    finally:
        ck.close(clean=False)
    assert json.loads(s3_bucket.get("run/step_00000001/.snapckpt/manifest.json"))["step"] == 1
    assert s3_bucket.get("run/latest") == b"step_00000001"
    assert not snap_env.persisters()


def test_H_remote_only_part_writer_assembles_parts_in_order_and_discard_aborts(s3_bucket, monkeypatch):
    """The remote-only writer of one object, in-process: 12 MiB written in uneven pieces with 5 MiB parts
    (4 in flight) is stored byte for byte; a small object is one PUT; a writer abandoned after two parts
    leaves neither the object nor an unfinished multipart upload."""
    from snapckpt.storage.remote import RemoteStore
    monkeypatch.setenv("SNAPCKPT_REMOTE_BLOCK_NBYTES", str(5 << 20))
    store = RemoteStore(s3_bucket.url("run"))
    data = os.urandom(12 << 20)
    done = []
    f = store.open_write("step_00000001", "a.bin", on_part=lambda: done.append(1))
    for lo in range(0, len(data), 3 << 20):
        f.write(memoryview(data)[lo:lo + (3 << 20)])
    f.close()
    assert s3_bucket.get("run/step_00000001/a.bin") == data and len(done) == 3
    f = store.open_write("step_00000001", "small.bin")
    f.write(b"tiny")
    f.close()
    assert s3_bucket.get("run/step_00000001/small.bin") == b"tiny"
    f = store.open_write("step_00000002", "b.bin")
    f.write(data[:11 << 20])
    RemoteStore.abandon(f)
    assert not s3_bucket.keys("run/step_00000002/") and not s3_bucket.multipart_uploads("run/")


def test_H2_remote_only_store_failing_mid_upload_fails_the_save_keeps_the_previous_step_and_recovers(
        snap_env, s3_bucket, monkeypatch):
    """Remote-only mode through a fault proxy: step 1 commits; the persister is held (SIGSTOP at its fault
    point) after the first part of step 2's multipart upload while the proxy resets the live connections and
    answers every new one 503 Slow Down; resumed, it retries (botocore's and s3fs's retries, cut short here
    by AWS_MAX_ATTEMPTS), then step 2's save fails with an error naming the URL and the cause,
    never a key. Training goes on (a MEMORY save succeeds meanwhile); step 1 stays the tracker's, intact
    and loadable bitwise; once the server answers again the next DISK save commits, and neither step 2's
    prefix nor its multipart upload is left in the store."""
    import signal
    import time

    import torch

    import s3server
    from snapckpt import Checkpointer, StorageType

    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's attempts per request
    monkeypatch.setenv("SNAPCKPT_REMOTE_BLOCK_NBYTES", str(5 << 20))
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", "remote.mid_upload:step=2:action=stop")
    url = s3_bucket.url("run")
    states = {s: {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(s)), "step": s}
              for s in (1, 2, 3, 4)}  # 12 MiB: a multipart upload of 3 parts
    try:
        with Checkpointer(url, persister_idle_timeout_secs=20, commit_timeout_secs=60) as ck:
            ck.save(states[1], 1).wait()
            pending = ck.save(states[2], 2)
            assert wait_until(lambda: "SNAPCKPT_FAULT_POINT hit remote.mid_upload" in _persister_logs(snap_env),
                              timeout=60), _persister_logs(snap_env)[-3000:]
            assert wait_until(lambda: [p for p in snap_env.persisters() if p.status() == "stopped"], timeout=10)
            assert s3_bucket.multipart_uploads("run/step_00000002/")  # step 2 is mid-upload
            proxy.fail("503")
            t0 = time.monotonic()
            for p in snap_env.persisters():
                p.send_signal(signal.SIGCONT)
            with pytest.raises(Exception) as ei:
                pending.wait()
            took = time.monotonic() - t0
            msg = f"{type(ei.value).__name__}: {ei.value}"
            print(f"step 2 failed {took:.1f} s after the store went down: {msg}")
            assert url in msg and ("SlowDown" in msg or "503" in msg or "Slow Down" in msg), msg
            assert os.environ["AWS_SECRET_ACCESS_KEY"] not in msg and os.environ["AWS_ACCESS_KEY_ID"] not in msg
            assert proxy.failed >= 2  # retried
            ck.save(states[3], 3, StorageType.MEMORY).wait()  # training goes on
            # the persister gave up on step 2 while the store was down: its abort and clean-up failed too
            assert wait_until(lambda: "could not remove" in _persister_logs(snap_env), timeout=60), \
                _persister_logs(snap_env)[-3000:]
            proxy.mode = "pass"
            assert s3_bucket.get("run/latest") == b"step_00000001"
            assert not s3_bucket.keys("run/step_00000002/.snapckpt/manifest.json")
            got = ck.load(step=1)
            assert ck.last_load.step == 1 and torch.equal(got["w"], states[1]["w"]), ck.last_load
            ck.save(states[4], 4).wait()
            assert s3_bucket.get("run/latest") == b"step_00000004"
            # what step 2 left is deleted once the store answers (after step 4's commit, in the background)
            assert wait_until(lambda: not s3_bucket.keys("run/step_00000002/"), timeout=30), _remote_layout(s3_bucket)
            assert wait_until(lambda: not s3_bucket.multipart_uploads("run/"), timeout=30)
    finally:
        proxy.close()


def test_H4_a_store_that_cannot_be_listed_at_load_is_never_a_fresh_start(snap_env, s3_bucket, monkeypatch):
    """A node replaced (empty checkpoint_dir, no memory tier) whose remote tier answers the start's probe but
    then fails the load's listing (503 Slow Down through the fault proxy): latest_step() and load() raise
    RemoteStorageError naming the URL and the cause, never None / "not found" (before: latest_step() was
    None, the job trained from step 0 and its uploads replaced the remote checkpoints). Once the store
    answers, the same Checkpointer loads step 2 from the remote tier. With a local checkpoint, an
    unlistable store is a warning and the local step loads; so it is on a first run (the start created the
    remote directory's owner record: nothing of the job is there), which starts afresh."""
    import torch

    import s3server
    from snapckpt import Checkpointer
    from snapckpt.errors import RemoteStorageError

    url, opts, states = _two_steps_uploaded(snap_env, s3_bucket)
    shutil.rmtree(snap_env.ckpt_dir)
    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's attempts per request
    try:
        with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
            proxy.mode = "503"
            for call in (ck.latest_step, ck.load):
                with pytest.raises(RemoteStorageError, match="cannot be listed") as ei:
                    call()
                assert url in str(ei.value) and "reduce your request rate" in str(ei.value), str(ei.value)
                assert os.environ["AWS_SECRET_ACCESS_KEY"] not in str(ei.value)
            proxy.mode = "pass"
            got = ck.load()
            assert ck.last_load.step == 2 and torch.equal(got["w"], states[2]["w"])
            proxy.mode = "503"
            assert ck.latest_step() == 2  # on disk now: the store's outage is only a warning
            proxy.mode = "pass"
        assert wait_until(lambda: not snap_env.persisters(), timeout=60)
        # a first run (this start created the remote directory's owner record): nothing of it can be hidden there
        with Checkpointer(os.path.join(snap_env.tmp, "first"), remote_dir=s3_bucket.url("first"),
                          persister_idle_timeout_secs=20) as ck:
            proxy.mode = "503"
            assert ck.latest_step() is None
            proxy.mode = "pass"
    finally:
        proxy.close()


@pytest.mark.parametrize("damage", ["bit_flip", "truncated", "garbled_manifest", "bit_flip_of_another_save",
                                    "no_manifest"])
def test_H4_a_damaged_local_copy_is_replaced_by_its_intact_remote_copy(snap_env, s3_bucket, damage):
    """Steps 1 and 2 committed locally and uploaded; then a bit of the local step 2's data file flips (its
    size stays: the listing's quick check passes, the read fails its checksum) or the file is truncated (the
    listing skips it as damaged). The remote tier holds the same save of step 2, intact: load() replaces the
    local copy by a verified download and loads step 2 bitwise (before: step 1 was loaded, a step lost
    although an intact copy existed; the truncated copy even made the download fail with FileExistsError);
    so is one whose manifest is garbled. A local directory holding another save of the step, or no manifest
    file (not snapckpt's), is never replaced: step 1 loads."""
    import torch

    from snapckpt import Checkpointer, StorageType

    url, opts, states = _two_steps_uploaded(snap_env, s3_bucket)
    d = os.path.join(snap_env.ckpt_dir, "step_00000002")
    data = [f for f in os.listdir(d) if not f.startswith(".")]
    assert data, os.listdir(d)
    path = os.path.join(d, data[0])
    if damage == "bit_flip_of_another_save":  # as if step 2 had been saved again locally, not uploaded
        m = json.load(open(os.path.join(d, ".snapckpt", "manifest.json")))
        m["created_unix"] += 1
        open(os.path.join(d, ".snapckpt", "manifest.json"), "w").write(json.dumps(m))
    mpath = os.path.join(d, ".snapckpt", "manifest.json")
    if damage == "garbled_manifest":
        open(mpath, "wb").write(b'{"step": 2, "fi')
    if damage == "no_manifest":  # not snapckpt's directory any more: never touched
        os.unlink(mpath)
    if damage.startswith("bit_flip"):
        b = bytearray(open(path, "rb").read())
        b[len(b) // 2] ^= 1
        open(path, "wb").write(b)
    else:
        os.truncate(path, 10)
    with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
        got = ck.load()
        if damage == "bit_flip_of_another_save":
            assert ck.last_load.step == 1 and torch.equal(got["w"], states[1]["w"]), ck.last_load
            assert open(path, "rb").read() == bytes(b)  # left as it was
            return
        if damage == "no_manifest":
            assert ck.last_load.step == 1 and torch.equal(got["w"], states[1]["w"]), ck.last_load
            assert os.path.exists(path) and not os.path.exists(mpath)  # left as it was
            return
        assert ck.last_load.step == 2 and ck.last_load.tier == StorageType.DISK, ck.last_load
        assert torch.equal(got["w"], states[2]["w"]) and got["step"] == 2
        assert sorted(os.listdir(snap_env.ckpt_dir)) == ["latest", "step_00000001", "step_00000002"], \
            os.listdir(snap_env.ckpt_dir)  # the damaged copy replaced, nothing hidden left
        assert ck.latest_step() == 2


def test_two_jobs_starting_at_once_on_one_remote_directory_one_is_refused(tmp_path, s3_bucket, monkeypatch):
    """Two jobs (say a sweep launched with one remote_dir for all) claim the same remote directory at the same
    moment: both read "no owner" before either writes (a barrier in the read makes the race certain). Exactly
    one claim wins; the other raises RemoteStorageError naming the winner (before: both passed, the second
    write replaced the first owner record, and the jobs replaced each other's checkpoints)."""
    import threading

    from snapckpt.errors import RemoteStorageError
    from snapckpt.storage.remote import RemoteStore

    url = s3_bucket.url("shared")
    barrier = threading.Barrier(2, timeout=30)
    real_read = RemoteStore._read

    def racing_read(self, path):
        try:
            return real_read(self, path)
        finally:
            if path.endswith(RemoteStore.OWNER):
                try:
                    barrier.wait()  # only the first read of each job: the barrier breaks afterwards
                except threading.BrokenBarrierError:
                    pass

    monkeypatch.setattr(RemoteStore, "_read", racing_read)
    out = {}

    def job(name):
        try:
            out[name] = RemoteStore(url).claim(str(tmp_path / name), None)
        except Exception as e:
            out[name] = e
        finally:
            barrier.abort()

    threads = [threading.Thread(target=job, args=(n,)) for n in ("job_a", "job_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [v for v in out.values() if isinstance(v, Exception)]
    assert len(out) == 2 and len(errors) == 1, out
    assert isinstance(errors[0], RemoteStorageError) and "is the remote tier of another job" in str(errors[0])
    winner = next(v for v in out.values() if isinstance(v, dict))
    assert winner["checkpoint_dir"] in str(errors[0])
    assert json.loads(s3_bucket.get("shared/.snapckpt-owner.json")) == winner


@pytest.mark.timeout(150)  # the hang guard: before the bound, the start alone took over 6 minutes
def test_a_hung_store_is_an_error_within_the_coordination_timeout_at_start_and_at_load(snap_env, s3_bucket,
                                                                                     monkeypatch):
    """A store that accepts connections but never answers (a hung server: the fault proxy's "stall" mode).
    At start the access probe is given up after half the coordination timeout (5 s here) with
    RemoteStorageError naming the URL and "did not answer" (before: s3fs's 15 s read timeout times botocore's
    attempts times s3fs's retries held rank 0 for over 6 minutes, and the other ranks' wait ended first with
    "rank 0 did not answer"). At load, a listing that does not answer is given up the same way: with
    nothing local, RemoteStorageError; with a local checkpoint, that one loads."""
    import torch

    import s3server
    from snapckpt import Checkpointer, StorageType
    from snapckpt.errors import RemoteStorageError

    url = s3_bucket.url("run")
    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    opts = dict(remote_dir=url, persister_idle_timeout_secs=5, coordination_timeout_secs=10)
    try:
        proxy.mode = "stall"
        with pytest.raises(RemoteStorageError, match="did not answer") as ei:
            Checkpointer(snap_env.ckpt_dir, **opts)
        assert url in str(ei.value) and "AWS_ENDPOINT_URL" in str(ei.value), str(ei.value)
        assert not snap_env.persisters()
        proxy.mode = "pass"
        w = torch.arange(8.0)
        with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
            ck.save({"w": w}, 1, StorageType.DISK).wait()
        assert wait_until(lambda: not snap_env.persisters(), timeout=90)  # its upload of step 1 done
        assert s3_bucket.get("run/latest") == b"step_00000001"
        shutil.rmtree(snap_env.ckpt_dir)  # a replaced node
        with Checkpointer(snap_env.ckpt_dir, **opts) as ck:
            proxy.mode = "stall"
            with pytest.raises(RemoteStorageError, match="did not answer within 5 s"):
                ck.latest_step()
            proxy.fail("pass")  # the server answers again: requests held on its connections retry at once
            got = ck.load()
            assert ck.last_load.step == 1 and torch.equal(got["w"], w)  # downloaded
            proxy.mode = "stall"
            got = ck.load()  # the local step; the store's silence only a warning
            assert ck.last_load.step == 1 and torch.equal(got["w"], w)
            proxy.fail("pass")
        assert wait_until(lambda: not snap_env.persisters(), timeout=90)
    finally:
        proxy.close()


def test_cli_given_one_remote_checkpoint_names_its_parent(tmp_path, s3_bucket, capsys):
    """``snapckpt ls`` / ``verify`` of one checkpoint's prefix (``s3://b/run/step_00000001``, a natural slip) exit 2
    saying it is one checkpoint and naming the directory to pass, as for a local step directory (before: ``ls``
    printed "no checkpoints under ..." and exited 0, ``verify`` "no committed checkpoint")."""
    from snapckpt.cli.main import main as cli
    from snapckpt.persister.uploader import Uploader, UploadJob

    d1, m1 = _local_checkpoint(str(tmp_path / "src"), 1, {"a.bin": b"a" * 100})
    url = s3_bucket.url("run")
    up = Uploader(lambda: None)
    up.submit(UploadJob("run1", url, d1, "step_00000001", m1, None, "latest", "step_00000001"))
    up.shutdown()
    assert s3_bucket.get("run/latest") == b"step_00000001"
    for cmd in ("ls", "verify"):
        for arg in (f"{url}/step_00000001", f"{url}/step_00000001/"):
            with pytest.raises(SystemExit) as ei:
                cli([cmd, arg])
            assert ei.value.code == 2
            err = capsys.readouterr().err
            want = f"{url}/step_00000001 is one checkpoint, not a checkpoint directory: pass its parent {url}"
            assert want in err, err
    assert cli(["verify", url]) == 0
    assert "step_00000001" in capsys.readouterr().out


@pytest.mark.timeout(150)  # the hang guard
def test_H_remote_only_a_hung_store_at_load_is_an_error_within_the_coordination_timeout(snap_env, s3_bucket,
                                                                                        monkeypatch):
    """Remote-only mode, the store hung (accepts connections, never answers) when the job asks for its newest
    step with nothing in memory: latest_step() raises CheckpointCorruptError saying the store did not answer,
    after half the coordination timeout (before: the listing held rank 0 for the client's timeouts and retries,
    minutes, longer than any other rank waits for it). Never None (a fresh start)."""
    import s3server
    from snapckpt import Checkpointer
    from snapckpt.errors import CheckpointCorruptError

    url = s3_bucket.url("run")
    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with Checkpointer(url, persister_idle_timeout_secs=5, coordination_timeout_secs=10) as ck:
            proxy.mode = "stall"
            with pytest.raises(CheckpointCorruptError, match="did not answer within 5 s"):
                ck.latest_step()
            proxy.fail("pass")
            assert ck.latest_step() is None  # nothing saved yet: a fresh start once the store answers
        assert wait_until(lambda: not snap_env.persisters(), timeout=90)
    finally:
        proxy.close()


def test_H2_uploads_failing_for_the_run_are_told_to_the_training_side_then_the_catch_up(snap_env, s3_bucket,
                                                                                       monkeypatch, caplog):
    """Uploads that keep failing (the store answers every request 503 once training runs: expired credentials,
    a bucket made read-only): rank 0's training process logs one WARNING at the next save naming the step,
    the remote URL, the cause and what to check, never a credential; a second failure within the reminder
    interval is an ``upload_failed`` event but no second warning. Once an upload succeeds again, one INFO says
    the remote tier caught up. No exception reaches the training loop; the local tier has every step."""
    import logging

    import torch

    import s3server
    from snapckpt import Checkpointer, StorageType

    proxy = s3server.FaultProxy(s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's attempts per request: the uploader's retries remain
    caplog.set_level(logging.INFO, logger="snapckpt")
    url = s3_bucket.url("run")
    events = []

    def failed_in_log(step):
        return f"upload of step {step} (step_{step:08d}) to {url} failed after" in _persister_logs(snap_env)

    def latest():
        return s3_bucket.keys("run/latest") and s3_bucket.get("run/latest")

    def warnings():
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "to the remote tier failed" in r.getMessage()]

    try:
        with Checkpointer(snap_env.ckpt_dir, remote_dir=url, persister_idle_timeout_secs=20,
                          commit_timeout_secs=60) as ck:
            ck.add_listener(lambda e: events.append((e.kind, e.step)))
            st = {"w": torch.arange(1000, dtype=torch.float32)}
            ck.save(st, 1, StorageType.DISK).wait()
            assert wait_until(lambda: latest() == b"step_00000001", timeout=60)
            proxy.fail("503")
            ck.save(st, 2, StorageType.DISK).wait()
            assert wait_until(lambda: failed_in_log(2), timeout=120), _persister_logs(snap_env)[-3000:]
            assert not warnings()
            ck.save(st, 3, StorageType.DISK).wait()  # its status carries step 2's failure
            (msg,) = warnings()
            assert "step 2 " in msg and url in msg and "Service Unavailable" in msg, msg
            assert "credentials" in msg and "bucket" in msg and snap_env.ckpt_dir in msg, msg
            assert os.environ["AWS_SECRET_ACCESS_KEY"] not in msg and os.environ["AWS_ACCESS_KEY_ID"] not in msg
            assert ("upload_failed", 2) in events
            assert wait_until(lambda: failed_in_log(3), timeout=120), _persister_logs(snap_env)[-3000:]
            proxy.mode = "pass"
            ck.save(st, 4, StorageType.DISK).wait()  # carries step 3's failure: rate-limited, an event only
            assert ("upload_failed", 3) in events and len(warnings()) == 1, warnings()
            assert wait_until(lambda: latest() == b"step_00000004", timeout=60)
            assert not [r for r in caplog.records if "caught up" in r.getMessage()]
            ck.save(st, 5, StorageType.DISK).wait()  # carries step 4's success
            (info,) = [r for r in caplog.records if "caught up" in r.getMessage()]
            assert info.levelno == logging.INFO and url in info.getMessage() and "step 4 " in info.getMessage()
            assert len(warnings()) == 1
            assert not [k for k, _ in events if k == "uploaded"]  # no new event kind
            # step 5's upload ends before the proxy closes (else it fails there and the persister's retries,
            # 1 + 2 + 4 s of backoff, held the teardown)
            assert wait_until(lambda: latest() == b"step_00000005", timeout=60)
    finally:
        proxy.close()
    assert sorted(n for n in os.listdir(snap_env.ckpt_dir) if n.startswith("step_")) == \
        [f"step_{s:08d}" for s in range(1, 6)]


def test_H4_a_fresh_node_picking_the_highest_remote_step_after_a_rewind_warns(snap_env, s3_bucket, caplog):
    """Steps 100, 200, then a rewind to 5, all uploaded; a fresh node (empty checkpoint_dir, no memory tier)
    downloads the highest remote step, 200, as the local tier picks it, and warns the same way the local tier
    does: step 5 was saved after it, and load(step=5) loads it (downloaded from the remote tier)."""
    import logging

    from snapckpt import Checkpointer, StorageType

    url = s3_bucket.url("run")
    with Checkpointer(snap_env.ckpt_dir, remote_dir=url, keep_last=3, persister_idle_timeout_secs=5) as ck:
        for step in (100, 200, 5):
            ck.save({"w": step}, step, StorageType.DISK).wait()
    assert wait_until(lambda: not snap_env.persisters(), timeout=60)  # uploads done, no memory tier left
    assert s3_bucket.get("run/latest") == b"step_00000005"
    shutil.rmtree(snap_env.ckpt_dir)
    with Checkpointer(snap_env.ckpt_dir, remote_dir=url, persister_idle_timeout_secs=5) as ck:
        with caplog.at_level(logging.WARNING, logger="snapckpt"):
            assert ck.load()["w"] == 200
        assert any("step 5 (step_00000005) was saved after it" in r.getMessage() and "load(step=5)"
                   in r.getMessage() for r in caplog.records), caplog.text
        assert ck.load(step=5)["w"] == 5


def test_H2_two_uploaders_at_once_never_move_the_tracker_back_nor_commit_over_vanished_objects(
        tmp_path, s3_bucket, monkeypatch):
    """Two persisters upload to one remote directory at once: a restart put rank 0 on another node while the
    previous committer's persister still uploads its queue (tests/test_multinode_remote.py runs it on the
    rig). Each is its own Uploader here. (1) The old persister's upload of step 9 (saved first) ends after the
    new committer's upload of step 12: the tracker object stays at step 12 (on main it moved back to step 9).
    (2) The other uploader's clean-up of interrupted uploads deletes this upload's data objects after they
    were read back, before the manifest is written: the upload is retried, never a manifest over missing
    objects (on main: a committed-looking step that ``verify`` calls damaged)."""
    from snapckpt.persister import uploader as U
    from snapckpt.storage.remote import RemoteStore

    monkeypatch.setattr(U, "BACKOFF_SECS", 0.01)
    src, url = str(tmp_path / "src"), s3_bucket.url("run")
    ck = {s: _local_checkpoint(src, s, {"a.bin": bytes([s]) * 100}) for s in (6, 9, 12)}
    for s, (d, m) in ck.items():
        m["requested_unix"] = 1000.0 + s  # save order: 6, 9, 12
        m["tracker"] = {"name": "latest", "content": os.path.basename(d)}

    def job(step, order):
        d, m = ck[step]
        return U.UploadJob("run1", url, d, os.path.basename(d), m, None, "latest", os.path.basename(d), order=order)

    new, old = U.Uploader(lambda: None), U.Uploader(lambda: None)
    new.submit(job(12, 1))  # the new committer: its first request
    new.shutdown()
    old.submit(job(9, 7))  # the previous run's persister: its own (unrelated) request order
    old.shutdown()
    assert s3_bucket.get("run/latest") == b"step_00000012"

    real_check = RemoteStore._check_sizes
    vanished = []

    def check_then_vanish(self, dirname, manifest):
        real_check(self, dirname, manifest)
        if dirname == "step_00000006" and not vanished:  # another uploader's clean_orphans, right now
            vanished.append(dirname)
            self._rm_tree(self._path(dirname))

    monkeypatch.setattr(RemoteStore, "_check_sizes", check_then_vanish)
    up = U.Uploader(lambda: None)
    up.submit(job(6, 8))
    up.shutdown()
    monkeypatch.setattr(RemoteStore, "_check_sizes", real_check)
    assert vanished
    problems = []
    committed = [c.dirname for c in RemoteStore(url).list_committed(problems)]
    assert not problems, problems
    assert committed == ["step_00000006", "step_00000009", "step_00000012"], committed
    assert s3_bucket.get("run/latest") == b"step_00000012"


def test_H2_an_upload_failing_until_local_retention_retires_it_is_a_failure_not_a_skip(tmp_path, s3_bucket,
                                                                                       monkeypatch):
    """An outage while DISK saves come faster than the upload's retries (1, 2, 4 s; with the client's own
    retries a failed attempt can take minutes): local retention retires the checkpoint between two attempts.
    That is an ``upload_failed`` note naming the store's error (rank 0 then warns that checkpoints do not
    reach the store), not an ``upload_skipped`` "deleted before its upload began ... a newer checkpoint is
    uploaded instead": on the multi-node rig (tests/test_multinode_remote.py) every upload of a 503 outage was
    told as such a skip, and training heard nothing of the outage."""
    import types

    from snapckpt.persister import uploader as U
    from snapckpt.storage.remote import RemoteStore

    d, m = _local_checkpoint(str(tmp_path / "src"), 1, {"a.bin": b"a" * 100})

    def outage(self, *a, **k):
        raise OSError(16, "Service Unavailable")

    def retire_while_backing_off(secs):
        if os.path.isdir(d):
            os.rename(d, d + ".retired")  # local retention, after a newer save's commit

    monkeypatch.setattr(RemoteStore, "upload", outage)
    monkeypatch.setattr(U, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=retire_while_backing_off))
    up = U.Uploader(lambda: None)
    up.submit(U.UploadJob("run1", s3_bucket.url("run"), d, "step_00000001", m, 2, "latest", "step_00000001"))
    up.shutdown()
    notes = up.notes_for("run1")
    assert [(n["kind"], n["step"]) for n in notes] == [("upload_failed", 1)], notes
    assert "Service Unavailable" in notes[0]["reason"] and s3_bucket.url("run") in notes[0]["reason"], notes
