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
    ``ValueError`` naming ``hub_strategy='end'``. With ``hub_strategy="end"`` (the Trainer pushes nothing
    during training either) the run trains and commits its checkpoint, and the Hub sees the Trainer's
    ``create_repo`` and nothing else, as without the callback."""
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

    hub.seen.clear()
    args = _args(snap_env.ckpt_dir, max_steps=2, save_steps=2, push_to_hub=True, hub_model_id="me/run",
                 hub_strategy="end")
    trainer = Trainer(model=build_model(), args=args, train_dataset=Tokens(n=8),
                      callbacks=[SnapckptCallback(persister_idle_timeout_secs=2)])
    trainer.train()
    assert os.path.isfile(os.path.join(snap_env.ckpt_dir, "checkpoint-2", ".snapckpt", "manifest.json"))
    assert hub.seen == [("POST", "/api/repos/create")]
