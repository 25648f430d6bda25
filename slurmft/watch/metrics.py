"""Prometheus metrics of ``slurmft watch``, in their own ``CollectorRegistry``: served on an
optional HTTP port (``--metrics-port``) and/or written as a node_exporter textfile
(``--textfile``). The alert rules in ``deploy/prometheus/slurmft-watch-alerts.yml`` use them.

The API the watch loop calls (every method is cheap and thread-safe; ``job`` is the job id)::

    m = WatchMetrics()
    m.watching(job)                        # a run is watched (run active = 1)
    m.record_fault(job, cause, detect_s)   # a fault was detected detect_s after it happened
    m.record_recovery(job, cause, recover_s)  # running again recover_s after the fault: a restart
    m.record_gave_up(job, cause)           # held, not requeued
    m.record_finished(job)                 # the run is over (run active = 0)
    m.set_ettr(job, 0.93)
    m.set_checkpoint(job, step, age_s)     # newest committed checkpoint and its age now
    m.set_controller_ok(True)              # did the last poll reach Slurm?
    m.forget(job)                          # drop every series of the job (a run let go)
    m.cycle(duration_s, observed=True)     # one poll cycle ended (observed: Slurm answered)
    m.on_event(kind, event)                # or: feed it the watcher's journal events instead
    m.serve(port)                          # HTTP on 127.0.0.1:port (returns the bound port)
    m.write_textfile(path)                 # atomic: temp name, fsync, rename

Wired into the loop: ``RunWatch(..., listeners=[m.on_event])`` and
``Watcher(..., on_cycle=lambda r: m.cycle(r.duration_s, observed=r.observed))``; the checkpoint
step and age come from the journal summary's newest commit; ETTR from ``slurmft.status``
(``build_report(...).ettr``: it reads the whole journal, so not every cycle).

Metrics (per-run ones are labelled ``slurm_job``: ``job`` is Prometheus's own target label):
  slurmft_watch_faults_total{slurm_job,cause,where}        faults detected
  slurmft_watch_restarts_total{slurm_job,cause,where}      restarts (running again after a fault)
  slurmft_watch_detect_seconds{slurm_job,cause,where}      histogram: fault -> detected
  slurmft_watch_recover_seconds{slurm_job,cause,where}     histogram: fault -> running again
    (where: "requeue", the watcher's recovery through Slurm, or "allocation", the in-allocation
    launcher's own, relayed from the run's journal: both kinds counted alike)
  slurmft_watch_gave_up{slurm_job}                         1 once the watcher gave up on the run
  slurmft_watch_run_active{slurm_job}                      1 while the run is watched and not over
  slurmft_watch_ettr{slurm_job}                            effective training time ratio (0..1)
  slurmft_watch_spare_nodes{slurm_job}                     in-allocation mode: hot spares left
  slurmft_watch_last_checkpoint_step{slurm_job}
  slurmft_watch_last_checkpoint_age_seconds{slurm_job}     as of the last cycle
  slurmft_watch_last_checkpoint_timestamp_seconds{slurm_job}  when it was committed (unix time)
  slurmft_watch_controller_reachable                       1 when the last poll reached Slurm
  slurmft_watch_last_successful_poll_timestamp_seconds     unix time of the last observed cycle
  slurmft_watch_cycle_duration_seconds                     histogram of poll cycle durations
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slurmft import journal
from slurmft.rundir import atomic_write_bytes

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

JOB = "slurm_job"
WHERE = "where"  # requeue | allocation
DETECT_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
RECOVER_BUCKETS = (5, 10, 20, 30, 60, 120, 180, 300, 600, 1800, 3600, 4 * 3600)
CYCLE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class MetricsError(RuntimeError):
    """The metrics cannot be served or written where asked; the message says where and why."""


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return max(float(value), 0.0)


class WatchMetrics:
    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._server: WSGIServer | None = None  # set by serve()
        self.registry = reg = CollectorRegistry()
        self.faults = Counter("slurmft_watch_faults", "Faults the watcher (or, in the allocation, "
                              "the launcher) detected", [JOB, "cause", WHERE], registry=reg)
        self.node_faults = Counter("slurmft_watch_node_faults", "Faults whose evidence named a node "
                                   "(the node a launch failed on, a DOWN or drained node...)",
                                   ["node", "cause"], registry=reg)
        self.restarts = Counter("slurmft_watch_restarts", "Runs running again after a fault",
                                [JOB, "cause", WHERE], registry=reg)
        self.detect = Histogram("slurmft_watch_detect_seconds", "Time from a fault to its detection",
                                [JOB, "cause", WHERE], buckets=DETECT_BUCKETS, registry=reg)
        self.recover = Histogram("slurmft_watch_recover_seconds",
                                 "Time from a fault to the job running again", [JOB, "cause", WHERE],
                                 buckets=RECOVER_BUCKETS, registry=reg)
        self.gave_up = Gauge("slurmft_watch_gave_up", "1 once the watcher gave up on the run (held)",
                             [JOB], registry=reg)
        self.active = Gauge("slurmft_watch_run_active", "1 while the run is watched and not over",
                            [JOB], registry=reg)
        self.ettr = Gauge("slurmft_watch_ettr", "Effective training time ratio of the run (0..1)",
                          [JOB], registry=reg)
        self.spares = Gauge("slurmft_watch_spare_nodes", "In-allocation mode: the hot spares the "
                            "run has left (allocation.json)", [JOB], registry=reg)
        self.ckpt_step = Gauge("slurmft_watch_last_checkpoint_step", "Step of the newest committed "
                               "checkpoint", [JOB], registry=reg)
        self.ckpt_age = Gauge("slurmft_watch_last_checkpoint_age_seconds", "Age of the newest "
                              "committed checkpoint at the last cycle", [JOB], registry=reg)
        self.ckpt_time = Gauge("slurmft_watch_last_checkpoint_timestamp_seconds", "When the newest "
                               "checkpoint was committed (unix time)", [JOB], registry=reg)
        self.controller = Gauge("slurmft_watch_controller_reachable", "1 when the last poll reached "
                                "the Slurm controller", registry=reg)
        self.last_poll = Gauge("slurmft_watch_last_successful_poll_timestamp_seconds",
                               "Unix time of the last poll cycle that observed Slurm", registry=reg)
        self.cycles = Histogram("slurmft_watch_cycle_duration_seconds", "Duration of poll cycles",
                                buckets=CYCLE_BUCKETS, registry=reg)

    # -- what the loop records ---------------------------------------------------------------------

    def watching(self, job: str) -> None:
        self.active.labels(str(job)).set(1)
        self.gave_up.labels(str(job)).set(0)

    def record_fault(self, job: str, cause: str, detect_s: float | None,
                     where: str = journal.WHERE_REQUEUE) -> None:
        self.faults.labels(str(job), str(cause), where).inc()
        seconds = _seconds(detect_s)
        if seconds is not None:
            self.detect.labels(str(job), str(cause), where).observe(seconds)

    def record_recovery(self, job: str, cause: str, recover_s: float | None,
                        where: str = journal.WHERE_REQUEUE) -> None:
        self.restarts.labels(str(job), str(cause), where).inc()
        seconds = _seconds(recover_s)
        if seconds is not None:
            self.recover.labels(str(job), str(cause), where).observe(seconds)

    def record_gave_up(self, job: str, cause: str) -> None:
        self.gave_up.labels(str(job)).set(1)
        self.active.labels(str(job)).set(0)

    def record_finished(self, job: str) -> None:
        self.active.labels(str(job)).set(0)

    def forget(self, job: str) -> None:
        """Drop every series labelled with ``job``: ``--all`` lets go of ended runs, and a watcher
        that runs for months must not keep the series of every job it ever saw."""
        for metric in (self.faults, self.restarts, self.detect, self.recover, self.gave_up,
                       self.active, self.ettr, self.ckpt_step, self.ckpt_age, self.ckpt_time,
                       self.spares):
            metric.remove_by_labels({JOB: str(job)})

    def set_ettr(self, job: str, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.ettr.labels(str(job)).set(min(max(value, 0.0), 1.0))

    def set_spares(self, job: str, count: int | None) -> None:
        """The run's spares left (None: not in in-allocation mode: no series)."""
        if count is None:
            self.spares.remove_by_labels({JOB: str(job)})
        else:
            self.spares.labels(str(job)).set(count)

    def set_checkpoint(self, job: str, step: int | None, age_s: float | None) -> None:
        age = _seconds(age_s)
        if step is None or age is None:
            return
        self.ckpt_step.labels(str(job)).set(step)
        self.ckpt_age.labels(str(job)).set(age)
        self.ckpt_time.labels(str(job)).set(self.clock() - age)

    def set_controller_ok(self, ok: bool) -> None:
        self.controller.set(1 if ok else 0)

    def cycle(self, duration_s: float, *, observed: bool = True) -> None:
        seconds = _seconds(duration_s)
        if seconds is not None:
            self.cycles.observe(seconds)
        self.set_controller_ok(observed)
        if observed:
            self.last_poll.set(self.clock())

    def on_event(self, kind: str, event: Mapping[str, Any]) -> None:
        """Record what a watcher journal event means (a listener for ``RunWatch``)."""
        job = event.get("job_id")
        if job is None:
            return

        def since_fault(at: Any) -> float | None:
            fault, when = _seconds(event.get("fault_time")), _seconds(at)
            return None if fault is None or when is None else when - fault

        where = (journal.WHERE_ALLOCATION if event.get(journal.WHERE) == journal.WHERE_ALLOCATION
                 else journal.WHERE_REQUEUE)
        if kind == journal.WATCH_STARTED:
            self.watching(job)
        elif kind == journal.FAULT_DETECTED:
            self.record_fault(job, event.get("cause") or "unknown", since_fault(event.get("time")), where)
            nodes = event.get("nodes")
            for node in nodes if isinstance(nodes, list) else ():
                if isinstance(node, str) and node:
                    self.node_faults.labels(node, str(event.get("cause") or "unknown")).inc()
        elif kind == journal.JOB_RUNNING:
            self.record_recovery(job, event.get("cause") or "unknown",
                                 since_fault(event.get("start_time") or event.get("time")), where)
        elif kind == journal.GAVE_UP:
            self.record_gave_up(job, event.get("cause") or "unknown")
        elif kind == journal.RUN_FINISHED:
            self.record_finished(job)

    # -- where they go ----------------------------------------------------------------------------

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; returns the port bound (0: any)."""
        from prometheus_client import start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise MetricsError(f"metrics port must be 0..65535, got {port!r}")
        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
        self._server = server
        return server.server_address[1]

    def stop(self) -> None:
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None

    def write_textfile(self, path: Path) -> None:
        """Write every metric to ``path`` for node_exporter's textfile collector, atomically."""
        path = Path(path)
        if path.suffix != ".prom":
            raise MetricsError(f"textfile {path} must end in .prom (node_exporter reads only those)")
        try:
            atomic_write_bytes(path, self.text())
        except OSError as exc:
            raise MetricsError(f"cannot write metrics to {path}: {exc.strerror or exc}") from None
