"""What a checkpoint holds: the full training state, as a DCP ``Stateful``.

``TrainState`` gathers model and optimizer through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``: plain modules, DDP and FSDP2/DTensor alike, resharded by
DCP on load), plus the LR scheduler, the step, the sampler's position, user extras and every
rank's RNG state. The checkpoint's top-level keys:

* ``model``, ``optim``: DCP's own state dicts (a plain DCP checkpoint, readable without slurmft);
* ``train``: ``step`` (int) and ``scheduler``/``sampler``/``extras`` as JSON strings, so their
  keys may change between code versions without breaking DCP's key matching, and loading them
  needs no unpickling beyond plain strings;
* ``rng``: ``rank<r>`` -> that rank's generator tensors (see :mod:`slurmft.checkpoint.rng`).

The sampler and extras are global (identical on every rank); only one copy is stored.

``extras`` values are either plain JSON data (restored by replacement) or objects with
``state_dict()``/``load_state_dict()`` of plain JSON data, such as ``torch.amp.GradScaler``
(restored in place with ``load_state_dict``, so the object the loop holds is the one resumed).
State that is in none of these (a data loader's iterator, an EMA kept in a plain tensor) is not in
the checkpoint: after a resume it starts again from what the script builds;
``carried()`` says what is.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from slurmft.checkpoint.rng import capture_rng_state, restore_rng_state

MODEL, OPTIM, TRAIN, RNG = "model", "optim", "train", "rng"


def _to_json(name: str, obj: Any) -> str:
    try:
        return json.dumps(obj, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} state must be plain JSON data (dict/list/str/int/float/bool/None): {exc}") from None


def stateful(obj: Any) -> bool:
    """Carried through ``state_dict``/``load_state_dict`` (a scheduler, a sampler, a GradScaler)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def rank_key(rank: int) -> str:
    return f"rank{rank}"


class TrainState(Stateful):
    """Model, optimizer and everything else needed to resume training exactly where it stopped.

    model, optimizer: plain, DDP or FSDP2 (optimizer optional). scheduler, sampler: objects with
    ``state_dict``/``load_state_dict`` of plain JSON data (optional). extras: a JSON dict of your
    own ({}). options: ``StateDictOptions`` for DCP's state-dict helpers (None).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        sampler: Any | None = None,
        extras: dict[str, Any] | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extras: dict[str, Any] = dict(extras or {})
        self.step = 0
        self.options = options

    @staticmethod
    def rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    # ------------------------------------------------------------------ capture

    def heavy_state(self) -> dict[str, Any]:
        """Model and optimizer state dicts; tensors alias the live parameters (stage before use)."""
        if self.optimizer is None:
            return {MODEL: get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {MODEL: model_sd, OPTIM: optim_sd}

    def light_state(self, *, include_rng: bool = True) -> dict[str, Any]:
        """Step, scheduler, sampler, extras and this rank's RNG: small, freshly created values."""
        train: dict[str, Any] = {
            "step": int(self.step),
            "extras": _to_json("extras", {name: value.state_dict() if stateful(value) else value
                                          for name, value in self.extras.items()}),
        }
        if self.scheduler is not None:
            train["scheduler"] = _to_json("scheduler", self.scheduler.state_dict())
        if self.sampler is not None:
            train["sampler"] = _to_json("sampler", self.sampler.state_dict())
        light: dict[str, Any] = {TRAIN: train}
        if include_rng:
            light[RNG] = {rank_key(self.rank()): capture_rng_state()}
        return light

    def state_dict(self) -> dict[str, Any]:
        """Stateful protocol: the whole state, tensors aliasing live parameters."""
        return {**self.heavy_state(), **self.light_state()}

    # ------------------------------------------------------------------ restore

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stateful protocol: restore everything in ``state_dict`` (RNG only if present)."""
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict[MODEL], options=self.options)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict[MODEL],
                           optim_state_dict=state_dict[OPTIM], options=self.options)
        train = state_dict[TRAIN]
        self.step = int(train["step"])
        self._load_extras(json.loads(train["extras"]))
        for name, obj in (("scheduler", self.scheduler), ("sampler", self.sampler)):
            if obj is None:
                continue
            if name not in train:
                raise KeyError(f"checkpoint has no {name} state but this TrainState has a {name}")
            obj.load_state_dict(json.loads(train[name]))
        rng = state_dict.get(RNG, {}).get(rank_key(self.rank()))
        if rng is not None:
            restore_rng_state(rng)

    def _load_extras(self, saved: dict[str, Any]) -> None:
        for name, value in self.extras.items():
            if stateful(value):
                if name not in saved:
                    raise KeyError(f"checkpoint has no state for extras[{name!r}] ({type(value).__name__}) "
                                   "but this TrainState carries one")
                value.load_state_dict(saved[name])
        for name, value in saved.items():
            if not stateful(self.extras.get(name)):
                self.extras[name] = value

    def carried(self) -> dict[str, Any]:
        """What a checkpoint of this state holds besides the model: type names, for the journal."""
        out: dict[str, Any] = {"model": type(self.model).__name__}
        for name, obj in (("optimizer", self.optimizer), ("scheduler", self.scheduler), ("sampler", self.sampler)):
            out[name] = None if obj is None else type(obj).__name__
        out["extras"] = {name: type(value).__name__ if stateful(value) else "json"
                         for name, value in self.extras.items()}
        out["rng"] = "torch, cuda, python, numpy (per rank)"
        return out
