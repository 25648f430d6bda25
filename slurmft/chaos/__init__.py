"""Fault injection on a devcluster for the chaos demo (``make demo``) and the soak benchmark.

``faults`` owns the faults themselves (a node death, a hang, a failing health check found by the
sweeper, a corrupted newest checkpoint, a crash, a time-limit signal); ``drive`` owns one chaos
run: wait until the run has something to lose, inject a fault, and time what the watcher and the
run did about it from the run's journal. Nothing here recovers anything: every requeue, exclusion
and ``StartTime=now`` comes from ``slurmft watch``. Never imports torch.
"""
