"""``snapckpt ps`` and ``snapckpt stop DIR``: this user's persisters on this host, and stopping one.

``ps`` reads the runtime directories the persisters keep (``<runtime root>/snapckpt-<uid>/<job>/``, the
root being ``--runtime-dir``, else ``$SNAPCKPT_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR`` or ``/tmp``: the same
rule as the ``Checkpointer``'s ``runtime_dir`` option) and asks each live persister for its state
(the ``info`` request of :mod:`snapckpt.persister.control`, authenticated with the job's token). One
row per persister: pid, job key, age, shared memory held, steps held, ranks connected, checkpoint
directory. A persister that does not answer is listed with its pid and the error.

``--json``: ``{"runtime_root": str, "persisters": [{"pid", "job", "runtime_dir", "age_secs" (float or
null), "memory_bytes" (int or null: the shared memory of its slots), "steps_held" ([int]), "runs":
[{"run_id", "checkpoint_dir", "world_size", "local_ranks", "connected_ranks", "crashed"}], "slots":
[{"rank", "slot", "state", "step", "nbytes", "run_id", "held", "persistable"}], "pending_tasks" (int),
"stopping" (bool), "error" (str or null)}]}``.

``stop DIR`` finds the persister(s) serving checkpoint directory ``DIR`` and sends ``stop``: each writes
the newest snapshot of each of its runs that every local rank holds and that is newer than the newest
committed step of ``DIR`` (the crash flush, case B8), waits for saves already in flight, and exits;
training processes still connected lose it (their next call raises ``PersisterDiedError``). ``stop``
waits until each has exited (``--timeout``, default 600 s) and then checks that every flushed step is
committed in ``DIR``. ``--json`` prints ``{"dir", "stopped": [{"pid", "job", "flushed" ([{"checkpoint_dir",
"step", "committed"}]), "exited" (bool)}]}``.

Exit codes: ``ps``: 0 (also when no persister runs). ``stop``: 0 every persister serving DIR exited and
each step it flushed is committed; 1 one did not exit within ``--timeout``, refused or did not answer,
or a flushed step is not committed (see its ``persister.log``); 2 usage error; 3 no persister of this
user serves DIR.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

from snapckpt._internal import env as _env
from snapckpt.cli.common import human_bytes, print_json, table
from snapckpt.errors import PersisterError
from snapckpt.ondisk.manifest import list_committed
from snapckpt.persister.control import PersisterEntry, find_persisters, pid_alive, request
from snapckpt.storage.factory import open_storage
from snapckpt.storage.urls import is_remote_url

__all__ = ["cmd_ps", "cmd_stop", "EXIT_NO_PERSISTER"]

EXIT_NO_PERSISTER = 3


def _age(secs: float) -> str:
    secs = int(secs)
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    return f"{secs // 3600}h{(secs % 3600) // 60:02d}m"


def _describe(entry: PersisterEntry) -> Dict[str, Any]:
    """One persister as ``ps --json`` shows it (``error`` set when it did not answer)."""
    rec: Dict[str, Any] = {"pid": entry.pid, "job": entry.job, "runtime_dir": entry.runtime_dir, "age_secs": None,
                           "memory_bytes": None, "steps_held": [], "runs": [], "slots": [], "pending_tasks": 0,
                           "stopping": False, "error": None}
    try:
        info = request(entry, "info", timeout_secs=10.0)
    except PersisterError as e:
        rec["error"] = str(e)
        return rec
    rec.update({k: info[k] for k in ("memory_bytes", "steps_held", "runs", "slots", "pending_tasks", "stopping")})
    rec["age_secs"] = max(0.0, time.time() - float(info["started_at"]))
    return rec


def _root(args: argparse.Namespace) -> str:
    return args.runtime_dir or _env.runtime_dir()


def cmd_ps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """List this user's persisters (see the module docstring); returns 0."""
    root = _root(args)
    recs = [_describe(e) for e in find_persisters(root)]
    if getattr(args, "json", False):
        print_json({"runtime_root": root, "persisters": recs})
        return 0
    if not recs:
        print(f"no snapckpt persister of this user runs here (looked in {os.path.join(root, f'snapckpt-{os.getuid()}')})")
        return 0
    rows = [["PID", "JOB", "AGE", "MEMORY", "STEPS", "RANKS", "DIR"]]
    for r in recs:
        if r["error"]:
            rows.append([str(r["pid"]), r["job"], "-", "-", "-", "-", f"(not answering: {r['error']})"])
            continue
        dirs = sorted({run["checkpoint_dir"] for run in r["runs"]}) or ["-"]
        # a restarted job is a new run of the same ranks (the crashed one's snapshots stay): count ranks once
        connected = len({x for run in r["runs"] for x in run["connected_ranks"]})
        local = len({x for run in r["runs"] for x in run["local_ranks"]})
        steps = ",".join(map(str, r["steps_held"])) or "-"
        rows.append([str(r["pid"]), r["job"], _age(r["age_secs"]), human_bytes(r["memory_bytes"]), steps,
                     f"{connected}/{local}" + (" stopping" if r["stopping"] else ""), ", ".join(dirs)])
    print(table(rows))
    return 0


def _serves(rec: Dict[str, Any], d: str) -> bool:
    return any(_where(run["checkpoint_dir"]) == d for run in rec["runs"])


def _committed_steps(d: str) -> set:
    """The steps committed in the checkpoint location ``d`` (a directory, or a remote-only URL: the store's
    prefixes with a manifest; a store that cannot be read counts as none committed)."""
    if is_remote_url(d):
        try:
            from snapckpt.storage.remote import RemoteStore
            return {c.step for c in RemoteStore(d, role="checkpoint_dir").list_committed()}
        except Exception:
            return set()
    return {c.step for c in list_committed(open_storage(), d)}


def _where(d: str) -> str:
    """A checkpoint location as compared: a directory's real path, a remote-only URL without trailing slashes."""
    return d.strip().rstrip("/") if is_remote_url(d.strip()) else os.path.realpath(d)


def cmd_stop(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Flush and stop the persister(s) serving ``args.dir`` (see the module docstring for exit codes)."""
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    d = _where(args.dir)
    as_json = getattr(args, "json", False)
    targets = [(e, rec) for e in find_persisters(_root(args)) for rec in [_describe(e)] if _serves(rec, d)]
    if not targets:
        print(f"snapckpt: no persister of this user serves {args.dir} (see `snapckpt ps`)", file=sys.stderr)
        if as_json:  # a script parsing stdout gets an object in every case
            print_json({"dir": args.dir, "stopped": []})
        return EXIT_NO_PERSISTER
    failed = False
    stopped: List[Dict[str, Any]] = []
    for entry, _ in targets:
        out: Dict[str, Any] = {"pid": entry.pid, "job": entry.job, "flushed": [], "exited": False, "error": None}
        stopped.append(out)
        try:
            reply = request(entry, "stop", timeout_secs=30.0)
        except PersisterError as e:
            out["error"] = str(e)
            failed = True
            continue
        out["flushed"] = [{"checkpoint_dir": f["checkpoint_dir"], "step": f["step"], "committed": False}
                          for f in reply["flushing"]]
        if not as_json:
            what = ", ".join(f"step {f['step']}" for f in out["flushed"]) or "nothing newer than disk"
            print(f"persister pid {entry.pid} (job {entry.job}): flushing {what}; "
                  f"{reply['connected_ranks']} rank(s) still connected")
    deadline = time.monotonic() + args.timeout
    for (entry, _), out in zip(targets, stopped):
        if out["error"]:
            continue
        while pid_alive(entry.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["exited"] = not pid_alive(entry.pid)
        if not out["exited"]:
            out["error"] = f"still running after {args.timeout:g} s (log: {entry.runtime_dir}/persister.log)"
            failed = True
            continue
        for f in out["flushed"]:
            f["committed"] = f["step"] in _committed_steps(f["checkpoint_dir"])
            if not f["committed"]:
                out["error"] = (f"step {f['step']} was not committed in {f['checkpoint_dir']} (see "
                                f"{entry.runtime_dir}/persister.log)")
                failed = True
    if as_json:
        print_json({"dir": args.dir, "stopped": stopped})
    else:
        for out in stopped:
            if out["error"]:
                print(f"persister pid {out['pid']} (job {out['job']}): {out['error']}")
            else:
                done = ", ".join(f"step {f['step']} committed" for f in out["flushed"]) or "nothing flushed"
                print(f"persister pid {out['pid']} (job {out['job']}) exited: {done}")
    return 1 if failed else 0
