"""Hugging Face Trainer integration (public face: :mod:`snapckpt.hf`).

- :mod:`.callback`: :class:`SnapckptCallback`, Trainer events to snapshots (imports transformers);
- :mod:`.resume`: resume-time folder work at Trainer construction (memory snapshot written out, damaged
  folders set aside);
- :mod:`.files`: the ``checkpoint-N/`` file builders, shared with the Accelerate integration;
- :mod:`.deepspeed_files`: the DeepSpeed part of a ``checkpoint-N/`` under ``TrainingArguments(deepspeed=...)``;
- :mod:`.peft`: the adapter files of a ``peft.PeftModel``.

Importing this package does not import transformers (nor do :mod:`.files` and :mod:`.peft` at module
level): only :mod:`.callback` does.
"""
