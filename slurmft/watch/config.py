"""``[watch]`` settings of ``slurmft watch``, validated in one place.

Loaded with ``slurmft.config.load_section(WatchConfig, "watch")`` (defaults < slurmft.toml <
``SLURMFT_WATCH_<FIELD>`` < flags). Every duration is in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

# The shortest poll period accepted (seconds).
MIN_POLL_S = 0.5
ADMIN_DRAIN = ("after_checkpoint", "ignore")


@dataclass(frozen=True)
class WatchConfig:
    # Seconds between poll cycles.
    poll_s: float = 5.0
    # A RUNNING job whose every heartbeat is older than this is hung (a phase the job announced,
    # a checkpoint save or load, an evaluation, adds its own bound). 0: learn it from the run: the
    # gap between two beats + hang_factor x the median of its recent steps (at least hang_min_s),
    # + clock_skew_s.
    hang_timeout_s: float = 0.0
    hang_factor: float = 10.0
    hang_min_s: float = 60.0
    # Heartbeat times come from the compute nodes' clocks: this much disagreement with the
    # watcher's clock (an NTP step included) is allowed in the learned timeout.
    clock_skew_s: float = 30.0
    # After a segment starts, and after its last heartbeat before its first step (a checkpoint
    # load announced), no hang is declared before this (start-up, first step, compilation).
    startup_grace_s: float = 300.0
    # A node whose per-node busy time is straggler_factor x the median for straggler_window
    # consecutive heartbeats is a straggler: warned about, excluded at the next restart if
    # exclude_stragglers.
    straggler_factor: float = 1.5
    straggler_window: int = 3
    exclude_stragglers: bool = False
    # Warn when no checkpoint was committed for this factor x the run's usual interval (and at
    # least checkpoint_overdue_min_s: a run that checkpoints every few seconds is not "overdue"
    # after a few more).
    checkpoint_overdue_factor: float = 2.0
    checkpoint_overdue_min_s: float = 120.0
    # Giving up, for faults that made no progress only (no checkpoint newer than at the fault
    # restart before): restarts in total, per cause, and such restarts in a row (a crash loop).
    # Planned ends (a time limit, a preemption, a pre-flight requeue) count toward none of them.
    max_restarts: int = 50
    max_restarts_per_cause: int = 20
    crash_loop_restarts: int = 3
    # A requeued job still PENDING after this long gets a warning (it may wait for capacity).
    pending_warn_s: float = 600.0
    # StartTime=now is sent this long after the job shows PENDING (not COMPLETING): slurmd
    # refuses a launch within about a second of the requeue ("Job credential revoked").
    start_now_delay_s: float = 1.5
    # A node that was the evidence in this many earlier faults is excluded as soon as it shows
    # up in the job's allocation again. Each node_fault_fade_s a node serves the job without a
    # fault, one of its faults is forgotten (0: never).
    repeat_offender_faults: int = 2
    node_fault_fade_s: float = 7 * 86400.0
    # Operator mode (needs Slurm operator rights): a node of a running job that Slurm shows
    # NOT_RESPONDING at two polls, whose heartbeats are older than the run's hang timeout, is set
    # DOWN at once instead of waiting for SlurmdTimeout (300 s by default on real clusters).
    operator: bool = False
    # A node of the job drained by an admin (a reason not the sweeper's): "after_checkpoint"
    # keeps training until a checkpoint commits after the drain (at most the checkpoint-overdue
    # bound, admin_drain_wait_s while the run's interval is unknown), then requeues without it;
    # "ignore" leaves the job alone.
    admin_drain: str = "after_checkpoint"
    admin_drain_wait_s: float = 3600.0
    # In-allocation mode (the launcher recovers node deaths inside the job's allocation): a node
    # of the job that Slurm shows DOWN and that the launcher has not fenced is left to the
    # launcher this long after the watcher first saw it DOWN; then the job is recovered as any
    # other (requeued without the node). The batch host's death is never waited on.
    allocation_grace_s: float = 60.0
    # The run's lease (watch/lease.json, beside flock, which NFS/Lustre may keep node-local):
    # renewed every lease_s/4; a watcher on another host takes the run over only after lease_s
    # without renewal. At least 4 poll cycles and 2 minutes (the loop backs off up to 60 s while
    # Slurm does not answer).
    lease_s: float = 300.0

    def __post_init__(self) -> None:
        # Each cycle is two controller RPCs per watcher: a floor keeps a typo (--poll 0.001) from
        # becoming thousands of RPCs a second at slurmctld.
        if not self.poll_s >= MIN_POLL_S:
            raise ValueError(f"poll_s must be >= {MIN_POLL_S:g} s (each cycle queries slurmctld), "
                             f"got {self.poll_s}")
        positive = ("hang_factor", "hang_min_s", "straggler_factor", "checkpoint_overdue_factor")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        non_negative = ("checkpoint_overdue_min_s", "node_fault_fade_s", "admin_drain_wait_s",
                        "allocation_grace_s",
                        "hang_timeout_s", "clock_skew_s",
                        "startup_grace_s", "pending_warn_s", "start_now_delay_s")
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lease_s >= max(120.0, 4 * self.poll_s):
            raise ValueError(f"lease_s must be >= 120 s and >= 4 x poll_s, got {self.lease_s}")
        if self.admin_drain not in ADMIN_DRAIN:
            raise ValueError(f"admin_drain must be one of {', '.join(ADMIN_DRAIN)}, "
                             f"got {self.admin_drain!r}")
        at_least_one = ("straggler_window", "max_restarts", "max_restarts_per_cause",
                        "crash_loop_restarts", "repeat_offender_faults")
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
