"""slurmft.health: node health checks, each a small pure function over facts gathered once.

``result`` (CheckResult), ``facts`` (gather every source once, each bounded by a timeout),
``gpu`` (NVML facts) and ``gpu_checks``, ``xid`` (kernel-log Xids and the one Xid table),
``dcgm`` (dcgmi health/diag), ``node`` (disk, mounts, InfiniBand, memory), ``external`` (site
commands), ``proc`` (running a program with a timeout), ``state`` (memory between sweeps),
``registry`` (which checks exist, their config tables, running a plan). Never imports torch.
"""
