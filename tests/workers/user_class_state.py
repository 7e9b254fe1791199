"""Worker for cases E5/E6: a training script whose state holds objects of a class defined in the script
itself (``__main__.TrainingArguments``, which no other process can import) and an ``argparse.Namespace``.

Usage: ``user_class_state.py CHECKPOINT_DIR`` (one rank, gloo). Three jobs on one checkpoint directory,
each its own ``job_id`` and so its own persister (no memory tier shared between them):

- A (``weights_only=True``, the default): DISK save of step 5, waited for (the persister must write and
  commit it without importing ``__main__``), then ``load()`` from memory must refuse with
  ``UnsafeCheckpointError``;
- B (``weights_only=False``): ``load()`` from disk, then a MEMORY save of step 6 and ``load()`` from memory;
  both must give back the user objects;
- C (``weights_only=True``): ``load()`` from disk must refuse with ``UnsafeCheckpointError``.

Finally stock ``torch.load`` reads the file: ``weights_only=True`` refuses, ``weights_only=False`` loads.
Prints one ``RESULT {json}`` line.
"""
import argparse
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist


class TrainingArguments:
    """A user's config class, as a training script defines it (lives in ``__main__``)."""

    def __init__(self, lr: float, run_name: str) -> None:
        self.lr = lr
        self.run_name = run_name

    def __eq__(self, other) -> bool:
        return type(other) is TrainingArguments and vars(self) == vars(other)


OPTS = dict(persister_idle_timeout_secs=2, commit_timeout_secs=30, request_timeout_secs=20,
            coordination_timeout_secs=20, persister_startup_timeout_secs=60)


def _try_load(ck):
    """``(outcome, tier, object)``: outcome is ``"loaded"`` or the exception's type name."""
    try:
        out = ck.load()
        return "loaded", ck.last_load.tier.value, out
    except Exception as e:  # the type name is the result under test
        return type(e).__name__, None, str(e)


def _same_user_state(out, expected) -> bool:
    return (out["args"] == expected["args"] and isinstance(out["ns"], argparse.Namespace)
            and vars(out["ns"]) == vars(expected["ns"])
            and all(torch.equal(out["model"][k], v) for k, v in expected["model"].items()))


def main() -> None:
    ckpt_dir = sys.argv[1]
    dist.init_process_group("gloo")
    from snapckpt import Checkpointer, StorageType

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = {"model": model.state_dict(), "args": TrainingArguments(3e-4, "run-a"),
             "ns": argparse.Namespace(seed=7, tag="exp"), "step": 5}
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "args": state["args"],
                "ns": argparse.Namespace(seed=7, tag="exp")}
    res = {}
    with Checkpointer(ckpt_dir, job_id="writer", **OPTS) as ck:
        h = ck.save(state, 5, StorageType.DISK)
        try:
            h.wait()
            res["A_commit"] = "committed"
        except Exception as e:
            res["A_commit"] = f"{type(e).__name__}: {e}"
        res["A_memory_safe"], res["A_memory_safe_tier"], msg = _try_load(ck)
        res["A_memory_safe_msg"] = msg if isinstance(msg, str) else ""
    with Checkpointer(ckpt_dir, job_id="trusting-reader", weights_only=False, **OPTS) as ck:
        outcome, tier, out = _try_load(ck)
        res["B_disk_trusted"], res["B_disk_trusted_tier"] = outcome, tier
        res["B_disk_trusted_equal"] = outcome == "loaded" and _same_user_state(out, expected)
        ck.save(state, 6, StorageType.MEMORY)
        outcome, tier, out = _try_load(ck)
        res["B_memory_trusted"], res["B_memory_trusted_tier"] = outcome, tier
        res["B_memory_trusted_equal"] = outcome == "loaded" and _same_user_state(out, expected)
    with Checkpointer(ckpt_dir, job_id="careful-reader", **OPTS) as ck:
        res["C_disk_safe"], res["C_disk_safe_tier"], msg = _try_load(ck)
        res["C_disk_safe_msg"] = msg if isinstance(msg, str) else ""
    path = os.path.join(ckpt_dir, "step_00000005", "rank_00000.pt")
    try:
        torch.load(path, weights_only=True)
        res["stock_weights_only"] = "loaded"
    except pickle.UnpicklingError:
        res["stock_weights_only"] = "refused"
    res["stock_trusted_equal"] = _same_user_state(torch.load(path, weights_only=False), expected)
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
