"""The Trainer with ``SnapckptCallback`` behaves as without it (issue 17, items 3-4): ``push_to_hub`` and
``save_strategy="best"``. In-process Trainers on the tiny GPT-2 of ``tests/workers/hf_worker.py`` (CPU),
each compared with the stock Trainer on the same arguments."""
import http.server
import json
import os
import sys
import threading

import pytest

from _harness import REPO

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


def test_save_strategy_best_matches_the_trainers_own_save(snap_env):
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
    construction, naming it and the fix."""
    from transformers import EarlyStoppingCallback, Trainer, TrainerCallback

    from hf_worker import Tokens, build_model
    from snapckpt.hf import SnapckptCallback

    class Saves(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with open(os.path.join(folder, "trainer_state.json")) as f:
                self.steps.append((state.global_step, json.load(f)["best_global_step"]))

    def args(out):
        return _args(out, max_steps=8, save_strategy="best", eval_strategy="steps", eval_steps=1,
                     metric_for_best_model="eval_loss", greater_is_better=False, save_total_limit=2,
                     load_best_model_at_end=True)

    def run(out, snap):
        saves = Saves()
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
    assert 1 < len(stock[0]) < evals and len(stock[1]) < len(stock[0]) and stock[3] < 8, stock[:4]
    mine = run(snap_env.ckpt_dir, snap=True)
    for name in mine[1]:  # written by snapckpt, not by the Trainer's own save
        assert os.path.isfile(os.path.join(snap_env.ckpt_dir, name, ".snapckpt", "manifest.json")), name
    assert mine[0] == stock[0]  # on_save: same steps, each folder complete when it fires
    assert mine[1] == stock[1]  # same folders kept, same files in each
    assert mine[2] == stock[2]  # same trainer_state.json (best_metric, best_global_step, best_model_checkpoint)
    assert mine[3:] == stock[3:]  # stopped at the same step, same best model loaded at the end

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
