"""slurmft.status: what ``slurmft status`` shows of a run, read from its journal. Torch-free.

``report`` (the pure report: segments, faults, ETTR, restarts by cause; the bounded journal
reader), ``state`` (where the run stands, what it waits for), ``render`` (the terminal tables),
``plot`` (``--plot``, matplotlib optional). The command itself is ``slurmft/commands/status.py``;
it asks Slurm through ``slurmft.slurm``, nothing here does.
"""
