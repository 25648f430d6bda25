"""slurmft: keeps long-running distributed PyTorch training alive on Slurm.

The package is split in two sides that share only the run directory:
``slurmft.train`` (in-job, imports torch) and everything else (cluster side, never imports torch).
"""

__version__ = "0.1.0"
