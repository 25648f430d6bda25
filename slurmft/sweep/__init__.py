"""slurmft.sweep: run the health checks on a node, decide drain/resume, act through Slurm, report.

``config`` ([sweep] settings), ``decide`` (pure decision + blast-radius guard), ``act`` (the only
Slurm calls), ``lock`` (one sweep at a time), ``report`` (JSON report), ``metrics`` (Prometheus
textfile), ``run`` (the order of it all).
"""
