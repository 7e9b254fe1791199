"""``snapckpt`` command line: the argument parser, the entry point and its exit codes.

``main`` parses the arguments and runs one subcommand, each in its own module: ``ls``
(:mod:`snapckpt.cli.ls`), ``verify`` (:mod:`snapckpt.cli.verify`), ``inspect``
(:mod:`snapckpt.cli.inspect`), ``ps`` and ``stop`` (:mod:`snapckpt.cli.ps`). Exit codes: 0 success, 1
damage found, a file could not be read, or (``stop``) a persister did not stop cleanly, 2 usage error
(``argparse``'s own code; the subcommands' data errors, a missing directory or step, through
:func:`snapckpt.cli.common.fail`, without the usage line), 3 (``stop``) no
persister serves the directory, 130 interrupted. A closed stdout (``snapckpt ls DIR | head``) ends
quietly with 0. ``--version`` prints ``snapckpt VERSION`` (the installed distribution's version).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from snapckpt.cli.inspect import cmd_inspect
from snapckpt.cli.ls import cmd_ls
from snapckpt.cli.ps import cmd_ps, cmd_stop
from snapckpt.cli.verify import cmd_verify

__all__ = ["build_parser", "main", "version"]


def version() -> str:
    """The installed snapckpt's version (its distribution metadata; ``snapckpt.__version__`` when run from
    a source tree that is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("snapckpt")
    except metadata.PackageNotFoundError:
        from snapckpt import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``snapckpt`` (subcommands ``ls``, ``verify``, ``inspect``, ``ps``, ``stop``)."""
    p = argparse.ArgumentParser(
        prog="snapckpt", description="Inspect and verify snapckpt checkpoint directories; list and stop this "
                                     "user's persisters.",
        epilog="exit codes: 0 ok, 1 damage found, a file could not be read or a persister did not stop "
               "cleanly, 2 usage error, 3 (stop) no persister serves DIR")
    p.add_argument("--version", action="version", version=f"snapckpt {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                          help="show progress bars on stderr (default: only when stderr is a terminal)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true",
                         help="print one JSON object on stdout instead of text (keys: docs/operations.md)")
    runtime = argparse.ArgumentParser(add_help=False)
    runtime.add_argument("--runtime-dir", default=None,
                         help="the runtime directory the jobs were given (runtime_dir=; default "
                              "$SNAPCKPT_RUNTIME_DIR, $XDG_RUNTIME_DIR or /tmp)")

    ls = sub.add_parser("ls", parents=[as_json], help="list the checkpoints in DIR and their state",
                        description="One row per checkpoint directory in DIR: step, name, state (committed, "
                                    "incomplete, damaged), world size, total bytes, and the tracker file "
                                    "(latest) that names it.")
    ls.add_argument("dir", metavar="DIR", help="checkpoint directory (the one given to the Checkpointer)")
    ls.set_defaults(func=cmd_ls, parser=ls, progress=None)

    verify = sub.add_parser("verify", parents=[progress, as_json], help="re-checksum committed checkpoints",
                            description="Re-read every file of every committed checkpoint in DIR (or only "
                                        "STEP) and compare its size and checksum with the manifest. Exit 0 "
                                        "when all are intact, 1 on any damage, 2 on a usage error.")
    verify.add_argument("dir", metavar="DIR", help="checkpoint directory")
    verify.add_argument("step", metavar="STEP", type=int, nargs="?", help="verify only this step")
    verify.set_defaults(func=cmd_verify, parser=verify)

    insp = sub.add_parser("inspect", parents=[progress, as_json], help="list the keys, shapes and dtypes of a step",
                          description="For every rank file of committed step STEP, list its flattened keys, "
                                      "shapes, dtypes and bytes. Loads with torch.load(weights_only=True).")
    insp.add_argument("dir", metavar="DIR", help="checkpoint directory")
    insp.add_argument("step", metavar="STEP", type=int, help="the step to inspect")
    insp.add_argument("--rank", type=int, default=None, help="only this rank's files")
    insp.add_argument("--trust", action="store_true",
                      help="load with weights_only=False: runs the files' pickles, which can execute "
                           "arbitrary code; only for checkpoints you trust")
    insp.set_defaults(func=cmd_inspect, parser=insp)

    ps = sub.add_parser("ps", parents=[as_json, runtime], help="list this user's persisters on this host",
                        description="One row per snapckpt persister of this user on this host: pid, job, age, "
                                    "shared memory held, steps held, ranks connected, checkpoint directory.")
    ps.set_defaults(func=cmd_ps, parser=ps, progress=None)

    stop = sub.add_parser("stop", parents=[as_json, runtime], help="flush and stop the persister of DIR",
                          description="Ask the persister serving checkpoint directory DIR to write and commit "
                                      "the newest snapshot it holds that is newer than disk, then exit; wait "
                                      "for it. Exit 0 when it exited and the flushed step is committed, 1 when "
                                      "not, 3 when no persister of this user serves DIR.")
    stop.add_argument("dir", metavar="DIR", help="checkpoint directory (the one given to the Checkpointer)")
    stop.add_argument("--timeout", type=float, default=600.0,
                      help="seconds to wait for the flush and the exit (default 600)")
    stop.set_defaults(func=cmd_stop, parser=stop, progress=None)
    return p


def _json_usage_errors(sub: argparse.ArgumentParser) -> None:
    """With ``--json``, a subcommand's usage error (exit 2: a missing directory, an unknown step) also
    prints ``{"error": message, "exit": 2}`` on stdout, so that a script parsing stdout always gets an
    object; the message still goes to stderr as argparse prints it."""
    from snapckpt.cli.common import print_json

    def error(message: str) -> None:
        print_json({"error": message, "exit": 2})
        sub.print_usage(sys.stderr)
        sys.stderr.write(f"{sub.prog}: error: {message}\n")
        raise SystemExit(2)

    sub.error = error  # type: ignore[method-assign]
    sub.json_errors = True  # type: ignore[attr-defined]  # read by common.fail


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``snapckpt`` console script and ``python -m snapckpt``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "json", False):
        _json_usage_errors(args.parser)
    try:
        return args.func(args, args.parser)
    except BrokenPipeError:  # `snapckpt ls DIR | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
