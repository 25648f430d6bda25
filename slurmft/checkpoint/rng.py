"""Per-rank random number generator state, as tensors (no pickle needed to save or load it).

Captured: Python's ``random``, NumPy's legacy global generator, torch CPU, and the current CUDA
device's generator when CUDA is initialised. Each rank saves its own state under its own key.

World-size policy: a rank's RNG stream only means something for the same rank in the same world.
When a checkpoint is loaded by the same world size, every rank gets its own saved state back
(bit-for-bit resume). When the world size changed, saved states are not restored (which old rank
would a new rank continue?); instead every generator is reseeded from ``(step, rank)``, so runs are
still reproducible, ranks still differ from each other, and a resumed run does not replay the
random stream it started with.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

_PY_STATE_LEN = 625  # Mersenne Twister: 624 words + position


def capture_rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states as fresh CPU tensors."""
    version, words, gauss = random.getstate()
    if len(words) != _PY_STATE_LEN:
        raise RuntimeError(f"unexpected Python random state length {len(words)}")
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    if np_name != "MT19937":
        raise RuntimeError(f"unexpected NumPy bit generator {np_name}")
    state = {
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss, gauss is not None], dtype=torch.float64),
        "numpy": torch.from_numpy(np.concatenate([np.asarray(np_keys).astype(np.int64), [np_pos, np_has_gauss]])),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Set every generator from :func:`capture_rng_state` output (same rank, same world size)."""
    py = state["python"].tolist()
    gauss_value, has_gauss = state["python_gauss"].tolist()
    random.setstate((int(py[0]), tuple(int(w) for w in py[1:]), gauss_value if has_gauss else None))
    np_words = state["numpy"].numpy()
    np.random.set_state(
        ("MT19937", np_words[:-2].astype(np.uint32), int(np_words[-2]), int(np_words[-1]),
         float(state["numpy_gauss"][0]))
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # absent when the saving job had no CUDA
        torch.cuda.set_rng_state(state["cuda"])


def reseed_for_new_world(step: int, rank: int) -> int:
    """Seed every generator from ``(step, rank)``; returns the seed used (logged by the caller)."""
    digest = hashlib.sha256(f"slurmft-rng:{step}:{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed
