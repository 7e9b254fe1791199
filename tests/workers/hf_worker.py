"""A tiny GPT-2 (built from a config, no downloads) trained by the Hugging Face ``Trainer`` on CPU.

Usage: hf_worker.py '<json config>' (single process, or every rank under torchrun). Config keys:
    out: output_dir; steps: max_steps; save_steps; snap: attach SnapckptCallback; resume: pass
    resume_from_checkpoint=True; mem: memory_interval_steps; opts: Checkpointer options;
    kill_at: at the on_step_begin after global step ``kill_at`` (the pending snapshot of that step is
    taken first) die: "exit" (os._exit, no close), "kill" (SIGKILL self), "kill_node" (SIGKILL the
    persister, then self), after waiting for the folder ``wait_for`` if given; eval_best: evaluate every save, keep the best
    (greatest eval_loss), load_best_model_at_end; limit: save_total_limit; shard: max_shard_size;
    subclass_args: use a TrainingArguments subclass defined here (case E5); tie: tie_word_embeddings;
    tok: pass a tokenizer as processing_class; gas: gradient_accumulation_steps;
    lora: wrap the model in a ``peft.PeftModel`` (LoRA r=4 on c_attn, lora_dropout 0.1); at the end the
    newest checkpoint is loaded with ``PeftModel.from_pretrained`` on a fresh base model and its logits are
    compared with the trained model's (fact ``adapter_logits_equal``);
    result: file (per rank: RESULT json lines) with per-step losses, lrs and final facts;
    ref: a whole config (its own out and result) run first in the same process, to its end (the stock
    reference of the same test: one process start fewer; the Trainer seeds the model and the data again).
"""
import dataclasses
import json
import os
import signal
import sys
import time

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator)


@dataclasses.dataclass
class MyArgs(TrainingArguments):
    """A user-defined TrainingArguments subclass living in the training script (case E5)."""

    my_flag: str = "hello"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=48, seq=16, vocab=96):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(tie=True):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.2,
                     embd_pdrop=0.2, attn_pdrop=0.2, tie_word_embeddings=tie)
    return GPT2LMHeadModel(cfg)


def build_lora_model():
    """The tiny GPT-2 with a LoRA adapter (r=4) on every ``c_attn``; only the adapter is trainable."""
    from peft import LoraConfig, get_peft_model

    base = build_model()
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                           fan_in_fan_out=True))


def adapter_logits_equal(trained, folder):
    """``PeftModel.from_pretrained(fresh base, folder)`` gives the trained model's logits exactly (eval mode)."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(build_model(), folder).eval()
    trained.eval()
    x = Tokens(n=2).ids
    with torch.no_grad():
        return torch.equal(trained(input_ids=x).logits, loaded(input_ids=x).logits)


def newest_checkpoint(out):
    return os.path.join(out, max((d for d in os.listdir(out) if d.startswith("checkpoint-")),
                                 key=lambda d: int(d.split("-")[1])))


def build_tokenizer():
    """A word-level tokenizer over the model's 96 ids, built offline (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(95)}
    vocab["[UNK]"] = 95
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="t0")


class Recorder(TrainerCallback):
    def __init__(self, cfg, snap):
        self.cfg, self.snap = cfg, snap
        self.rows = []
        self.facts = {}  # known before training (``materialized``): in the result of a run killed early too

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.rows.append({"step": state.global_step, "loss": repr(logs["loss"]),
                              "lr": repr(logs["learning_rate"])})

    def on_step_begin(self, args, state, control, **kw):
        kill_at = self.cfg.get("kill_at")
        if kill_at is None or state.global_step != kill_at:
            return
        dump(self.cfg, {**self.facts, "rows": self.rows})
        how = self.cfg["die"]
        if self.cfg.get("wait_for"):
            wait_for = os.path.join(args.output_dir, self.cfg["wait_for"])
            deadline = time.monotonic() + 60
            while not os.path.isdir(wait_for) and time.monotonic() < deadline:
                time.sleep(0.02)
        if how == "exit":
            os._exit(0)
        if how == "kill_node":
            os.kill(self.snap.checkpointer.persister_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def dump(cfg, facts):
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{cfg['result']}.{rank}", "w") as f:
        json.dump(facts, f)


def main():
    cfg = json.loads(sys.argv[1])
    if cfg.get("ref"):
        train(cfg["ref"])
    train(cfg)
    if torch.distributed.is_initialized():
        # Under torchrun the process sometimes aborts at its very end ("terminate called without an active
        # exception", SIGABRT, so torchrun exits 1): seen with the stock Trainer without snapckpt too (CI, stops 5
        # and 6), with and without destroy_process_group(), in torch's C++ teardown. snapckpt was closed by
        # on_train_end and every result is written: meet the other ranks, then leave without that teardown.
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def train(cfg):
    """One Trainer run of ``cfg`` (the keys above); writes its facts to ``cfg["result"]``."""
    from snapckpt.hf import SnapckptCallback

    cls = MyArgs if cfg.get("subclass_args") else TrainingArguments
    best = cfg.get("eval_best", False)
    args = cls(output_dir=cfg["out"], max_steps=cfg["steps"], per_device_train_batch_size=4,
               learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
               gradient_accumulation_steps=cfg.get("gas", 1),
               save_steps=cfg.get("save_steps", 5), save_strategy="steps", seed=7, report_to="none",
               use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
               save_total_limit=cfg.get("limit"),
               eval_strategy="steps" if best else "no", eval_steps=cfg.get("save_steps", 5) if best else None,
               metric_for_best_model="eval_loss" if best else None, greater_is_better=True if best else None,
               load_best_model_at_end=best)
    model = build_lora_model() if cfg.get("lora") else build_model(cfg.get("tie", True))
    snap = None
    callbacks = []
    if cfg.get("snap"):
        opts = {"persister_idle_timeout_secs": 120, **cfg.get("opts", {})}
        snap = SnapckptCallback(memory_interval_steps=cfg.get("mem"), max_shard_size=cfg.get("shard", "50GB"),
                                **opts)
        callbacks.append(snap)
    rec = Recorder(cfg, snap)
    callbacks.append(rec)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      eval_dataset=Tokens(n=8) if best else None, data_collator=default_data_collator,
                      processing_class=build_tokenizer() if cfg.get("tok") else None,
                      callbacks=callbacks)
    facts = {}
    if snap is not None and snap.resumed_from is not None:
        facts["materialized"] = [snap.resumed_from[0], snap.resumed_from[1].value]
    rec.facts = dict(facts)
    trainer.train(resume_from_checkpoint=True if cfg.get("resume") else None)
    facts.update(rows=rec.rows, best=trainer.state.best_model_checkpoint,
                 stall=snap.stall_secs if snap else None)
    if best:  # load_best_model_at_end restored these weights
        facts["final_wte"] = trainer.model.transformer.wte.weight.detach().flatten()[:8].tolist()
    if cfg.get("lora"):
        facts["adapter_logits_equal"] = adapter_logits_equal(trainer.model, newest_checkpoint(cfg["out"]))
    if cfg.get("subclass_args") and int(os.environ.get("RANK", "0")) == 0:
        loaded = torch.load(os.path.join(newest_checkpoint(cfg["out"]), "training_args.bin"), weights_only=False)
        facts["args_class"] = type(loaded).__name__
        facts["my_flag"] = loaded.my_flag
    dump(cfg, facts)


if __name__ == "__main__":
    main()
