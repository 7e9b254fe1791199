"""The ``snapckpt`` command line: look at a checkpoint directory without a training job.

Commands (``DIR`` is the checkpoint directory given to the ``Checkpointer``, the one holding
``step_00000100/`` and ``latest``)::

    snapckpt ls DIR                     one row per checkpoint directory: step, name, state, world size,
                                        total bytes, and which one a tracker file names
    snapckpt verify DIR [STEP]          re-checksum every file of every committed checkpoint (or of STEP)
                                        against its manifest; OK/DAMAGED per checkpoint, naming each bad
                                        file and why
    snapckpt inspect DIR STEP [--trust] every rank file of STEP: flattened keys (``model.layer.weight``),
              [--rank R]                shapes, dtypes, bytes of each ``torch.save`` archive, and the
                                        tensors of each ``.safetensors`` file (from its header); other
                                        formats (DCP ``.distcp`` shards, JSON) are listed, not opened
    snapckpt ps                         this user's persisters on this host: pid, job, age, shared memory
                                        held, steps held, ranks connected, checkpoint directory
    snapckpt stop DIR [--timeout S]     flush what the persister serving DIR holds newer than disk, then
                                        stop it (:mod:`snapckpt.cli.ps`)
    snapckpt --version                  the installed version

``ls``, ``verify``, ``inspect``, ``ps`` and ``stop`` take ``--json`` (one JSON object on stdout; the keys
are in each command's module docstring and in docs/operations.md). Text output shows sizes for people
(``1.2 GiB``).

States shown by ``ls``:

- ``committed``: the manifest parses and every file it lists has the recorded size (a loader picks it);
- ``incomplete``: a hidden in-flight directory ``.NAME.partial-RUN`` (a save in progress, or one that
  crashed); loaders never look at it, the next persister of the job removes it;
- ``damaged``: a ``.snapckpt`` sidecar (or a ``step_NNNNNNNN`` directory) whose manifest is missing,
  unparseable or lacks fields, or a file that is missing or of the wrong size (loaders skip it, with a
  warning). ``verify`` counts each as damaged, and also catches flipped bytes.

Other directories without a ``.snapckpt`` sidecar are not snapckpt's and are only counted.

Exit codes: 0 success (``verify``: every checkpoint intact; ``stop``: the persister exited and what it
flushed is committed); 1 ``stop`` did not end cleanly, ``verify`` found damage, or ``inspect``
could not read a file (damaged, or refused by ``weights_only=True``: the usual case for DeepSpeed, Trainer
and Megatron checkpoints, which pickle config objects; ``--trust`` if you trust them); 2 usage error (no
such DIR, DIR is a file, no committed checkpoint of STEP, no files of rank R, bad arguments); 3 ``stop``
found no persister of this user serving DIR.

``inspect`` loads with ``torch.load(..., weights_only=True, mmap=True)``: tensor data is not read, and
no pickled code runs. A file holding other Python objects (an ``argparse.Namespace``, a config class) is
refused; ``--trust`` loads it with ``weights_only=False``, which runs its pickle and can execute
arbitrary code: pass it only for checkpoints you trust.

Progress bars (``tqdm`` when installed: ``pip install '.[cli]'`` in a snapckpt clone) go to stderr, shown when stderr
is a terminal or with ``--progress``; ``--no-progress`` turns them off. The CLI needs the core only; it
never imports a training framework.

Modules: :mod:`~snapckpt.cli.main` (parser, entry point, exit codes), :mod:`~snapckpt.cli.ls`,
:mod:`~snapckpt.cli.verify`, :mod:`~snapckpt.cli.inspect`, :mod:`~snapckpt.cli.ps` (one per subcommand) and
:mod:`~snapckpt.cli.common` (helpers they share). The console script is ``snapckpt.cli:main``.
"""
from snapckpt.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
