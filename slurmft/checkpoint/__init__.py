"""slurmft.checkpoint: the checkpoint engine. Sharded saves on PyTorch DCP, asynchronous, with an
atomic commit; loads that verify every file; incremental saves; the node-local tier; retention;
export. The training loop (``slurmft.train``) uses it; it imports nothing from the loop (the
loop's watchdog and heartbeat are typed here as ``manager.PhaseWatcher``).

Two halves:

- torch-free, shared by the job and ``slurmft ckpt`` on login nodes: ``manifest`` (the format,
  verify), ``checksum``, ``pickle_scan``, ``listing``, ``retention``, ``tiers``, ``config``
  (``[checkpoint]``), ``save_thread``;
- torch: ``manager`` (``CheckpointManager``), ``writer`` + ``shard_writer`` (the commit),
  ``staging`` + ``overlap``, ``incremental``, ``local_tier`` + ``tier_transfer``, ``verified_read``
  + ``dcp_metadata``, ``state`` (``TrainState``) + ``rng``, ``groups``, ``torch_compat``, ``export``.

This file imports nothing, so ``import slurmft.checkpoint`` stays torch-free;
``tests/unit/test_layout.py`` holds both halves and the direction of imports to this.
"""
