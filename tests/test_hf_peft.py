"""Hugging Face Trainer integration with a PEFT/LoRA model: adapter-only ``checkpoint-N`` folders.

The tiny GPT-2 of ``tests/workers/hf_worker.py`` (dropout 0.2, shuffled data, linear schedule) wrapped by
``peft.get_peft_model`` with LoRA r=4 on every ``c_attn`` (lora_dropout 0.1), trained by the stock
``Trainer`` on CPU, one process. The reference is the stock Trainer without the callback:

- F2: the callback's ``checkpoint-5`` (disk tier, while training runs), ``checkpoint-10`` and
  ``checkpoint-12`` hold exactly the Trainer's files (``adapter_model.safetensors``,
  ``adapter_config.json``, ``README.md``, ``trainer_state.json`` byte-identical; ``optimizer.pt``,
  ``scheduler.pt``, ``rng_state.pth`` equal states; ``training_args.bin`` equal but for ``output_dir``
  and ``logging_dir``, which name each run's own directory); no base-model weights or ``config.json``;
- memory tier and F1/E2: kill -9 of training at step 8 (memory snapshots every step, no crash flush);
  the next Trainer writes step 8 out of memory as ``checkpoint-8`` and the stock
  ``train(resume_from_checkpoint=True)`` continues from it with bitwise the uninterrupted losses;
- ``PeftModel.from_pretrained(fresh base, checkpoint-12)`` gives the trained model's logits exactly;
- in-process: the file specs equal ``PeftModel.save_pretrained``'s files byte for byte, only adapter
  tensors are snapshotted, and a model with a second adapter is refused when training starts.
"""
import os
import signal
import stat
import sys

import pytest
import torch

from test_hf import WORKER, _assert_same_folder, _files, _rows, _run, _same_steps

# scripts/test.sh hands out tests one by one (--dist loadgroup); these share the module-scoped `stock_lora` run:
# one worker runs them all, so it is made once
pytestmark = pytest.mark.xdist_group("test_hf_peft")

STEPS = 12
ADAPTER_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng_state.pth",
                 "scheduler.pt", "trainer_state.json", "training_args.bin"]


def test_F1_F2_E2_lora_adapter_only_folders_and_memory_resume_after_kill9(snap_env, tmp_path):
    ref_dir, out = str(tmp_path / "stock-lora"), os.path.join(snap_env.tmp, "run")
    cfg = {"out": out, "steps": STEPS, "lora": True, "snap": True, "mem": 1, "opts": {"flush_on_crash": False}}
    # 1. The stock Trainer on the LoRA model, no callback (12 steps, saves at 5, 10 and 12), run to its end
    # first in the same process; then train to step 8 (checkpoint-5 committed, step 8 held in memory) and
    # kill -9 the training process.
    first, stock = _run({**cfg, "kill_at": 8, "die": "kill", "wait_for": "checkpoint-5"}, snap_env.env,
                        expect_rc=-signal.SIGKILL, ref={"out": ref_dir, "steps": STEPS, "lora": True})
    assert stock["adapter_logits_equal"]  # the reference itself round-trips through from_pretrained
    ref = _rows(stock)
    _same_steps(_rows(first), ref, range(1, 9))
    assert _files(os.path.join(out, "checkpoint-5")) == ADAPTER_FILES
    _assert_same_folder(os.path.join(out, "checkpoint-5"), os.path.join(ref_dir, "checkpoint-5"))  # F2
    assert not os.path.exists(os.path.join(out, "checkpoint-8"))
    # 2. A new Trainer writes step 8 out of memory; the stock resume continues from it bitwise (F1, E2).
    second = _run({**cfg, "resume": True}, snap_env.env)
    assert second["materialized"] == [8, "memory"]
    _same_steps(_rows(second), ref, range(9, STEPS + 1))
    for step in (10, 12):
        _assert_same_folder(os.path.join(out, f"checkpoint-{step}"), os.path.join(ref_dir, f"checkpoint-{step}"))
    assert second["adapter_logits_equal"]  # PeftModel.from_pretrained(base, checkpoint-12)


def _file_bytes(spec):
    if hasattr(spec, "parts"):
        return b"".join(p if isinstance(p, bytes) else p.contiguous().view(torch.uint8).flatten().numpy().tobytes()
                        for p in spec.parts)
    return bytes(spec.data)


def test_F2_adapter_specs_equal_save_pretrained_and_second_adapter_refused(snap_env, tmp_path):
    """Without a Trainer: ``model_files`` + ``card_files`` of a trained-looking LoRA model are byte for byte
    and mode for mode what ``PeftModel.save_pretrained`` writes, and hold the adapter's tensors only (the live ones, not
    copies: the snapshot copies them). A second adapter is refused with the fix when training starts."""
    sys.path.insert(0, os.path.dirname(WORKER))
    from hf_worker import Tokens, build_lora_model
    from peft import LoraConfig
    from transformers import Trainer, TrainingArguments

    from snapckpt.hf import SnapckptCallback
    from snapckpt.integrations.transformers.files import model_files
    from snapckpt.integrations.transformers.peft import card_files

    model = build_lora_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # as after training (LoRA initialises B to zero)
    files = {**model_files(model), **card_files(model)}
    model.save_pretrained(str(tmp_path / "peft"))
    assert sorted(files) == sorted(os.listdir(tmp_path / "peft")) == ["README.md", "adapter_config.json",
                                                                      "adapter_model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    for name, spec in files.items():
        assert _file_bytes(spec) == (tmp_path / "peft" / name).read_bytes(), name
        mode = spec.mode if spec.mode is not None else 0o666 & ~umask  # None: the persister's default
        assert mode == stat.S_IMODE(os.stat(tmp_path / "peft" / name).st_mode), name
    live = {p.data_ptr() for n, p in model.named_parameters() if "lora_" in n}
    tensors = [p for p in files["adapter_model.safetensors"].parts if isinstance(p, torch.Tensor)]
    assert len(tensors) == 4 and {t.data_ptr() for t in tensors} == live

    model.add_adapter("other", LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    args = TrainingArguments(output_dir=snap_env.ckpt_dir, max_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True)
    cb = SnapckptCallback()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(n=4), callbacks=[cb])
    with pytest.raises(NotImplementedError, match="named 'default' only.*sub-folder"):
        trainer.train()
    cb.close()
