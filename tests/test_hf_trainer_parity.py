"""The Trainer with ``SnapckptCallback`` behaves as without it (issue 17, items 3-4): ``push_to_hub``,
``save_strategy="best"``, a resume with another batch size, frozen parameters (memory and disk tier).
In-process Trainers on the tiny GPT-2 of ``tests/workers/hf_worker.py`` (CPU), each compared with the stock
Trainer on the same arguments."""
import dataclasses
import http.server
import json
import logging
import os
import shutil
import stat
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from _harness import REPO, assert_equal_state, wait_until

sys.path.insert(0, os.path.join(REPO, "tests", "workers"))


class _Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the Hugging Face Hub (a cloud account: the one thing not run for real): answers
    ``create_repo`` (``POST /api/repos/create``) and records every request as ``(method, path)``."""

    seen: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).seen.append(("POST", self.path))
        if self.path != "/api/repos/create":
            self.send_error(404)
            return
        payload = json.loads(body)
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        data = json.dumps({"url": f"{host}/{payload['organization']}/{payload['name']}"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        type(self).seen.append(("GET", self.path))
        self.send_error(404)

    do_PUT = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub on a free port; transformers' shared ``HfApi`` points at it for the test."""
    import transformers.utils.hub as th
    from huggingface_hub import HfApi

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hub.seen = []
    monkeypatch.setattr(th, "_hf_api", HfApi(endpoint=f"http://127.0.0.1:{server.server_address[1]}",
                                              library_name="transformers"))
    yield _Hub
    server.shutdown()
    server.server_close()


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, seed=7,
                report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def test_push_to_hub_checkpoint_pushes_are_refused_never_dropped(snap_env, hub):
    """``push_to_hub=True`` with a ``hub_strategy`` that pushes checkpoints (the default ``"every_save"``,
    ``"checkpoint"``, ``"all_checkpoints"``): the Trainer pushes from inside the ``_save_checkpoint`` the
    callback replaces, so those pushes were dropped without a word. Right: Trainer construction raises
    ``ValueError`` naming ``hub_strategy='end'``. With ``save_strategy="no"`` (no checkpoint, no push) the
    callback is accepted. With ``hub_strategy="end"`` (the Trainer pushes nothing during training either)
    the run trains and commits its checkpoint, and the Hub sees the Trainer's ``create_repo`` and nothing
    else, as without the callback."""
    from transformers import Trainer

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    for strategy in ("every_save", "checkpoint", "all_checkpoints"):
        args = _args(snap_env.ckpt_dir, max_steps=2, save_steps=2, push_to_hub=True, hub_model_id="me/run",
                     hub_strategy=strategy)
        with pytest.raises(ValueError, match=f"hub_strategy='{strategy}'.*hub_strategy='end'"):
            Trainer(model=build_model(), args=args, train_dataset=Tokens(n=8),
                    callbacks=[SnapckptCallback(persister_idle_timeout_secs=2)])
    assert hub.seen == [("POST", "/api/repos/create")] * 3
    # save_strategy="no": the Trainer saves (and pushes) no checkpoint, so nothing is dropped: accepted
    cb = SnapckptCallback(memory_interval_steps=1, persister_idle_timeout_secs=2)
    Trainer(model=build_model(), args=_args(snap_env.ckpt_dir, max_steps=2, save_strategy="no", push_to_hub=True,
                                            hub_model_id="me/run"), train_dataset=Tokens(n=8), callbacks=[cb])
    cb.close()
    assert hub.seen == [("POST", "/api/repos/create")] * 4

    hub.seen.clear()

    args = _args(snap_env.ckpt_dir, max_steps=2, save_steps=2, push_to_hub=True, hub_model_id="me/run",
                 hub_strategy="end")
    trainer = Trainer(model=build_model(), args=args, train_dataset=Tokens(n=8),
                      callbacks=[SnapckptCallback(persister_idle_timeout_secs=2)])
    trainer.train()
    assert os.path.isfile(os.path.join(snap_env.ckpt_dir, "checkpoint-2", ".snapckpt", "manifest.json"))
    assert hub.seen == [("POST", "/api/repos/create")]


def _timeless(path, out):
    """trainer_state.json without wall-clock values, the run's output_dir as "OUT"."""
    with open(path) as f:
        state = json.loads(f.read().replace(out, "OUT"))
    state["log_history"] = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
                            for e in state["log_history"]]
    return state


def test_save_strategy_best_matches_the_trainers_own_save(snap_env, monkeypatch):
    """``save_strategy="best"``: the Trainer saves only after an evaluation that found a new best
    ``metric_for_best_model``, deciding after ``on_evaluate`` with no callback event before its save (so it
    was refused before). Right: the callback foresees that decision in ``on_evaluate`` and takes the save.
    Against the stock Trainer on the same arguments (evaluation every step on ``eval_loss``, so that some
    evaluations are new bests and some not; ``save_total_limit=2``; ``load_best_model_at_end``; an
    ``EarlyStoppingCallback`` with patience 3, which reads ``state.best_metric`` in its ``on_evaluate``):
    the same ``on_save`` steps fire (each once its folder is complete), the same folders are kept, each
    with the same files and ``trainer_state.json`` (``best_metric``, ``best_global_step``,
    ``best_model_checkpoint``, logs), training stops at the same step and the same best model is loaded at
    the end. A callback handling ``on_evaluate`` listed after SnapckptCallback is refused at Trainer
    construction, naming it and the fix.

    The first save's commit is held (fault point, before its rename) until the third save's folder is
    committed, as a loaded host did once: the callback then learns of the first commit when a newer best is
    on disk. Before, its retention (``save_total_limit=2``) ran first and deleted ``checkpoint-1``, and
    ``on_save`` of step 1 raised in the event listener, which only logged it: step 1's ``on_save`` was lost."""
    from transformers import EarlyStoppingCallback, Trainer, TrainerCallback

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    class Saves(TrainerCallback):
        def __init__(self):
            self.steps = []
            self.folders = {}  # step -> the checkpoint folders there at its on_save

        def on_save(self, args, state, control, **kwargs):
            self.folders[state.global_step] = {n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")}
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with open(os.path.join(folder, "trainer_state.json")) as f:
                self.steps.append((state.global_step, json.load(f)["best_global_step"]))

    def args(out):
        return _args(out, max_steps=8, save_strategy="best", eval_strategy="steps", eval_steps=1,
                     metric_for_best_model="eval_loss", greater_is_better=False, save_total_limit=2,
                     load_best_model_at_end=True)

    seen = {}

    def run(out, snap):
        saves = seen[snap] = Saves()
        cbs = [saves, EarlyStoppingCallback(early_stopping_patience=3)]
        cbs += [SnapckptCallback(persister_idle_timeout_secs=2)] if snap else []
        trainer = Trainer(model=build_model(), args=args(out), train_dataset=Tokens(n=40),
                          eval_dataset=Tokens(n=8), callbacks=cbs)
        trainer.train()
        folders = {n: sorted(f for f in os.listdir(os.path.join(out, n)) if f != ".snapckpt")
                   for n in os.listdir(out)}
        states = {n: _timeless(os.path.join(out, n, "trainer_state.json"), out) for n in folders}
        wte = trainer.model.transformer.wte.weight.detach().flatten()[:8].tolist()
        return (saves.steps, folders, states, trainer.state.global_step,
                trainer.state.best_model_checkpoint.replace(out, "OUT"), trainer.state.best_metric, wte)

    stock_out = os.path.join(snap_env.tmp, "stock")
    stock = run(stock_out, snap=False)
    evals = sum("eval_loss" in e for e in stock[2][max(stock[2], key=lambda n: int(n.split("-")[1]))]
                ["log_history"])
    # the scenario: some evaluations saved, some not; rotation removed a folder; early stopping stopped
    assert 2 < len(stock[0]) < evals and len(stock[1]) < len(stock[0]) and stock[3] < 8, stock[:4]
    first, third = stock[0][0][0], f"checkpoint-{stock[0][2][0]}"
    monkeypatch.setenv("SNAPCKPT_FAULT_POINT", f"commit.before_rename:step={first}:action=wait:secs=60:"
                                               f"path={os.path.join(snap_env.ckpt_dir, third)}")
    mine = run(snap_env.ckpt_dir, snap=True)
    for name in mine[1]:  # written by snapckpt, not by the Trainer's own save
        assert os.path.isfile(os.path.join(snap_env.ckpt_dir, name, ".snapckpt", "manifest.json")), name
    assert mine[0] == stock[0]  # on_save: same steps, each folder complete when it fires
    assert mine[1] == stock[1]  # same folders kept, same files in each
    assert mine[2] == stock[2]  # same trainer_state.json (best_metric, best_global_step, best_model_checkpoint)
    assert mine[3:] == stock[3:]  # stopped at the same step, same best model loaded at the end
    assert third in seen[True].folders[first], seen[True].folders  # the hold took effect

    with pytest.raises(ValueError, match="EarlyStoppingCallback comes after it: list SnapckptCallback last"):
        Trainer(model=build_model(), args=args(os.path.join(snap_env.tmp, "late")), train_dataset=Tokens(n=8),
                eval_dataset=Tokens(n=8),
                callbacks=[SnapckptCallback(), EarlyStoppingCallback(early_stopping_patience=3)])


def test_a_step_the_trainer_saved_itself_is_not_written_twice(snap_env, caplog):
    """A callback listed after SnapckptCallback sets ``control.should_save`` again at a step the callback
    took over (or the Trainer's best-model rule ever differs from the callback's foresight): the Trainer
    saves ``checkpoint-N`` itself and fires ``on_save``. Right: the callback drops its own save of that step
    with a warning, so the folder is the Trainer's alone (no snapckpt manifest), written once."""
    from transformers import Trainer, TrainerCallback

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    class SaveAgain(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step == 2

    args = _args(snap_env.ckpt_dir, max_steps=3, save_steps=2)
    trainer = Trainer(model=build_model(), args=args, train_dataset=Tokens(n=12),
                      callbacks=[SnapckptCallback(persister_idle_timeout_secs=2), SaveAgain()])
    trainer.train()
    two, three = (os.path.join(snap_env.ckpt_dir, f"checkpoint-{s}") for s in (2, 3))
    assert os.path.isfile(os.path.join(two, "model.safetensors"))
    assert not os.path.exists(os.path.join(two, ".snapckpt"))  # the Trainer's own folder, not written over
    assert os.path.isfile(os.path.join(three, ".snapckpt", "manifest.json"))  # the callback's save of step 3
    assert "checkpoint-2 was saved by the Trainer itself" in caplog.text


class _Crash(Exception):
    """Raised by a callback to end a training run as a crash would (no ``on_train_end``)."""


class _Warnings(logging.Handler):
    """The messages transformers logs at WARNING and above (its loggers do not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train(out, snap, *, resume=None, stop_at=None, crash_at=None, model=None, n=24, cb_kw=None, **kw):
    """One in-process Trainer run on ``Tokens(n)`` (``model`` built by ``build_model`` unless given).

    ``snap``: with ``SnapckptCallback(**cb_kw)``; ``stop_at``: training stops after that step
    (``should_training_stop``, a clean end); ``crash_at``: a callback listed after SnapckptCallback raises in
    the ``on_step_begin`` after that step (the pending snapshot of the step is taken first), and the callback
    is closed as after a crash. Returns what the Trainer did: ``log_history`` losses per step, its final
    ``state`` (output_dir as ``OUT``, no timings), the first token of every sample of every batch it
    collated (the data it saw), the warnings transformers logged, the final weights, and the callback."""
    from transformers import Trainer, TrainerCallback, default_data_collator
    from transformers.utils import logging as hf_logging

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    seen = []

    def collate(features):
        batch = default_data_collator(features)
        seen.append(batch["input_ids"][:, 0].tolist())
        return batch

    class Halt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == crash_at:
                raise _Crash(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    cb = SnapckptCallback(**{"persister_idle_timeout_secs": 2, **(cb_kw or {})}) if snap else None
    warned = _Warnings()
    hf_logging.warning_once.cache_clear()  # a warning_once of an earlier run in this process is logged again
    logging.getLogger("transformers").addHandler(warned)
    try:
        trainer = Trainer(model=model if model is not None else build_model(), args=_args(out, **kw),
                          train_dataset=Tokens(n=n), data_collator=collate,
                          callbacks=([cb] if snap else []) + [Halt()])
        try:
            trainer.train(resume_from_checkpoint=resume)
        except _Crash:
            if cb is not None:  # as a crashed rank leaves: the persister keeps the memory snapshots
                cb.close(clean=False)
    finally:
        logging.getLogger("transformers").removeHandler(warned)
    state = json.loads(json.dumps(dataclasses.asdict(trainer.state)).replace(out, "OUT"))
    state["log_history"] = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
                            for e in state["log_history"]]
    losses = {e["step"]: (repr(e["loss"]), repr(e["learning_rate"]), repr(e["grad_norm"]))
              for e in trainer.state.log_history if "loss" in e}
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return dict(losses=losses, state=state, seen=seen, warnings=[w.replace(out, "OUT") for w in warned.messages],
                weights=weights, callback=cb, trainer=trainer)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def _folder_diffs(mine, theirs, differing=()):
    """How the folder ``mine`` differs from the Trainer's ``theirs``: file set, each file's mode bits, bytes of
    safetensors and JSON files (``trainer_state.json`` parsed, with its output_dir and timings left out), the
    loaded contents of torch files. ``differing``: keys of ``trainer_state.json`` and ``training_args.bin``
    the two runs were given different values of (left out)."""
    names = sorted(f for f in os.listdir(theirs) if f != ".snapckpt")
    got = sorted(f for f in os.listdir(mine) if f != ".snapckpt")
    if got != names:
        return [f"files: {got} != {names}"]
    diffs = [] if _mode(mine) == _mode(theirs) else [f"folder mode {_mode(mine):o} != {_mode(theirs):o}"]
    for name in names:
        a, b = os.path.join(mine, name), os.path.join(theirs, name)
        if _mode(a) != _mode(b):
            diffs.append(f"{name}: mode {_mode(a):o} != {_mode(b):o}")
        if name == "trainer_state.json":
            x, y = (_timeless(p, os.path.dirname(os.path.dirname(p))) for p in (a, b))
            for d in (x, y):
                for k in differing:
                    d.pop(k, None)
            if x != y:
                diffs.append(f"{name}: {x} != {y}")
        elif name.endswith((".safetensors", ".json")):
            if open(a, "rb").read() != open(b, "rb").read():
                diffs.append(f"{name}: bytes differ")
        elif name == "training_args.bin":
            x, y = (torch.load(p, weights_only=False).to_dict() for p in (a, b))
            for d in (x, y):
                for k in ("output_dir", "logging_dir", *differing):
                    d.pop(k, None)
            if x != y:
                diffs.append(f"{name}: {x} != {y}")
        else:
            try:
                assert_equal_state(torch.load(a, weights_only=False), torch.load(b, weights_only=False), name,
                                   strict=True)
            except AssertionError as e:
                diffs.append(str(e))
    return diffs


def test_resume_with_a_changed_batch_size_matches_the_trainer(snap_env):
    """Train 5 steps at ``per_device_train_batch_size=4`` (saved at step 4), then resume from
    ``checkpoint-4`` with ``per_device_train_batch_size=1`` and ``gradient_accumulation_steps=2`` up to step
    14, with and without the callback. What the Trainer does on that resume is kept as is: it skips
    ``global_step * gradient_accumulation_steps`` batches of the new size (8 samples, not the 16 trained
    on), warns that the batch size differs from ``trainer_state.json``, keeps the checkpoint's
    ``train_batch_size`` in its state, and starts the next epoch after its own 12 steps per epoch. With the
    callback, the resumed run sees the same data, logs bitwise-equal losses, learning rates and gradient
    norms, ends in the same ``TrainerState``, logs the same transformers warnings and writes the same
    folders (file for file, mode bits included) as the stock Trainer."""
    first = dict(max_steps=14, save_steps=4, per_device_train_batch_size=4)
    then = dict(max_steps=14, save_steps=4, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    runs = {}
    for name, snap in (("stock", False), ("snap", True)):
        out = os.path.join(snap_env.tmp, name)
        runs[name] = (_train(out, snap, stop_at=5, **first), _train(out, snap, resume=True, **then))
    (stock_first, stock), (mine_first, mine) = runs["stock"], runs["snap"]
    # the scenario: 4 steps x 2 batches of 1 sample skipped: samples 8-15 of epoch 0, trained on before the
    # save, are trained on again; epoch 1 starts after step 12
    flat_first, flat = ([t for b in run["seen"] for t in b] for run in (stock_first, stock))
    assert flat[:16] == flat_first[8:24] and all(len(b) == 1 for b in stock["seen"]), (flat, flat_first)
    assert 1 < stock["state"]["epoch"] < 2 and stock["state"]["global_step"] == 14, stock["state"]
    assert sorted(stock["losses"]) == list(range(1, 15)) and stock["state"]["train_batch_size"] == 4
    assert any("per_device_train_batch_size: 1 (from args) != 4" in w for w in stock["warnings"]), stock["warnings"]
    assert mine_first["losses"] == stock_first["losses"]
    assert mine["seen"] == stock["seen"]
    assert mine["losses"] == stock["losses"]
    assert mine["state"] == stock["state"]
    assert mine["warnings"] == stock["warnings"]
    folders = sorted(os.listdir(os.path.join(snap_env.tmp, "stock")))
    assert folders == ["checkpoint-12", "checkpoint-14", "checkpoint-4", "checkpoint-8"], folders
    assert sorted(os.listdir(os.path.join(snap_env.tmp, "snap"))) == folders
    for name in folders:
        mine_dir = os.path.join(snap_env.tmp, "snap", name)
        assert os.path.isfile(os.path.join(mine_dir, ".snapckpt", "manifest.json")), name  # written by snapckpt
        assert _folder_diffs(mine_dir, os.path.join(snap_env.tmp, "stock", name)) == [], name


def _frozen_model():
    """The tiny GPT-2 with its embeddings (``wte``, tied to ``lm_head``; ``wpe``) and first block frozen."""
    from hf_worker import build_model

    model = build_model()
    for module in (model.transformer.wte, model.transformer.wpe, model.transformer.h[0]):
        module.requires_grad_(False)
    return model


def test_frozen_parameters_memory_and_disk_tier_match_the_trainer(snap_env):
    """A model with frozen parameters (embeddings and the first block, ``requires_grad=False``): the Trainer's
    optimizer holds the trainable ones only, ``model.safetensors`` every weight. The stock Trainer saves
    every step of 6. With the callback (saves every 2 steps, a memory snapshot every step): the run crashes
    after step 5 (``checkpoint-2`` and ``-4`` committed, step 5 in memory only); the next Trainer writes step
    5 out of memory and resumes from it to step 6; then ``checkpoint-5`` and ``-6`` are removed and a third
    Trainer resumes from the disk tier's ``checkpoint-4``. Every folder (disk tier, written out of memory,
    written after each resume) equals the Trainer's of the same step file for file (same keys and bytes in
    ``model.safetensors``; ``optimizer.pt`` with the trainable parameters only; mode bits), the losses of
    every run are bitwise the uninterrupted Trainer's, and the frozen weights are those the model started
    with."""
    from snapckpt import StorageType

    initial = _frozen_model()
    frozen = {k for k, p in initial.named_parameters() if not p.requires_grad}
    trainable = [k for k, p in initial.named_parameters() if p.requires_grad]
    assert frozen and trainable
    start = {k: v.clone() for k, v in initial.state_dict().items()}
    stock_out, out = os.path.join(snap_env.tmp, "stock"), snap_env.ckpt_dir
    stock = _train(stock_out, False, model=_frozen_model(), max_steps=6, save_steps=1)
    cb_kw = dict(memory_interval_steps=1, flush_on_crash=False, persister_idle_timeout_secs=30)
    runs = [_train(out, True, model=_frozen_model(), crash_at=5, cb_kw=cb_kw, max_steps=6, save_steps=2)]
    assert wait_until(lambda: os.path.isdir(os.path.join(out, "checkpoint-4")), 30)  # committed after the crash
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]  # step 5 in memory only
    for name in ("checkpoint-2", "checkpoint-4"):  # disk tier
        assert _folder_diffs(os.path.join(out, name), os.path.join(stock_out, name), ["save_steps"]) == [], name
    runs.append(_train(out, True, model=_frozen_model(), resume=True, cb_kw=cb_kw, max_steps=6, save_steps=2))
    assert runs[-1]["callback"].resumed_from == (5, StorageType.MEMORY)
    for name in ("checkpoint-5", "checkpoint-6"):  # written out of memory; written after the memory-tier resume
        assert _folder_diffs(os.path.join(out, name), os.path.join(stock_out, name), ["save_steps"]) == [], name
    for name in ("checkpoint-5", "checkpoint-6"):
        shutil.rmtree(os.path.join(out, name))
    # the second run's clean end lets its persister exit, but a Trainer that reaches it first keeps it (and step
    # 6 in memory) alive and resumes from there: wait for it to go, so that the third resumes from the disk
    assert wait_until(lambda: not snap_env.persisters(), 30), "the persister outlived the clean end"
    runs.append(_train(out, True, model=_frozen_model(), resume=True, cb_kw=cb_kw, max_steps=6, save_steps=2))
    assert runs[-1]["callback"].resumed_from is None  # resumed from the disk tier's checkpoint-4
    assert _folder_diffs(os.path.join(out, "checkpoint-6"), os.path.join(stock_out, "checkpoint-6"),
                         ["save_steps"]) == []
    assert sorted(stock["losses"]) == list(range(1, 7))
    assert runs[0]["losses"] == {s: stock["losses"][s] for s in range(1, 6)}
    # the end-of-training summary's train_loss averages the run's own steps only (the Trainer's rule)
    for run in (stock, *runs[1:]):
        assert "train_runtime" in run["trainer"].state.log_history[-1]
        run["state"]["log_history"][-1].pop("train_loss")
    for run in runs[1:]:
        assert run["losses"] == stock["losses"]
        assert run["state"] == {**stock["state"], "save_steps": 2}
    # the folders' contents: all weights, the trainable parameters' optimizer state only, frozen weights as built
    saved = load_file(os.path.join(out, "checkpoint-6", "model.safetensors"))
    assert set(saved) == set(start) - {"lm_head.weight"}  # tied to wte, as save_pretrained leaves it out
    opt = torch.load(os.path.join(out, "checkpoint-6", "optimizer.pt"), weights_only=True)
    assert sum(len(g["params"]) for g in opt["param_groups"]) == len(opt["state"]) == len(trainable)
    for run in (stock, *runs):
        for k in frozen:
            assert torch.equal(run["weights"][k], start[k]), k
    for k in frozen - {"lm_head.weight"}:
        assert torch.equal(saved[k], start[k]), k
