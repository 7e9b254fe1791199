"""Capture and restore every random number generator a training step touches (contract 8 (docs/design/contracts.md)).

The captured record holds only tensors, ints, tuples and strings, so it loads with
``torch.load(weights_only=True)``: python's ``random`` (state tuple), numpy's global ``RandomState`` when
numpy is installed (the key array as a tensor), torch's CPU generator, and every CUDA device's generator
when CUDA is available.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import torch

__all__ = ["capture", "restore"]


def capture() -> Dict[str, Any]:
    """Return the current RNG states as a ``weights_only``-safe dict."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture` (missing entries are left alone)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
