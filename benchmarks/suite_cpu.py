"""Where the test suite's CPU goes: each test's CPU-seconds, with everything its worker started
(the devcluster's daemons, the jobs, the ranks), not only its wall time.

On 2 cores the suite was bound by its CPU until 2026-11-29 (issue 28; since then by its tests'
waits, over six workers): pytest's ``--durations`` ranks tests by wall time, which on a busy box
is partly the others' CPU. This runs pytest under
xdist with a cgroup per worker (``_suite_cpu_plugin``) and ranks tests and modules by what they
burnt.

    python benchmarks/suite_cpu.py [--workers 6] [--top 20] [--out FILE] [--json] [-- PYTEST_ARGS]

PYTEST_ARGS default to the whole suite as ``make test`` runs it (``--dist loadgroup``). Needs
root and a writable cgroup hierarchy (cgroup v2's ``cpu.stat``, else v1's ``cpuacct``): a clear
one-line error and exit 2 otherwise. The cgroups are made under this process's own (a Slurm
job's or a systemd scope's limits still hold). Prints a table (``--json``: one JSON object);
``--out`` also keeps the per-test lines. Exit 1 when pytest failed (the figures are still
printed: they describe a failed run), 0 otherwise. At the end every process still in the
workers' cgroups (left running by the suite, or by pytest stopped at its bound) is counted
(``left_behind``) and killed, and the cgroups are removed.
"""

from __future__ import annotations

import argparse
import collections
import json
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _suite_cpu_plugin import CGROUP_ENV, KIND_ENV, OUT_ENV, PYTHONPATH_ENV, usage_s  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PLUGIN = "_suite_cpu_plugin"
RUN_BOUND_S = 3 * 3600   # a suite still running after this is stuck, not slow


class CgroupError(RuntimeError):
    pass


def cpu_hierarchy(mountinfo: str) -> tuple[str, Path]:
    """("v2", mount) of a cgroup2 mount, else ("v1", mount) of the v1 hierarchy with cpuacct,
    from ``/proc/self/mountinfo``'s text; CgroupError when there is neither."""
    v1 = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = Path(fields[4].replace("\\040", " "))
        fstype, _, options = line.split(" - ", 1)[1].split(" ", 2)
        if fstype == "cgroup2":
            return "v2", mount
        if fstype == "cgroup" and v1 is None and "cpuacct" in options.split()[-1].split(","):
            v1 = mount
    if v1 is not None:
        return "v1", v1
    raise CgroupError("no cgroup v2 mount and no v1 cpuacct mount in /proc/self/mountinfo")


def own_cgroup(kind: str, proc_cgroup: str) -> str:
    """This process's cgroup in the hierarchy ``kind`` from ``/proc/self/cgroup``'s text ("/"
    when the line is missing)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if (kind == "v2" and controllers == "") or (kind == "v1" and "cpuacct" in controllers.split(",")):
            return path or "/"
    return "/"


def make_parent(kind: str, mount: Path, own: str) -> Path:
    """A cgroup of this run's under ``own`` (this process's cgroup, relative to ``mount``)."""
    parent = mount / own.lstrip("/") / f"slurmft-suite-cpu-{os.getpid()}"
    try:
        parent.mkdir()
    except OSError as exc:
        hint = ": run as root" if exc.errno in (errno.EACCES, errno.EPERM) else ""
        raise CgroupError(f"cannot make the cgroup {parent} ({exc.strerror}){hint}") from None
    try:
        usage_s(parent, kind)
    except (OSError, RuntimeError, ValueError) as exc:
        parent.rmdir()
        raise CgroupError(f"the cgroup {parent} has no CPU counter ({exc})") from None
    return parent


KILL_WAIT_S = 10.0


def remove(parent: Path) -> int:
    """Kill every process still in the workers' cgroups and ``parent`` (left running by the
    suite, or by a pytest stopped at its bound: its workers, their clusters and jobs), then remove
    the cgroups. Returns how many processes there were; says so when a cgroup stays."""
    left = 0
    for cgroup in [*sorted(p for p in parent.iterdir() if p.is_dir()), parent]:
        seen: set[str] = set()
        deadline = time.monotonic() + KILL_WAIT_S
        while pids := set((cgroup / "cgroup.procs").read_text().split()):
            seen |= pids
            if time.monotonic() > deadline:
                break
            for pid in pids:   # a process forked meanwhile is in the next read
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        left += len(seen)
        try:
            cgroup.rmdir()
        except OSError as exc:
            print(f"suite_cpu: cannot remove the cgroup {cgroup} ({exc.strerror})", file=sys.stderr)
    return left


def _name(nodeid: str) -> str:
    """A test's id without xdist's ``@group`` suffix (``--dist loadgroup``)."""
    tail = nodeid.rpartition("::")[2]
    return nodeid[:nodeid.rindex("@")] if "@" in tail and not tail.endswith("]") else nodeid


def summarize(records: list[dict], workers_cpu_s: float, wall_s: float, top: int) -> dict:
    by_module: collections.Counter[str] = collections.Counter()
    by_kind: collections.Counter[str] = collections.Counter()
    for r in records:
        module = r["id"].split("::", 1)[0]
        by_module[module] += r["cpu_s"]
        by_kind[module.split("/")[1] if module.count("/") >= 2 else module] += r["cpu_s"]
    tests_cpu = sum(r["cpu_s"] for r in records)
    ranked = sorted(records, key=lambda r: -r["cpu_s"])
    return {
        "tests": len(records),
        "not_passed": [f"{_name(r['id'])} ({r['outcome']})" for r in records
                       if r["outcome"] not in ("passed",) and "skipped" not in r["outcome"]],
        "wall_s": round(wall_s, 1),
        "workers_cpu_s": round(workers_cpu_s, 1),
        "tests_cpu_s": round(tests_cpu, 1),
        "cores_busy": round(workers_cpu_s / wall_s, 2) if wall_s > 0 else None,
        "by_kind": {k: round(v, 1) for k, v in by_kind.most_common()},
        "top_tests": [{"id": _name(r["id"]), "cpu_s": r["cpu_s"], "wall_s": r["wall_s"]}
                      for r in ranked[:top]],
        "top_modules": [{"module": m, "cpu_s": round(c, 1)} for m, c in by_module.most_common(top)],
    }


def table(result: dict) -> str:
    lines = [f"{result['tests']} tests in {result['wall_s']:.0f} s; the workers' trees spent "
             f"{result['workers_cpu_s']:.0f} CPU-s ({result['cores_busy']} cores busy on average), "
             f"{result['tests_cpu_s']:.0f} of them inside a test",
             "by kind: " + ", ".join(f"{k} {v:.0f} CPU-s" for k, v in result["by_kind"].items()),
             "", "| test | CPU-s | wall s |", "| --- | ---: | ---: |"]
    lines += [f"| {t['id']} | {t['cpu_s']:.1f} | {t['wall_s']:.0f} |" for t in result["top_tests"]]
    lines += ["", "| module | CPU-s |", "| --- | ---: |"]
    lines += [f"| {m['module']} | {m['cpu_s']:.0f} |" for m in result["top_modules"]]
    if result["left_behind"]:
        lines.append(f"\n{result['left_behind']} process(es) were still in the workers' cgroups "
                     "after pytest ended: the suite left them running")
    lines += [f"NOT PASSED: {t}" for t in result["not_passed"]]
    return "\n".join(lines)


def run(workers: int, pytest_args: list[str], out: Path, parent: Path, kind: str) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    env.update({CGROUP_ENV: str(parent), KIND_ENV: kind, OUT_ENV: str(out)})
    env[PYTHONPATH_ENV] = env.get("PYTHONPATH", "")   # the plugin puts it back in the workers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                                    env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", PLUGIN, "-n", str(workers),
            "--dist", "loadgroup", *pytest_args]
    start = time.monotonic()
    try:
        # pytest's own output goes to stderr: stdout is the table or the JSON object alone
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=sys.stderr, timeout=RUN_BOUND_S,
                            check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"suite_cpu: pytest still ran after {RUN_BOUND_S} s: stopped", file=sys.stderr)
        rc = 124
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=6, help="pytest-xdist workers (6, as make test)")
    parser.add_argument("--top", type=int, default=20, help="tests and modules listed (20)")
    parser.add_argument("--out", type=Path, help="also keep every test's line (JSON lines) here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's (default: the suite)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.top < 1:
        parser.error("--workers and --top must be at least 1")
    if args.out is not None and not os.access(args.out.parent or Path("."), os.W_OK):
        print(f"suite_cpu: --out {args.out}: its directory is missing or not writable", file=sys.stderr)
        return 2
    try:
        with open("/proc/self/mountinfo") as fh:
            kind, mount = cpu_hierarchy(fh.read())
        with open("/proc/self/cgroup") as fh:
            own = own_cgroup(kind, fh.read())
        parent = make_parent(kind, mount, own)
    except (OSError, CgroupError) as exc:
        print(f"suite_cpu: {exc}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    try:
        lines = tmp / "tests.jsonl"
        rc, wall = run(args.workers, args.pytest_args, lines, parent, kind)
        workers_cpu = sum(usage_s(p, kind) for p in parent.iterdir() if p.is_dir())
        left = remove(parent)
        records = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
        if args.out is not None and lines.exists():
            shutil.copyfile(lines, args.out)
    finally:
        if parent.exists():
            remove(parent)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {**summarize(records, workers_cpu, wall, args.top), "workers": args.workers,
              "pytest_rc": rc, "left_behind": left, "cgroup": kind, "cgroup_dir": str(parent)}
    print(json.dumps(result) if args.json else table(result))
    if rc != 0:
        print(f"suite_cpu: pytest failed (rc {rc}): the figures describe a failed run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
