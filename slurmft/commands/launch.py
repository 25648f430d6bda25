"""``slurmft launch SCRIPT.py [ARGS...]``: run a training script across this Slurm allocation
(what ``sbatch_templates/train.sbatch`` execs; same as ``python -m slurmft.launch``). Every
argument after ``launch`` is the training command, passed on unparsed; settings come from the
``SLURMFT_*`` environment (see the template). Exit codes: 0 finished, 85 requeue me, 86 do not
requeue (bad input, or training said so), anything else a failure passed on to ``slurmft watch``.
"""

from __future__ import annotations

import typer

CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True,
                    "help_option_names": []}


def app(ctx: typer.Context) -> None:
    """Run a training script across this Slurm allocation (inside sbatch)."""
    from slurmft.launch.main import main

    raise typer.Exit(main(list(ctx.args)))
