"""slurmft: keeps long-running distributed PyTorch training alive on Slurm.

The package is split in two sides that share only the run directory: the in-job side,
``slurmft.train`` (the training loop) and ``slurmft.checkpoint`` (the checkpoint engine it uses),
which import torch; and everything else (the cluster side), which never does. The engine's
torch-free half (manifests, listing, retention: what ``slurmft ckpt`` reads) is shared with the
cluster side; ``tests/unit/test_layout.py`` holds both rules.
"""

__version__ = "0.1.0"
