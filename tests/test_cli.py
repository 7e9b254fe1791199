"""The ``snapckpt`` command line (``ls``, ``verify``, ``inspect``) against real checkpoints.

Checkpoints are written by a real :class:`snapckpt.Checkpointer` (persister process included); the CLI
runs as a subprocess, ``python -m snapckpt ...``, the way a user runs it. Damage is done to the real
files: a flipped byte, a truncated file, a manifest with a field removed, a hand-made partial directory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import torch

from _harness import persisters, wait_until
from snapckpt import Checkpointer
from snapckpt.cli import main
from snapckpt.cli.common import human_bytes

OPTS = dict(persister_idle_timeout_secs=2, commit_timeout_secs=10, request_timeout_secs=10,
            coordination_timeout_secs=10)


def cli(*args: str, extra_python: str = "") -> subprocess.CompletedProcess:
    """Run ``python -m snapckpt ARGS`` (or, with ``extra_python``, that code first and then ``main``)."""
    if extra_python:
        cmd = [sys.executable, "-c", f"{extra_python}\nimport sys\nfrom snapckpt.cli import main\n"
                                     f"sys.exit(main({list(args)!r}))"]
    else:
        cmd = [sys.executable, "-m", "snapckpt", *args]
    # A FutureWarning that a third-party package prints while torch imports (pynvml, pulled in by the
    # benchmarks' DLRover) is not the CLI's output: the tests below require an empty stderr of the CLI.
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def save_steps(ckpt_dir: str, states: dict) -> None:
    """Commit ``{step: state}`` with one Checkpointer (one rank), waiting for every commit, then for the
    persister to exit: the tests here damage the disk tier, and a live persister would still hold the last
    step in memory, which a later ``Checkpointer`` rightly loads first. After a clean close the persister
    exits as soon as no client is connected and nothing is pending (``persister_idle_timeout_secs`` is how
    long it waits after a crash, not after a clean close), but a client that reaches it first keeps it alive,
    and a loaded machine stretches that moment (a CI run got step 3 from memory after ``verify`` and ``ls``)."""
    with Checkpointer(ckpt_dir, **OPTS) as ck:
        for step, state in states.items():
            ck.save(state, step).wait(timeout=30)
    root = os.environ["SNAPCKPT_RUNTIME_DIR"]
    assert wait_until(lambda: not persisters(root), timeout=30), "the persister outlived the clean close"


def small_state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": torch.nn.Linear(8, 4).state_dict(), "step": step}


def ls_rows(out: str) -> dict:
    """``{name: {column: value}}`` from the ``ls`` table (NOTE may contain spaces; it is the rest)."""
    lines = out.splitlines()
    header = lines[0].split()
    assert header[:6] == ["STEP", "NAME", "STATE", "WORLD", "SIZE", "TRACKER"], out
    starts = [lines[0].index(h) for h in header]
    rows = {}
    for line in lines[1:]:
        if not line.strip() or line.startswith(("warning:", "(")):
            continue
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        rows[cells[1]] = dict(zip(header, cells))
    return rows


def inspect_rows(out: str) -> dict:
    """``{key: (shape, dtype, size, note)}`` from ``inspect``'s per-file tables."""
    rows = {}
    for m in re.finditer(r"^    (\S+)\s+(\[[^\]]*\]|-)\s+(\S+)\s+(\d+ B|\d+\.\d \wiB|-)[ \t]*(.*)$", out, re.M):
        if m.group(1) != "KEY":
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4), m.group(5).strip())
    return rows


def rank_file(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}", "rank_00000.pt")


# ------------------------------------------------------------------------------------------------ ls
def test_cli_B2_ls_shows_committed_incomplete_damaged_and_latest(snap_env):
    """Fault: a crashed save (a hidden ``.NAME.partial-RUN`` directory with one rank's part and a
    half-written file), a manifest with a field removed, a truncated file. Right behaviour: ``ls`` shows
    each checkpoint with its state (committed / incomplete / damaged), step, world size and bytes, marks
    the one ``latest`` names, and warns when the tracker names no committed checkpoint."""
    d = snap_env.ckpt_dir
    save_steps(d, {s: small_state(s) for s in (1, 2, 3)})
    sizes = {s: os.path.getsize(rank_file(d, s)) for s in (1, 2, 3)}
    # step 1: manifest loses a required field; step 2: its file is truncated (power loss)
    mpath = os.path.join(d, "step_00000001", ".snapckpt", "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    del m["world_size"]
    with open(mpath, "w") as f:
        json.dump(m, f)
    with open(rank_file(d, 2), "r+b") as f:
        f.truncate(100)
    # step 4: a save that crashed after rank 0 wrote its part (by hand: no persister may clean it up)
    partial = os.path.join(d, ".step_00000004.partial-0123abcd4567")
    os.makedirs(os.path.join(partial, ".snapckpt"))
    with open(os.path.join(partial, "rank_00000.pt"), "wb") as f:
        f.write(b"\0" * 777)
    with open(os.path.join(partial, ".snapckpt", "part_00000.json"), "w") as f:
        json.dump({"rank": 0, "run_id": "0123abcd4567", "step": 4,
                   "files": {"rank_00000.pt": {"nbytes": 777, "crc32": "00000000"}}}, f)
    os.makedirs(os.path.join(d, "tensorboard"))  # not a checkpoint: only counted

    r = cli("ls", d)
    assert r.returncode == 0, r.stderr
    rows = ls_rows(r.stdout)
    assert set(rows) == {"step_00000001", "step_00000002", "step_00000003", "step_00000004"}, r.stdout
    assert rows["step_00000003"] == {"STEP": "3", "NAME": "step_00000003", "STATE": "committed", "WORLD": "1",
                                     "SIZE": human_bytes(sizes[3]), "TRACKER": "latest", "NOTE": ""}
    assert rows["step_00000001"]["STATE"] == "damaged"
    assert "world_size" in rows["step_00000001"]["NOTE"]
    assert rows["step_00000002"]["STATE"] == "damaged"
    assert rows["step_00000002"]["STEP"] == "2" and rows["step_00000002"]["SIZE"] == human_bytes(sizes[2])
    assert "is 100 bytes, the manifest says" in rows["step_00000002"]["NOTE"]
    inc = rows["step_00000004"]
    assert (inc["STATE"], inc["STEP"], inc["WORLD"], inc["SIZE"]) == ("incomplete", "4", "-", "777 B")
    assert "0123abcd4567" in inc["NOTE"] and "[0]" in inc["NOTE"]
    assert [n for n, row in rows.items() if row["TRACKER"]] == ["step_00000003"]
    assert "1 other directory" in r.stdout

    # --json: the same facts, machine-readable, exact byte counts
    r = cli("ls", d, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc["dir"] == d and doc["other_directories"] == 1 and doc["warnings"] == []
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["step_00000003"] == {"name": "step_00000003", "state": "committed", "step": 3, "world_size": 1,
                                        "bytes": sizes[3], "trackers": ["latest"], "note": ""}
    assert (by_name["step_00000002"]["state"], by_name["step_00000002"]["bytes"]) == ("damaged", sizes[2])
    assert "is 100 bytes, the manifest says" in by_name["step_00000002"]["note"]
    assert (by_name["step_00000004"]["state"], by_name["step_00000004"]["step"], by_name["step_00000004"]["bytes"],
            by_name["step_00000004"]["world_size"]) == ("incomplete", 4, 777, None)
    assert by_name["step_00000001"]["state"] == "damaged" and by_name["step_00000001"]["step"] is None

    # the tracker naming a damaged checkpoint is called out
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step_00000002")
    r = cli("ls", d)
    assert r.returncode == 0
    assert ls_rows(r.stdout)["step_00000002"]["TRACKER"] == "latest"
    assert "warning: latest names 'step_00000002', which is damaged (see its row" in r.stdout


def test_cli_ls_and_verify_of_a_runs_parent_name_the_checkpoint_directory_in_it(snap_env):
    """``snapckpt ls runs/x`` when the checkpoints are in ``runs/x/checkpoints`` (an easy slip) names that
    directory; so does ``verify``'s usage error (exit 2)."""
    run = os.path.join(os.path.dirname(snap_env.ckpt_dir), "run_x")
    ckpt = os.path.join(run, "checkpoints")
    save_steps(ckpt, {1: {"w": torch.ones(3)}})
    os.makedirs(os.path.join(run, "logs"))
    r = cli("ls", run)
    assert r.returncode == 0 and f"no checkpoint directories in {run} (did you mean {ckpt}?)" in r.stdout, r
    r = cli("verify", run)
    assert r.returncode == 2 and f"(did you mean {ckpt}?)" in r.stderr, r


def test_cli_ls_lists_two_tags_committed_at_one_step(snap_env):
    """Two directories (tags ``same`` and ``m``, the way the DeepSpeed integration names them) committed
    at one step, plus a plain step. Right behaviour: ``ls`` lists every committed directory, both rows
    at step 12, as ``verify`` does."""
    from snapckpt import StorageType

    d = snap_env.ckpt_dir
    with Checkpointer(d, **OPTS) as ck:
        ck.save(small_state(11), 11).wait(timeout=30)
        for tag in ("same", "m"):
            ck.save_files({"rank_00000.pt": small_state(12)}, 12, StorageType.DISK, dirname=tag,
                           tracker_name="latest", tracker_content=tag).wait(timeout=30)
    r = cli("ls", d)
    assert r.returncode == 0, r.stderr
    rows = ls_rows(r.stdout)
    assert set(rows) == {"step_00000011", "same", "m"}, r.stdout
    assert rows["same"]["STEP"] == rows["m"]["STEP"] == "12", r.stdout
    assert rows["same"]["STATE"] == rows["m"]["STATE"] == "committed", r.stdout
    assert rows["m"]["TRACKER"] == "latest" and rows["same"]["TRACKER"] == "", r.stdout
    v = cli("verify", d)
    assert v.returncode == 0 and "3 checkpoint(s): 3 intact, 0 damaged" in v.stdout, v.stdout


# -------------------------------------------------------------------------------------------- verify
def test_cli_verify_intact_checkpoints_exit_0(snap_env):
    """No fault. Right behaviour: ``verify`` re-checksums every committed checkpoint (or one STEP),
    prints OK for each, and exits 0; with ``--progress`` a bar goes to stderr, never to stdout, and by
    default (stderr not a terminal) nothing goes to stderr."""
    d = snap_env.ckpt_dir
    save_steps(d, {s: small_state(s) for s in (1, 2)})
    r = cli("verify", d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^OK\s+step 1\s+step_00000001", r.stdout, re.M)
    assert re.search(r"^OK\s+step 2\s+step_00000002", r.stdout, re.M)
    assert "2 intact, 0 damaged" in r.stdout
    assert r.stderr == ""
    r = cli("verify", d, "2", "--progress")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step_00000002" in r.stdout and "step_00000001" not in r.stdout
    assert "verify step_00000002" in r.stderr  # the tqdm bar
    # without tqdm the same command works, with no bar
    r = cli("verify", d, "2", "--progress", extra_python="import sys; sys.modules['tqdm'] = None")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert "1 intact, 0 damaged" in r.stdout


def test_cli_B3_verify_flipped_byte_names_the_file(snap_env):
    """Fault: one byte flipped inside a committed file (same size, so the quick size check passes and
    ``ls`` still calls it committed). Right behaviour: ``verify`` reports that checkpoint DAMAGED naming
    the file and the checksum (XXH3-64) mismatch, reports the other one OK, and exits 1; verifying only the intact
    step exits 0."""
    d = snap_env.ckpt_dir
    save_steps(d, {s: small_state(s) for s in (1, 2)})
    path = rank_file(d, 2)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert ls_rows(cli("ls", d).stdout)["step_00000002"]["STATE"] == "committed"
    r = cli("verify", d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^OK\s+step 1\s+step_00000001", r.stdout, re.M)
    assert re.search(r"^DAMAGED\s+step 2\s+step_00000002", r.stdout, re.M)
    assert f"{path} has xxh3_64" in r.stdout and "(corrupted)" in r.stdout
    assert "1 intact, 1 damaged" in r.stdout
    assert cli("verify", d, "1").returncode == 0
    r = cli("verify", d, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["dir"], doc["intact"], doc["damaged"]) == (d, 1, 1)
    c1, c2 = doc["checkpoints"]
    assert c1 == {"name": "step_00000001", "step": 1, "state": "intact", "files": 1,
                  "bytes": os.path.getsize(rank_file(d, 1)), "problems": []}
    assert (c2["name"], c2["step"], c2["state"], c2["bytes"]) == ("step_00000002", 2, "damaged", size)
    assert len(c2["problems"]) == 1 and f"{path} has xxh3_64" in c2["problems"][0]


def test_cli_B3_verify_truncated_file_and_broken_manifest(snap_env):
    """Fault: power loss left a committed file truncated to 0 bytes; another checkpoint's manifest is
    not JSON any more. Right behaviour: ``verify`` names the truncated file with its size and the
    manifest's, reports the unreadable manifest as DAMAGED too, and exits 1."""
    d = snap_env.ckpt_dir
    save_steps(d, {s: small_state(s) for s in (1, 2, 3)})
    expected = os.path.getsize(rank_file(d, 3))
    open(rank_file(d, 3), "wb").close()
    with open(os.path.join(d, "step_00000001", ".snapckpt", "manifest.json"), "w") as f:
        f.write('{"format": "snapckpt", "format_ver')
    r = cli("verify", d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^DAMAGED\s+step 3\s+step_00000003", r.stdout, re.M)
    assert f"{rank_file(d, 3)} is 0 bytes, the manifest says {expected}" in r.stdout
    assert re.search(r"^DAMAGED\s+step_00000001: manifest is not valid JSON", r.stdout, re.M)
    assert re.search(r"^OK\s+step 2\s+step_00000002", r.stdout, re.M)
    assert "1 intact, 2 damaged" in r.stdout


def test_cli_B3_deleted_manifest_is_damaged_for_verify_ls_and_load(snap_env, caplog):
    """Fault: step 3's ``.snapckpt/manifest.json`` deleted; step 2's whole ``.snapckpt`` sidecar deleted
    (only its ``step_00000002`` name says it is snapckpt's). Right behaviour: not a silent rollback:
    ``verify`` counts both as DAMAGED and exits 1, ``ls`` marks both damaged, and ``latest_step()`` then ``load()``
    load step 1 with one warning (not one per call) naming each skipped directory."""
    import logging

    d = snap_env.ckpt_dir
    save_steps(d, {s: small_state(s) for s in (1, 2, 3)})
    os.remove(os.path.join(d, "step_00000003", ".snapckpt", "manifest.json"))
    shutil.rmtree(os.path.join(d, "step_00000002", ".snapckpt"))
    os.makedirs(os.path.join(d, "tensorboard"))  # not snapckpt's: never called damaged
    r = cli("verify", d)
    assert r.returncode == 1, r.stdout + r.stderr
    for step in (2, 3):
        assert re.search(rf"^DAMAGED\s+step_{step:08d}: \.snapckpt/manifest\.json is missing", r.stdout, re.M), r.stdout
    assert re.search(r"^OK\s+step 1\s+step_00000001", r.stdout, re.M)
    assert "3 checkpoint(s): 1 intact, 2 damaged" in r.stdout
    rows = ls_rows(cli("ls", d).stdout)
    assert rows["step_00000002"]["STATE"] == rows["step_00000003"]["STATE"] == "damaged"
    assert "tensorboard" not in rows
    with Checkpointer(d, **OPTS) as ck:
        with caplog.at_level(logging.WARNING, logger="snapckpt.engine.checkpointer"):
            assert ck.latest_step() == 1  # the usual resume: latest_step() then load(), one warning each
            out = ck.load()
        assert ck.last_load.step == 1 and out["step"] == 1
    warned = [r.getMessage() for r in caplog.records if "not a loadable checkpoint" in r.getMessage()]
    for step in (2, 3):
        said = [w for w in warned if f"step_{step:08d}: .snapckpt/manifest.json is missing" in w]
        assert len(said) == 1, caplog.text
    assert not any("tensorboard" in w for w in warned), warned


def test_cli_verify_usage_errors_exit_2(snap_env):
    """Fault: user mistakes. Right behaviour: exit 2 with a message for a missing DIR, an unknown STEP
    (listing the committed steps), a checkpoint passed instead of its parent, and an empty directory."""
    d = snap_env.ckpt_dir
    save_steps(d, {5: small_state(5)})
    r = cli("verify", os.path.join(snap_env.tmp, "nope"))
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = cli("verify", d, "7")
    assert r.returncode == 2 and "no committed checkpoint of step 7" in r.stderr and "[5]" in r.stderr
    # What the arguments name is wrong, not their syntax: the reason alone, no usage line pushing it off screen.
    assert "usage:" not in r.stderr and r.stderr.startswith("snapckpt verify: error:"), r.stderr
    r = cli("inspect", d, "7")
    assert r.returncode == 2 and "usage:" not in r.stderr and "no committed checkpoint of step 7" in r.stderr
    r = cli("verify", d, "--bogus")  # a real usage error keeps argparse's usage line
    assert r.returncode == 2 and "usage:" in r.stderr
    r = cli("verify", d, "7", "--json")  # a script parsing stdout gets an object too
    assert r.returncode == 2 and "no committed checkpoint of step 7" in json.loads(r.stdout)["error"], r.stdout
    r = cli("ls", os.path.join(snap_env.tmp, "nope"), "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["exit"] == 2 and "no such directory" in r.stderr
    r = cli("verify", os.path.join(d, "step_00000005"))
    assert r.returncode == 2 and "pass its parent" in r.stderr
    empty = os.path.join(snap_env.tmp, "empty")
    os.makedirs(empty)
    r = cli("verify", empty)
    assert r.returncode == 2 and "no committed checkpoint" in r.stderr


# ------------------------------------------------------------------------------------------- inspect
def test_cli_inspect_lists_keys_shapes_dtypes_bytes(snap_env):
    """No fault. Right behaviour: ``inspect DIR STEP`` lists every key of the rank file as a dotted
    path (nested dicts, lists, the optimizer's integer state keys), with shape, dtype and bytes of each
    tensor, non-tensor values by type and value, and tied tensors marked as sharing storage."""
    d = snap_env.ckpt_dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
             "extra": {"bf16": torch.zeros(5, 3, dtype=torch.bfloat16), "scalar": torch.tensor(3),
                       "tied": [model[0].weight]}}
    save_steps(d, {7: state})
    r = cli("inspect", d, "7")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = inspect_rows(r.stdout)
    assert rows["model.0.weight"] == ("[4, 8]", "float32", "128 B", "")
    assert rows["model.1.bias"] == ("[2]", "float32", "8 B", "")
    assert rows["optimizer.state.0.exp_avg"] == ("[4, 8]", "float32", "128 B", "")
    assert rows["optimizer.state.3.exp_avg_sq"] == ("[2]", "float32", "8 B", "")
    assert rows["optimizer.param_groups.0.lr"][:3] == ("-", "float", "-")
    assert rows["step"] == ("-", "int", "-", "7")
    assert rows["extra.bf16"] == ("[5, 3]", "bfloat16", "30 B", "")
    assert rows["extra.scalar"] == ("[]", "int64", "8 B", "")
    assert rows["extra.tied.0"] == ("[4, 8]", "float32", "128 B", "shares storage with model.0.weight")
    nbytes = os.path.getsize(rank_file(d, 7))
    assert f"rank 0  rank_00000.pt  {human_bytes(nbytes)}" in r.stdout
    assert "step_00000007: step 7, world size 1" in r.stdout
    assert r.stderr == ""

    r = cli("inspect", d, "7", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["dir"], doc["step"], doc["problems"], doc["refused"]) == (d, 7, [], [])
    (ck,) = doc["checkpoints"]
    assert (ck["name"], ck["step"], ck["world_size"], ck["problem"]) == ("step_00000007", 7, 1, None)
    (f,) = ck["files"]
    assert (f["name"], f["rank"], f["bytes"], f["kind"], f["status"], f["error"]) == (
        "rank_00000.pt", 0, nbytes, "torch", "ok", None)
    keys = {k["key"]: k for k in f["keys"]}
    assert keys["model.0.weight"] == {"key": "model.0.weight", "type": "Tensor", "shape": [4, 8], "dtype": "float32",
                                      "bytes": 128, "shares_storage_with": None, "value": None}
    assert keys["extra.tied.0"]["shares_storage_with"] == "model.0.weight"
    assert keys["step"] == {"key": "step", "type": "int", "shape": None, "dtype": None, "bytes": None,
                            "shares_storage_with": None, "value": "7"}


def test_cli_inspect_other_formats_and_usage_errors(snap_env):
    """Found by a new-user trial. Fault: ``inspect`` on a Megatron checkpoint reported every DCP
    ``.distcp`` shard as "corrupted" (a zip reader ran on a file that only embeds zip records) and exited
    1 while ``verify`` said OK; ``--rank`` of a rank without files printed a bare header and exited 0; ``ls``
    of a file said "no such directory". Right behaviour: a file the manifest records as raw bytes is listed,
    not opened; a ``.safetensors`` file lists its tensors from its header (shape, dtype, bytes); a rank
    without files and a path that is a file are usage errors (exit 2) naming what to pass."""
    import io

    from safetensors.torch import save as st_save

    from snapckpt.formats.specs import RawBytes

    d = snap_env.ckpt_dir
    fake_distcp = io.BytesIO()
    torch.save({"x": torch.ones(3)}, fake_distcp)  # a torch.save record inside a larger raw file
    files = {"model.safetensors": RawBytes(st_save({"w": torch.zeros(4, 2), "h": torch.ones(3, dtype=torch.bfloat16)})),
             "__0_0.distcp": RawBytes(b"DCP" + fake_distcp.getvalue() + b"tail"),
             "metadata.json": RawBytes(b'{"a": 1}')}
    with Checkpointer(d, **OPTS) as ck:
        ck.save_files(files, 3, "disk", dirname="iter_0000003", tracker_name=None).wait(timeout=30)
    r = cli("inspect", d, "3")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = inspect_rows(r.stdout)
    assert rows["w"] == ("[4, 2]", "F32", "32 B", "") and rows["h"] == ("[3]", "BF16", "6 B", ""), r.stdout
    assert r.stdout.count("not a torch.save archive: not inspected") == 2, r.stdout
    assert "corrupt" not in r.stdout + r.stderr
    r = cli("inspect", d, "3", "--rank", "5")
    assert r.returncode == 2 and "no files of rank 5 (its ranks: 0)" in r.stderr, r.stderr
    r = cli("ls", os.path.join(d, "iter_0000003", "metadata.json"))
    assert r.returncode == 2 and "not a directory" in r.stderr and "no such" not in r.stderr, r.stderr


class Tripwire:
    """Pickles as a call to ``open(path, "w")``: loading it runs code (it creates ``path``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_cli_E6_inspect_weights_only_refusal_and_trust(snap_env):
    """Fault: a checkpoint holding pickled objects (an ``argparse.Namespace`` of training arguments,
    and an object whose unpickling runs code). Right behaviour: ``inspect`` loads with
    ``weights_only=True``, which refuses the file without running any of its pickle, and tells the user
    to pass ``--trust`` (exit 1); ``--trust`` is the explicit decision that loads it with
    ``weights_only=False`` and lists every key."""
    d = snap_env.ckpt_dir
    tripwire = os.path.join(snap_env.tmp, "pickle-ran")
    args = argparse.Namespace(lr=0.5, name="run1")
    save_steps(d, {1: small_state(1), 2: {**small_state(2), "args": args, "obj": Tripwire(tripwire)}})
    assert not os.path.exists(tripwire)

    r = cli("inspect", d, "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused by torch.load(weights_only=True)" in r.stdout
    assert "--trust" in r.stderr and "rank_00000.pt" in r.stderr
    assert f"snapckpt inspect {d} 2 --trust" in r.stderr
    assert "model.weight" not in r.stdout
    assert not os.path.exists(tripwire), "weights_only=True must not run the checkpoint's pickle"

    r = cli("inspect", d, "2", "--trust")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = inspect_rows(r.stdout)
    assert rows["model.weight"] == ("[4, 8]", "float32", "128 B", "")
    assert rows["args"][:3] == ("-", "Namespace", "-") and "lr=0.5" in rows["args"][3]
    assert "weights_only=False" in r.stderr
    assert os.path.exists(tripwire)  # the trust decision is real: the pickle ran


def test_cli_inspect_damaged_file_exit_1(snap_env):
    """Fault: the file of the inspected step is truncated. Right behaviour: ``inspect`` says it is
    damaged (size against the manifest), points to ``verify``, and exits 1 instead of a traceback."""
    d = snap_env.ckpt_dir
    save_steps(d, {1: small_state(1)})
    with open(rank_file(d, 1), "r+b") as f:
        f.truncate(10)
    r = cli("inspect", d, "1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "damaged:" in r.stdout and "is 10 bytes, the manifest says" in r.stdout
    assert "snapckpt verify" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------- packaging
def test_cli_entry_points_and_no_framework_import(snap_env):
    """The ``snapckpt`` console script runs the CLI (``python -m snapckpt`` is what every other test
    uses); running every command imports no training framework (the CLI needs the core alone)."""
    d = snap_env.ckpt_dir
    save_steps(d, {1: small_state(1)})
    script = shutil.which("snapckpt", path=os.path.dirname(sys.executable))
    assert script, "the snapckpt console script is not installed next to this python"
    r = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(c in r.stdout for c in ("ls", "verify", "inspect"))
    frameworks = ("deepspeed", "megatron", "transformers", "accelerate", "safetensors")
    code = ("import sys\nfrom snapckpt.cli import main\n"
            f"codes = [main(['ls', {d!r}]), main(['verify', {d!r}]), main(['inspect', {d!r}, '1'])]\n"
            f"print('CODES', codes)\nprint('LOADED', [m for m in sys.modules if m.split('.')[0] in {frameworks!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "CODES [0, 0, 0]" in r.stdout, r.stdout + r.stderr
    assert "LOADED []" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------ ps, stop
PS_WORKER = r"""
import sys
import torch
from snapckpt import Checkpointer, StorageType
ck = Checkpointer(sys.argv[1], persister_idle_timeout_secs=600, commit_timeout_secs=10, request_timeout_secs=10,
                  coordination_timeout_secs=10)
ck.save({"w": torch.arange(1000, dtype=torch.float32), "step": 1}, 1).wait(timeout=30)
ck.save({"w": torch.arange(1000, dtype=torch.float32) * 2, "step": 2}, 2, StorageType.MEMORY).wait(timeout=30)
print("READY", flush=True)
sys.stdin.readline()
"""


def test_cli_ps_and_stop_flush_the_memory_snapshot_and_end_the_persister(snap_env, capsys):
    """An operator's view of a running job: a training process (a real Checkpointer in a subprocess)
    committed step 1 to disk, holds step 2 in memory only, and stays connected (hung, from the operator's
    side). Right behaviour: ``ps`` lists its persister (pid, directory, memory held, steps held, ranks
    connected); a request with a wrong token is refused; ``stop DIR`` writes step 2, which is newer than
    disk, commits it, and the persister exits although the rank is still connected; ``ps`` then lists
    nothing, and a new Checkpointer loads step 2 from disk."""
    import socket

    from snapckpt.persister import protocol as P

    d = snap_env.ckpt_dir
    worker = subprocess.Popen([sys.executable, "-c", PS_WORKER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdout.readline().strip() == "READY"
        (persister,) = snap_env.persisters()

        r = cli("ps", "--json")
        assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert doc["runtime_root"] == snap_env.env["SNAPCKPT_RUNTIME_DIR"]
        (p,) = doc["persisters"]
        assert p["pid"] == persister.pid and p["error"] is None and not p["stopping"]
        (run,) = p["runs"]
        assert os.path.realpath(run["checkpoint_dir"]) == os.path.realpath(d)
        assert run["connected_ranks"] == [0] and run["local_ranks"] == [0] and run["world_size"] == 1
        assert 2 in p["steps_held"] and p["memory_bytes"] >= 2 * 4000, p
        assert p["memory_bytes"] == sum(s["nbytes"] for s in p["slots"])
        assert 0 <= p["age_secs"] < 600
        assert main(["ps"]) == 0  # in this process: one torch import less
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == ["PID", "JOB", "AGE", "MEMORY", "STEPS", "RANKS", "DIR"]
        assert row.split()[:2] == [str(persister.pid), p["job"]] and row.endswith(run["checkpoint_dir"])
        assert human_bytes(p["memory_bytes"]) in row and " 1/1 " in row

        # the operator requests are authenticated like a rank's hello
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(os.path.join(p["runtime_dir"], "persister.sock"))
        s.sendall(P.encode({"op": "stop", "token": "0" * 32, "job": p["job"]}))
        reply = P.decode(s.makefile("rb").readline())
        s.close()
        assert not reply["ok"] and "authentication failed" in reply["error"]["message"]
        assert persister.is_running()

        r = cli("stop", d, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        (stopped,) = doc["stopped"]
        assert stopped["pid"] == persister.pid and stopped["exited"] and stopped["error"] is None
        assert [(f["step"], f["committed"]) for f in stopped["flushed"]] == [(2, True)]
        assert not snap_env.persisters()
        assert worker.poll() is None  # the training process is still there: only the persister stopped
    finally:
        worker.kill()
        worker.wait(timeout=30)
    assert main(["ls", d, "--json"]) == 0
    committed = {c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"] if c["state"] == "committed"}
    assert committed == {1, 2}
    assert main(["ps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["persisters"] == []
    with Checkpointer(d, **OPTS) as ck:
        out = ck.load()
        assert ck.last_load.step == 2 and torch.equal(out["w"], torch.arange(1000, dtype=torch.float32) * 2)


def test_cli_stop_without_a_persister_version_and_empty_ps(snap_env, capsys):
    """``stop`` of a directory no persister serves exits 3 naming the directory; ``ps`` with none running
    says so and exits 0; ``--version`` prints the installed version; a bad ``--timeout`` is a usage error."""
    import snapckpt

    d = snap_env.ckpt_dir
    os.makedirs(d)
    r = cli("stop", d)
    assert r.returncode == 3 and f"no persister of this user serves {d}" in r.stderr, r.stdout + r.stderr
    r = cli("stop", d, "--json")  # a script parsing stdout gets an object here too
    assert r.returncode == 3 and json.loads(r.stdout) == {"dir": d, "stopped": []}, r.stdout + r.stderr
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"snapckpt {snapckpt.__version__}", r.stdout + r.stderr
    assert main(["ps"]) == 0
    out = capsys.readouterr().out
    assert "no snapckpt persister of this user runs here" in out
    assert f"snapckpt-{os.getuid()}" in out, out  # where it looked, as the docs name it (not only the root)
    try:
        main(["stop", d, "--timeout", "0"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--timeout 0 was accepted")
    assert "--timeout must be positive" in capsys.readouterr().err

