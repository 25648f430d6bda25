"""``DevCluster``: the handle on one throwaway real Slurm cluster (munge, MariaDB, slurmdbd,
slurmctld and N slurmd on 127.0.0.1), used by ``slurmft devcluster``, the tests and the demo.

``up`` validates everything before starting anything, records each daemon in the state file the
moment it starts, and on any failure (or Ctrl-C) stops what it started and removes its
/etc/hosts block before re-raising. ``down`` stops exactly the recorded processes plus the
step daemons and job processes of every node, and keeps only ``log/`` for post-mortems.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from slurmft.rundir import atomic_write_bytes
from slurmft.slurm.devcluster import daemons, hosts, query, revive, settle
from slurmft.slurm.devcluster.dirlock import dir_busy, dir_lock
from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.layout import ClusterState, Layout, load_state
from slurmft.slurm.devcluster.nodeprocs import kill_node_tree
from slurmft.slurm.devcluster.ports import choose_ports
from slurmft.slurm.devcluster.procs import ProcId, is_alive, is_stopped, reap_if_child, terminate
from slurmft.slurm.devcluster.release import (
    Binaries, daemon_env_from_environ, mariadb_version, slurm_version,
)
from slurmft.slurm.devcluster.render import (
    DEFAULT_MIN_JOB_AGE_S, DEFAULT_SLURMD_TIMEOUT_S, ConfSpec, check_min_job_age, check_partitions,
    check_proctrack, check_prolog, check_slurmd_timeout, render_slurm_conf, render_slurmdbd_conf,
)

DEFAULT_NODES = 3
# Every slurmd is a real daemon (~10 MB resident, one port, one log) and slurmctld pings each
# every few seconds; past a few dozen on one small box the controller's ping storms, not the
# tests, dominate. 64 covers any multi-node scenario a laptop or CI box can usefully run.
MAX_NODES = 64
UP_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
CPUS_PER_NODE = min(2, os.cpu_count() or 1)
MEMORY_MB_PER_NODE = 1000
# sun_path is 108 bytes; munged and mariadbd put their sockets under the cluster dir, and every
# slurmstepd one in its node's spool dir: <spool>/<node>/<node>_<job id>.<step id> (a throwaway
# cluster's job ids stay within 6 digits; the batch step's id is 4294967291). Too long, and every launch fails ("Unix socket path
# ... is too long"): Slurm holds the job, which never runs (a demo under an xdist worker's tmp dir).
SOCKET_PATH_MAX = 107
STEP_SOCKET = "{node}_999999.4294967291"
# ``down`` stops nodes first (they talk to slurmctld), then these, the database last.
SERVICE_STOP_ORDER = ("slurmctld", "slurmdbd", "mariadbd", "munged")


def slurmd_key(node: str) -> str:
    return f"slurmd-{node}"


def require_root() -> None:
    if os.geteuid() != 0:
        raise DevClusterError("devcluster needs root (slurmd runs jobs as any user and "
                              "/etc/hosts must be edited); run it with sudo")


def check_node_count(nodes: int) -> None:
    if not 1 <= nodes <= MAX_NODES:
        raise DevClusterError(f"--nodes {nodes}: must be between 1 and {MAX_NODES}")


def check_dir(layout: Layout, node_names: Sequence[str] = ("n1",)) -> None:
    """The directory ends up in slurm.conf (space-separated) and in unix socket paths."""
    text = str(layout.root)
    if any(c.isspace() or c in "#=\"'" for c in text):
        raise DevClusterError(f"--dir {text}: must not contain spaces, quotes, '#' or '='")
    odd = sorted({c for c in text if not (c.isascii() and (c.isalnum() or c in "._/+@%:,-"))})
    if odd:  # it is also printed for `eval "$(slurmft devcluster up)"`: no shell metacharacters
        raise DevClusterError(f"--dir {text}: must not contain {' '.join(map(repr, odd))} "
                              f"(only letters, digits and ._/+@%:,-)")
    steps = [layout.spool(n) / STEP_SOCKET.format(node=n) for n in node_names]
    longest = max(len(str(p).encode()) for p in (layout.munge_socket, layout.mysql_socket, *steps))
    if longest > SOCKET_PATH_MAX:
        raise DevClusterError(f"--dir {text}: too long, socket paths under it would exceed "
                              f"{SOCKET_PATH_MAX} bytes; use a shorter directory")
    if layout.root.exists() and not layout.root.is_dir():
        raise DevClusterError(f"--dir {text}: exists and is not a directory")


def live_processes(state: ClusterState) -> dict[str, ProcId]:
    return {name: p for name, p in state.processes.items() if is_alive(p)}


def _remove_owned_files(layout: Layout) -> None:
    """Remove everything ``up`` created except logs (and the lock file)."""
    for path in (layout.munge_dir, layout.run_dir, layout.state_dir, layout.spool_root,
                 layout.local_root, layout.mysql_datadir.parent):
        shutil.rmtree(path, ignore_errors=True)
    for path in (layout.slurm_conf, layout.slurmdbd_conf, layout.state_file):
        path.unlink(missing_ok=True)


class DevCluster:
    """A devcluster recorded in a directory. Get one with :meth:`up` or :meth:`attach`."""

    def __init__(self, layout: Layout, state: ClusterState, binaries: Binaries) -> None:
        self._layout = layout
        self._state = state
        self._bins = binaries
        # Nodes the last reset restarted or found not responding and did not see back (see revive).
        self._unanswered: set[str] = set()

    # -- what callers read ---------------------------------------------------------------
    @property
    def dir(self) -> Path:
        return self._layout.root

    @property
    def node_names(self) -> list[str]:
        return list(self._state.node_names)

    @property
    def cluster_name(self) -> str:
        return self._state.cluster_name

    @property
    def slurm_version(self) -> tuple[int, int, int]:
        return self._state.slurm_version

    @property
    def slurm_conf(self) -> Path:
        return self._layout.slurm_conf

    @property
    def log_dir(self) -> Path:
        return self._layout.log_dir

    @property
    def local_dir(self) -> str:
        """``[checkpoint] local_dir`` for jobs on this cluster: every node its own directory."""
        return str(self._layout.local_root / "{node}")

    @property
    def env(self) -> dict[str, str]:
        """Environment overlay for Slurm commands (sbatch, squeue, ...) against this cluster."""
        return {"SLURM_CONF": str(self._layout.slurm_conf)}

    def exports(self) -> str:
        return "".join(f"export {k}={v}\n" for k, v in self.env.items())

    def processes(self) -> dict[str, ProcId]:
        """The daemons this cluster started, by name (``slurmctld``, ``slurmd-n1``, ...)."""
        return dict(self._state.processes)

    def is_running(self) -> bool:
        return bool(live_processes(self._state))

    # -- life cycle ----------------------------------------------------------------------
    @classmethod
    def up(cls, dir: str | os.PathLike[str], nodes: int = DEFAULT_NODES, *,
           port_base: int | None = None, daemon_env: Mapping[str, str] | None = None,
           timeout: float = UP_TIMEOUT_S,
           min_job_age_s: int = DEFAULT_MIN_JOB_AGE_S,
           slurmd_timeout_s: int = DEFAULT_SLURMD_TIMEOUT_S,
           partitions: Mapping[str, Sequence[str]] | None = None,
           prolog: str | None = None, proctrack: str = "linuxproc") -> "DevCluster":
        """Start a cluster of ``nodes`` nodes (n1..nN) in ``dir``; return once all are IDLE.
        ``daemon_env`` is added to every daemon's environment (default: from
        ``$SLURMFT_DEVCLUSTER_DAEMON_ENV``). ``min_job_age_s`` is slurm.conf's MinJobAge: how
        long the controller keeps an ended job before it forgets it; ``slurmd_timeout_s`` its
        SlurmdTimeout: how long a silent node stays up before it is called DOWN; ``partitions``
        name -> its nodes (the first is the default; default: one ``debug`` of every node);
        ``prolog`` slurm.conf's ``Prolog=``, a program every slurmd runs before a job's first
        launch on its node (``$SLURMD_NODENAME`` names the node; a non-zero exit is a failed
        prolog); ``proctrack`` its ProctrackType (``linuxproc``, or ``pgid``: a step's signal
        reaches only each task's process group)."""
        check_node_count(nodes)
        node_names = [f"n{i}" for i in range(1, nodes + 1)]
        try:
            check_min_job_age(min_job_age_s)
            check_slurmd_timeout(slurmd_timeout_s)
            parts = check_partitions(partitions, node_names)
            check_prolog(prolog)
            check_proctrack(proctrack)
        except ValueError as exc:
            raise DevClusterError(str(exc)) from None
        if daemon_env is None:
            daemon_env = daemon_env_from_environ(os.environ)
        layout = Layout(Path(dir).absolute())
        check_dir(layout, node_names)
        require_root()
        bins = Binaries.find()
        versions = (slurm_version(bins), mariadb_version(bins))
        ports = choose_ports(node_names, port_base)
        with dir_lock(layout):
            if layout.state_file.exists():
                old = load_state(layout)
                if live_processes(old):
                    raise DevClusterError(f"{layout.root} already holds a running devcluster "
                                          f"({old.cluster_name}); run `slurmft devcluster down "
                                          f"--dir {layout.root}` first")
                hosts.remove_cluster(old.cluster_name)
            _remove_owned_files(layout)
            shutil.rmtree(layout.log_dir, ignore_errors=True)  # a new cluster, new logs
            state = ClusterState(cluster_name=f"sft{secrets.token_hex(4)}",
                                 node_names=node_names, ports=ports, slurm_version=versions[0],
                                 daemon_env=dict(daemon_env or {}))
            cluster = cls(layout, state, bins)
            try:
                cluster._start(versions[1], timeout, min_job_age_s, slurmd_timeout_s, parts, prolog,
                               proctrack)
            except BaseException:
                cluster._stop_all()
                raise
            return cluster

    @classmethod
    def attach(cls, dir: str | os.PathLike[str], *, running: bool = True) -> "DevCluster":
        """The cluster recorded in ``dir``. With ``running`` (the default) it is an error when
        none of its daemons is alive; ``running=False`` is for cleaning up after a crash."""
        layout = Layout(Path(dir).absolute())
        state = load_state(layout)
        cluster = cls(layout, state, Binaries.find())
        if running and not cluster.is_running():
            raise DevClusterError(f"the devcluster in {layout.root} is not running (no recorded "
                                  "daemon is alive); `down` cleans it up, `up` starts a new one")
        return cluster

    def down(self) -> None:
        """Stop every process of this cluster, remove its /etc/hosts block and its files
        (except ``log/``). Safe to call twice."""
        with dir_lock(self._layout):
            self._stop_all()

    def _daemon_env(self, node: str | None = None) -> dict[str, str]:
        env = {**daemons.base_env(os.environ), **self._state.daemon_env, **self.env}
        if node is not None:
            env[daemons.NODE_MARK_ENV] = f"{self.cluster_name}:{node}"
        return env

    def _client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _record(self, name: str, proc: ProcId) -> None:
        self._state.processes[name] = proc
        self._state.save(self._layout)

    def _services(self, mariadb_ver: tuple[int, int, int]) -> dict[str, daemons.Service]:
        found = daemons.services(self._bins, self._layout, self._state.ports, mariadb_ver)
        return {service.name: service for service in found}

    def _spawn(self, service: daemons.Service) -> ProcId:
        proc = daemons.spawn(self._layout, service.name, service.argv, self._daemon_env())
        self._record(service.name, proc)
        return proc

    def _start(self, mariadb_ver: tuple[int, int, int], timeout: float, min_job_age_s: int,
               slurmd_timeout_s: int, partitions=None, prolog: str | None = None,
               proctrack: str = "linuxproc") -> None:
        lay, st, bins = self._layout, self._state, self._bins
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        lay.make_dirs(st.node_names)
        st.save(lay)  # from here on, `down` can undo whatever happens
        st.hosts_names = hosts.add_cluster(st.cluster_name, lay.root, st.node_names,
                                           is_stale=_block_is_stale)
        st.save(lay)
        password = secrets.token_hex(16)
        spec = ConfSpec(layout=lay, cluster_name=st.cluster_name, node_names=st.node_names,
                        ports=st.ports, cpus_per_node=CPUS_PER_NODE,
                        memory_mb_per_node=MEMORY_MB_PER_NODE, db_password=password,
                        min_job_age_s=min_job_age_s, slurmd_timeout_s=slurmd_timeout_s,
                        partitions=partitions, prolog=prolog, proctrack=proctrack)
        atomic_write_bytes(lay.slurm_conf, render_slurm_conf(spec).encode())
        atomic_write_bytes(lay.slurmdbd_conf, render_slurmdbd_conf(spec).encode(), mode=0o600)
        daemons.write_munge_key(lay)
        services = self._services(mariadb_ver)
        env = self._daemon_env()

        munged = self._spawn(services["munged"])
        daemons.install_mariadb(bins, lay, env)  # meanwhile munged comes up
        self._wait_service(services["munged"], munged, left())
        self._wait_service(services["mariadbd"], self._spawn(services["mariadbd"]), left())
        daemons.bootstrap_database(bins, lay, password, env)
        for name in ("slurmdbd", "slurmctld"):
            self._wait_service(services[name], self._spawn(services[name]), left())
        for node in st.node_names:
            self._spawn_slurmd(node)
        self._wait_nodes(lambda n: n.idle, left(), "every node IDLE", watch_slurmds=True)
        st.ready = True
        st.save(lay)

    @staticmethod
    def _wait_service(service: daemons.Service, proc: ProcId, timeout: float) -> None:
        daemons.wait_until(service.name, proc, service.ready, timeout, service.logs, service.what)

    def _spawn_slurmd(self, node: str, stepd: str | None = None) -> ProcId:
        key = slurmd_key(node)
        argv = daemons.slurmd_argv(self._bins, self._layout, node, stepd)
        proc = daemons.spawn(self._layout, key, argv, self._daemon_env(node))
        self._record(key, proc)
        return proc

    def _stop_all(self) -> None:
        """Stop everything recorded (nodes with their job trees first), then clean up."""
        st = self._state
        stubborn: list[ProcId] = []
        for node in st.node_names:
            stubborn += kill_node_tree(st.cluster_name, node, st.processes.get(slurmd_key(node)),
                                       daemons.NODE_MARK_ENV)
        for name in SERVICE_STOP_ORDER:
            if name in st.processes:
                stubborn += terminate([st.processes[name]], STOP_GRACE_S)
        hosts.remove_cluster(st.cluster_name)
        if stubborn:
            # Keep the state file so a later `down` can try again; say exactly what is left.
            raise DevClusterError("could not stop pid(s) "
                                  + ", ".join(str(p.pid) for p in stubborn))
        _remove_owned_files(self._layout)

    # -- nodes ---------------------------------------------------------------------------
    def _check_node(self, name: str) -> None:
        if name not in self._state.node_names:
            raise DevClusterError(f"unknown node {name!r}; this cluster has "
                                  f"{', '.join(self._state.node_names)}")

    def kill_node(self, name: str) -> None:
        """A real node death: SIGKILL the node's slurmd, its slurmstepds and its job processes."""
        self._check_node(name)
        left = kill_node_tree(self.cluster_name, name, self._state.processes.get(slurmd_key(name)),
                              daemons.NODE_MARK_ENV)
        if left:
            raise DevClusterError(f"node {name}: could not kill pid(s) "
                                  + ", ".join(str(p.pid) for p in left))

    def node_alive(self, name: str) -> bool:
        """Whether the node's slurmd process runs (not what the controller thinks)."""
        self._check_node(name)
        proc = self._state.processes.get(slurmd_key(name))
        if proc is not None:
            reap_if_child(proc.pid)
        return proc is not None and is_alive(proc)

    def start_node(self, name: str, wait_timeout: float | None = 30.0, *,
                   stepd: str | None = None) -> None:
        """Restart the node's slurmd (no-op if it runs); wait until the controller hears from it
        again (with ReturnToService=1 a DOWN node then returns to service by itself). ``stepd``:
        launch jobs with this program instead of slurmstepd (``slurmd -d``): a path that cannot
        run makes a node that answers pings but fails every launch."""
        if not self.node_alive(name):
            self._spawn_slurmd(name, stepd)
        if wait_timeout is not None:
            self._wait_nodes(lambda n: n.name != name or "NOT_RESPONDING" not in n.flags,
                             wait_timeout, f"node {name} responding")

    def nodes(self) -> dict[str, query.NodeStatus]:
        return query.node_states(self._bins.scontrol, self._client_env())

    def jobs(self) -> list[query.JobStatus]:
        return query.jobs(self._bins.squeue, self._client_env())

    def wait_nodes_idle(self, timeout: float = IDLE_TIMEOUT_S) -> None:
        self._wait_nodes(lambda n: n.idle, timeout, "every node IDLE")

    def _wait_nodes(self, ok: Callable[[query.NodeStatus], bool], timeout: float, what: str,
                    watch_slurmds: bool = False) -> None:
        deadline = time.monotonic() + timeout
        last: dict[str, query.NodeStatus] = {}
        while True:
            try:
                last = self.nodes()
            except DevClusterError:
                last = {}  # the controller may be (re)starting: keep polling until the deadline
            if len(last) == len(self._state.node_names) and all(ok(n) for n in last.values()):
                return
            if watch_slurmds:
                for node in self._state.node_names:
                    if not self.node_alive(node):
                        raise daemons.DaemonFailed(f"slurmd of {node} exited before {what}\n"
                                                   + daemons.log_tail(daemons.slurmd_logs(self._layout, node)))
            if time.monotonic() >= deadline:
                seen = ", ".join(f"{n.name}={n.describe()}" for n in last.values()) or "no answer"
                raise DevClusterError(f"timed out after {timeout:.0f} s waiting for {what} "
                                      f"({seen}); logs in {self._layout.log_dir}")
            time.sleep(0.2)

    def reset(self, timeout: float = IDLE_TIMEOUT_S) -> None:
        """Back to a clean cluster from any state: restart dead daemons, cancel every job,
        resume nodes that are drained, failed or down once they have registered, until every
        node is IDLE (bounded by ``timeout``; see ``settle``). Cheap when already clean."""
        self._restart_dead_services(timeout)
        if self._is_clean():
            return
        done, unanswered, self._unanswered = revive.Revival(), self._unanswered, set()
        for name in self.node_names:
            self.node_alive(name)  # reaps it if it was our child and died
            revive.revive_node(self.cluster_name, name, self._state.processes.get(slurmd_key(name)),
                               daemons.NODE_MARK_ENV, lambda: self._spawn_slurmd(name), done,
                               unanswered=name in unanswered)
        env = self._client_env()
        self._unanswered = set(done.started) | self._not_responding()
        settle.settle(
            self.node_names, read_jobs=self.jobs, read_nodes=self.nodes,
            cancel=lambda ids: query.cancel(self._bins.scancel, ids, env),
            resume=lambda name: query.resume_node(self._bins.scontrol, name, env),
            timeout=timeout, logs=str(self._layout.log_dir),
            check=lambda: revive.check_started(done, lambda n: daemons.slurmd_logs(self._layout, n)),
            explain=lambda names: revive.explain(
                names, self.cluster_name, {n: self._state.processes.get(slurmd_key(n)) for n in names},
                daemons.NODE_MARK_ENV, done, lambda n: daemons.last_line(daemons.node_log(self._layout, n))))
        self._unanswered = set()

    def _not_responding(self) -> set[str]:
        try:
            return {name for name, node in self.nodes().items() if "NOT_RESPONDING" in node.flags}
        except DevClusterError:
            return set()

    def _is_clean(self) -> bool:
        try:
            jobs, nodes = self.jobs(), self.nodes()
        except DevClusterError:  # a controller just restarted: settle() polls it
            return False
        slurmds = [self._state.processes.get(slurmd_key(n)) for n in self.node_names]
        return (not jobs and all(n in nodes and nodes[n].idle for n in self.node_names)
                and all(self.node_alive(n) for n in self.node_names)
                and not any(p is not None and is_stopped(p) for p in slurmds))

    def _restart_dead_services(self, timeout: float) -> None:
        procs = self._state.processes
        dead = [n for n in reversed(SERVICE_STOP_ORDER) if n not in procs or not is_alive(procs[n])]
        if not dead:
            return
        services = self._services(mariadb_version(self._bins))
        for name in dead:
            self._wait_service(services[name], self._spawn(services[name]), timeout)


def _block_is_stale(block: hosts.Block) -> bool:
    """A hosts block whose directory no longer records that cluster as running. A cluster whose
    ``up`` is still under way (its lock held: state saved, block added, no daemon yet) is not:
    pruning it there took the block of a cluster starting beside ours (parallel test workers)."""
    layout = Layout(Path(block.directory))
    if dir_busy(layout):
        return False
    try:
        state = load_state(layout)
    except DevClusterError:
        return True
    return state.cluster_name != block.cluster or not live_processes(state)
