"""slurmft's own save in the benchmark: ``CheckpointManager.save`` (blocking) then ``wait`` (committed).

Same state as the other methods (model + optimizer, through ``TrainState``), same disk; retention
keeps the last two checkpoints so a long series does not fill the disk. With overlapped staging
``save()`` returns before the copy is complete; the parameters may change only once it is, so
outside a training loop ``start`` also waits for that (``fence``). Inside the loop
(``in_loop=True``) the optimizer's step pre-hook does that wait, wherever it falls.
"""

from __future__ import annotations

from pathlib import Path

import torch

from _bench_methods import SaveMethod
from slurmft.rundir import RunDir
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
from slurmft.checkpoint.state import TrainState


class SlurmftSave(SaveMethod):
    name = "slurmft CheckpointManager.save"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path, *,
                 in_loop: bool = False, config: CheckpointConfig | None = None) -> None:
        super().__init__(model, optimizer)
        self._in_loop = in_loop
        self._run_dir = RunDir(run_dir)
        self._manager = CheckpointManager(run_dir, config or CheckpointConfig(keep_last=2))
        self._state = TrainState(model, optimizer)
        self._last_step: int | None = None

    def start(self, step: int, path: Path | None) -> None:
        self._manager.save(step, self._state)
        if not self._in_loop:
            self._manager.fence()
        self._last_step = step

    def finish(self) -> None:
        self._manager.wait()

    def committed_after_s(self) -> float | None:
        last = self._manager.stats[-1]
        if last.step != self._last_step or not last.committed:
            raise RuntimeError(f"slurmft save of step {self._last_step} did not commit: {last.error}")
        return last.total_s

    def close(self) -> None:
        self._manager.close()

    def last_checkpoint_dir(self) -> Path:
        if self._last_step is None:
            raise RuntimeError("no slurmft save was made")
        return self._run_dir.checkpoint(self._last_step)
