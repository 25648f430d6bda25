"""``python -m slurmft.launch.nodecheck``: the pre-flight of ONE node, run there by ``srun``.

It prints one line per finding, then ``DONE <node>`` (the launcher counts a node without that
line as one that did not answer):

  ``FAIL <node> <check>: <detail>``  a check ran and failed: the node is excluded
  ``SKIP <node> <check>: <detail>``  a check could not run or give a verdict: journaled, not held
                                      against the node
  ``PORT <node> <port>``             a TCP port free on this node (the rendezvous uses node 0's)

Checks, each a subprocess under the time left before ``--deadline-s``: ``python -m
slurmft.train.runtime preflight`` (run dir writable, free disk, torch imports; one that does not
finish in time FAILS: a hung mount is what it is there to catch), then ``slurmft sweep --quick
--dry-run --json`` as ``python -m slurmft.sweep.main`` (the command without typer's start-up,
~40 % of its CPU, on every node of every job start). A sweep that exits 3 with no output is busy (another job's pre-flight, the cron
sweep): its fresh report is used if it wrote one, else it is retried until ``--sweep-wait-s``.
Torch-free (torch is imported by the child that checks it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from slurmft import subproc
from slurmft.launch.settings import MIN_SWEEP_RETRY_S

SWEEP_LOCKED = 3          # slurmft sweep: another sweep for this node is running
MAX_OUTPUT = 1 << 20      # bytes of a child's output we keep
MAX_REPORT = 1 << 20


# The rendezvous port is found free here and bound by torchrun's store seconds later. A port the
# kernel hands out for port 0 lies in its ephemeral range, where any outbound connection on the
# node may take it in between (seen: EADDRINUSE for the store, 4 devclusters' traffic on one box);
# one below that range can be taken only by another listener.
LISTEN_LOW = 10000
PORT_TRIES = 64
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if 1024 < low <= 65535 else 32768


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port free on this node for listening: a random one below the ephemeral range when
    one of ``PORT_TRIES`` is free there, else one the kernel picks."""
    rng = rng or random.SystemRandom()
    high = ephemeral_low() - 1
    if high > LISTEN_LOW:
        for _ in range(PORT_TRIES):
            port = rng.randint(LISTEN_LOW, high)
            with socket.socket() as sock:
                try:
                    sock.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def run_bounded(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """(rc, stdout, stderr); rc None when it did not finish within ``timeout`` (its group killed;
    a child stuck in the kernel on a hung mount is abandoned, not waited for)."""
    try:
        proc = subproc.run_bounded(argv, max(timeout, 0.1))
    except OSError as exc:
        return 127, "", f"{argv[0]}: {exc.strerror or exc}"
    return (proc.returncode, proc.stdout[:MAX_OUTPUT].decode(errors="replace"),
            proc.stderr[-4096:].decode(errors="replace"))


def sweep_failures(node: str, report: object) -> list[str]:
    """FAIL lines for the checks of a sweep report that ran and failed."""
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        return [f"SKIP {node} sweep: its report has no results list"]
    lines = []
    for result in report["results"]:
        if isinstance(result, dict) and result.get("status") == "fail":
            detail = " ".join(str(result.get("detail", "")).split())[:300]
            lines.append(f"FAIL {node} sweep: {result.get('check')}: {detail}")
    return lines


def fresh_report(node: str, fresh_s: float, now: float | None = None) -> dict | None:
    """The node's last sweep report if written by a real (not dry-run) sweep in the last
    ``fresh_s`` seconds, from the sweeper's configured ``report_dir``; None otherwise."""
    try:
        from slurmft.config import load_section
        from slurmft.sweep.config import SweepConfig
        from slurmft.sweep.report import report_path

        path = report_path(load_section(SweepConfig, "sweep").report_dir, node)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > MAX_REPORT:
                return None
            if (time.time() if now is None else now) - st.st_mtime > fresh_s:
                return None
            data = os.read(fd, MAX_REPORT)
        finally:
            os.close(fd)
        report = json.loads(data)
    except Exception:  # no config, no file, unreadable, not JSON: there is no fresh report
        return None
    return report if isinstance(report, dict) and report.get("node") == node else None


def sweep_lines(node: str, python: str, deadline: float, wait_s: float, fresh_s: float,
                run: Callable[[list[str], float], tuple[int | None, str, str]] = run_bounded,
                sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> list[str]:
    argv = [python, "-m", "slurmft.sweep.main", "--quick", "--dry-run", "--json", "--node", node]
    started = clock()
    busy_until = started + wait_s
    delay = MIN_SWEEP_RETRY_S
    waited: list[str] = []
    while True:
        rc, out, err = run(argv, deadline - clock())
        if rc is None:
            return [f"SKIP {node} sweep: no verdict within the pre-flight's time"]
        if rc == SWEEP_LOCKED and not out.strip():
            waited = [f"NOTE {node} sweep: another sweep held this node's lock; waited "
                      f"{clock() - started:.1f} s for it"]
            report = fresh_report(node, fresh_s)
            if report is not None:
                return sweep_failures(node, report) + [f"NOTE {node} sweep: busy; judged by its "
                                                       "report from the last sweep"]
            if clock() + delay >= min(busy_until, deadline):
                return [f"SKIP {node} sweep: another sweep held this node's lock for {wait_s:g} s "
                        "and left no fresh report: not judged"]
            sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        try:
            report = json.loads(out)
        except (ValueError, RecursionError):
            tail = " ".join(err.split())[-200:]
            return [f"SKIP {node} sweep: no report (exit {rc}: {tail or 'no output'})"]
        return sweep_failures(node, report) + waited


def check_node(node: str, run_dir: Path, min_free_gb: float, deadline_s: float, wait_s: float,
               fresh_s: float, python: str = sys.executable,
               run: Callable[[list[str], float], tuple[int | None, str, str]] = run_bounded) -> list[str]:
    deadline = time.monotonic() + deadline_s
    lines = [f"PORT {node} {free_port()}"]
    rc, out, err = run([python, "-m", "slurmft.train.runtime", "preflight", str(run_dir),
                        "--min-free-gb", repr(min_free_gb)], deadline - time.monotonic())
    if rc is None:
        # "hung", not "run-dir": a mount that hangs is the node's trouble, not the job's own.
        lines.append(f"FAIL {node} hung: the run-dir/disk/torch check did not finish within "
                     f"{deadline_s:g} s (hung filesystem?)")
    else:
        found = [l for l in out.splitlines() if l.startswith(("FAIL ", "OK "))]
        lines += [l for l in found if l.startswith("FAIL ")]
        if not found:
            tail = " ".join(err.split())[-200:]
            lines.append(f"FAIL {node} preflight: the node check crashed (exit {rc}: {tail})")
    lines += sweep_lines(node, python, deadline, min(wait_s, deadline_s), fresh_s)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurmft.launch.nodecheck")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--min-free-gb", type=float, required=True)
    parser.add_argument("--deadline-s", type=float, required=True)
    parser.add_argument("--sweep-wait-s", type=float, required=True)
    parser.add_argument("--sweep-fresh-s", type=float, required=True)
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]
    for line in check_node(node, args.run_dir, args.min_free_gb, args.deadline_s, args.sweep_wait_s,
                           args.sweep_fresh_s):
        print(line, flush=True)
    print(f"DONE {node}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
