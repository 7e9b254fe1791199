"""Stand-in for the missing GPU: lets megatron-core run on the CPU under gloo (tests, example, benchmark).

THIS MODULE ONLY STANDS IN FOR A GPU. megatron-core assumes CUDA in a few places that have nothing to do
with checkpointing (PLATFORM.md "megatron-core on the CPU"): ``torch.cuda.current_device`` (tensors for
collectives, ``GlobalMemoryBuffer``), ``torch.cuda.synchronize`` / ``set_device``, the CUDA generator
(``torch.cuda.manual_seed`` / ``get_rng_state`` and the RNG tracker's ``_get_cuda_rng_state`` /
``_set_cuda_rng_state``), and ``device='cuda'`` tensor creation in ``megatron.core.optimizer``. On a
machine with a GPU none of this is installed (:func:`install` returns False and changes nothing).

The CUDA generator is replaced by a dedicated CPU ``torch.Generator`` so that Megatron's RNG tracker
(its fork/add/get_states/set_states) keeps working and its states round-trip through a checkpoint like
real CUDA generator states would. snapckpt itself never imports this module.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["install", "tiny_gpt", "init_parallel", "seed_all", "cuda_tensors_on_cpu"]

_FAKE_CUDA_GEN = torch.Generator()
_installed = False


def _no_compile(fn=None, *args, **kwargs):
    """``torch.compile`` as a no-op decorator (with or without arguments)."""
    return fn if fn is not None else (lambda f: f)


def _import_megatron_core_without_compile() -> None:
    """Import megatron-core with its JIT fuser off, as ``megatron.core.jit`` does where ``torch.compile`` is
    unavailable (``noop_decorator``). Its fused GPU kernels (bias-GeLU, GeGLU, SwiGLU...) are wrapped in
    ``torch.compile`` at import time, and that wrapping alone imports TorchInductor: about 4 s of CPU in
    every process (measured: 10.0 -> 6.4 s for the Megatron workers' imports), for kernels these CPU runs never
    compile. Nothing changes where megatron-core was imported already or a GPU is present."""
    import sys

    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    real = torch.compile
    torch.compile = _no_compile  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401  (decorates the fusions it imports with the no-op)
        from megatron.core import jit

        jit.disable_jit_fuser()  # fusion modules imported later get the no-op too
    finally:
        torch.compile = real  # type: ignore[assignment]


_import_megatron_core_without_compile()


def _cpu_device(*_a, **_k):
    return torch.device("cpu")


def install(force: bool = False) -> bool:
    """Redirect the CUDA calls megatron-core makes to the CPU; returns whether it did (idempotent)."""
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available() and not force:
        return False
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: _FAKE_CUDA_GEN.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: _FAKE_CUDA_GEN.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: _FAKE_CUDA_GEN.get_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda st, *a, **k: _FAKE_CUDA_GEN.set_state(st)  # type: ignore[assignment]
    torch.cuda.get_rng_state_all = lambda: [_FAKE_CUDA_GEN.get_state()]  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom

    def _get(device=None, clone=False, graph_safe=False):
        return _FAKE_CUDA_GEN.get_state()

    def _set(new_state, device=-1, graph_safe=False):
        _FAKE_CUDA_GEN.set_state(new_state)

    mrandom._get_cuda_rng_state = _get
    mrandom._set_cuda_rng_state = _set
    _installed = True
    return True


def init_parallel(tp: int, seed: int = 1234) -> None:
    """``initialize_model_parallel(tp)`` (data parallel over the rest) and Megatron-LM's seeding (python,
    numpy, torch, then the model-parallel CUDA generators), so data-parallel replicas start equal."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_all(seed)


def seed_all(seed: int = 1234) -> None:
    """Megatron-LM's seeding: python, numpy, torch, then the model-parallel CUDA generators (the RNG
    tracker is reset), as after :func:`init_parallel`; after ``initialize_model_parallel``."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def tiny_gpt(tp: int, vocab: int = 64, seq: int = 16, hidden: int = 32, layers: int = 2):
    """A tiny megatron-core ``GPTModel`` (fp32, local layer spec, CPU init) for tensor parallel ``tp``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            pipeline_dtype=torch.float32, hidden_dropout=0.1, attention_dropout=0.1)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=seq)


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """Within the block, tensor factories (``torch.tensor``, ``zeros``, ``ones``, ``empty``, ``full``) called
    with ``device='cuda'`` create CPU tensors (megatron-core's optimizers build loss-scale and grad-norm
    buffers that way)."""
    names = ("tensor", "zeros", "ones", "empty", "full")
    real = {n: getattr(torch, n) for n in names}

    def redirect(fn):
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for n in names:
        setattr(torch, n, redirect(real[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(torch, n, real[n])
