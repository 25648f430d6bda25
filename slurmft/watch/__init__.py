"""``slurmft watch``: the requeue daemon. Torch-free; Slurm only through ``slurmft.slurm``.

One poll cycle = one ``snapshot`` (one controller query for every watched job, one node query,
each run dir read from the filesystem); ``detect`` turns it into findings with pure functions;
``policy`` decides what a finding means for a run given its persisted ``state``; ``act`` is the
one place that changes anything in Slurm, recording its intent in the run's state before each
step; ``loop`` ties them together. ``notify`` and ``metrics`` report outward.
"""
