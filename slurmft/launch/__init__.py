"""``slurmft launch``: what ``sbatch_templates/train.sbatch`` runs inside the allocation.

The template is only ``#SBATCH`` lines, the NCCL/IB environment and one ``exec`` of this
launcher, which owns the orchestration as small, unit-tested modules:

  ``identity``   who this job is (array-aware ``<array_job_id>_<task_id>``; hetjobs refused)
  ``settings``   every ``SLURMFT_*`` number from the environment, validated, with floors
  ``preflight``  one bounded ``srun`` of ``nodecheck`` on every node; which nodes to exclude
  ``nodecheck``  runs on each node: run dir, disk, torch, the quick dry-run sweep (``sweep.main``)
  ``rendezvous`` torchrun's c10d endpoint from ``SLURM_JOB_NODELIST`` (python-hostlist)
  ``task``       one node's task of the training step: torchrun with USR2 ignored
  ``agent``      torchrun's agent as slurmft starts it (``scriptend``: no teardown); its argv
  ``signals``    the handler (records only) and the judgement of a signal before training
  ``step``       the training ``srun``: signals go to that child only, re-sent with a floor
  ``procs``      srun children in their own process group, ended TERM-then-KILL at their bound
  ``journaling`` the launcher's log lines and journal events (array-aware job id)
  ``requeue``    self-requeue through ``slurmft.slurm`` when scontrol exists, else a journaled
                 ``requeue_request`` for ``slurmft watch``
  ``outcome``    the recorded outcome of THIS segment -> exit 0 / 85 / 86 / 87 / passed on
  in-allocation mode (``SLURMFT_SPARE_NODES`` / ``SLURMFT_IN_ALLOCATION``, issue 27):
  ``alloc_settings`` its settings; ``allocation`` ``<run_dir>/allocation.json``; ``nodesteps``
  one srun step per node; ``liveness`` the nodes' task beats; ``inalloc`` the supervising loop;
  ``inplace`` restarts in place learned from the journal, bounded by progress; ``spare`` a
  spare's task waiting for its place, its torchrun started ahead (``pretorchrun``); ``orphan``
  the batch host's death seen from the others;
  ``warm``/``warmworker``/``warmclient``/``warmfork``/``warmtask`` ranks forked from a warm
  per-node server, itself forked from torchrun's agent (both modes; ``SLURMFT_WARM_WORKERS=0``
  opts out)
  ``main``       the order of the above, and the one place that exits

Torch-free: torch is imported only by the training ranks, by the per-node torch check, and by
torchrun's agent (``agent``, a spare's started ahead) and the warm server forked from it.
"""
