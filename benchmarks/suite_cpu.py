"""Where the test suite's CPU goes: each test's CPU-seconds, with everything its worker started
(the devcluster's daemons, the jobs, the ranks), not only its wall time.

On 2 cores the suite is bound by CPU, not by waiting (issue 28): pytest's ``--durations`` ranks
tests by wall time, which on a saturated box is mostly the others' CPU. This runs pytest under
xdist with a cgroup per worker (``_suite_cpu_plugin``) and ranks tests and modules by what they
burnt.

    python benchmarks/suite_cpu.py [--workers 4] [--top 20] [--out FILE] [--json] [-- PYTEST_ARGS]

PYTEST_ARGS default to the whole suite as ``make test`` runs it (``--dist loadgroup``). Needs
root and a writable cgroup hierarchy (cgroup v2's ``cpu.stat``, else v1's ``cpuacct``): a clear
one-line error and exit 2 otherwise. Prints a table (``--json``: one JSON object); ``--out``
also keeps the per-test lines. Exit 1 when pytest failed (the figures are still printed: they
describe a failed run), 0 otherwise. The cgroups are removed at the end; processes the suite
left running are moved out first and counted (``left_behind``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _suite_cpu_plugin import CGROUP_ENV, KIND_ENV, OUT_ENV, usage_s  # noqa: E402

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


def make_parent(kind: str, mount: Path) -> Path:
    parent = mount / f"slurmft-suite-cpu-{os.getpid()}"
    try:
        parent.mkdir()
        usage_s(parent, kind)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CgroupError(f"cannot make a cgroup under {mount} ({exc}): run as root") from None
    return parent


def remove(parent: Path, mount: Path) -> int:
    """Remove the workers' cgroups and ``parent``; processes still in them (left behind by the
    suite) move to the hierarchy's root first. Returns how many there were."""
    left = 0
    for cgroup in [*sorted(p for p in parent.iterdir() if p.is_dir()), parent]:
        pids = (cgroup / "cgroup.procs").read_text().split()
        left += len(pids)
        for pid in pids:
            try:
                (mount / "cgroup.procs").write_text(pid)
            except OSError:
                pass   # it ended meanwhile
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return left


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
        "not_passed": [f"{r['id']} ({r['outcome']})" for r in records
                       if r["outcome"] not in ("passed",) and "skipped" not in r["outcome"]],
        "wall_s": round(wall_s, 1),
        "workers_cpu_s": round(workers_cpu_s, 1),
        "tests_cpu_s": round(tests_cpu, 1),
        "cores_busy": round(workers_cpu_s / wall_s, 2) if wall_s > 0 else None,
        "by_kind": {k: round(v, 1) for k, v in by_kind.most_common()},
        "top_tests": [{"id": r["id"].split("@", 1)[0], "cpu_s": r["cpu_s"], "wall_s": r["wall_s"]}
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
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (4, as make test)")
    parser.add_argument("--top", type=int, default=20, help="tests and modules listed (20)")
    parser.add_argument("--out", type=Path, help="also keep every test's line (JSON lines) here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's (default: the suite)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.top < 1:
        parser.error("--workers and --top must be at least 1")
    try:
        with open("/proc/self/mountinfo") as fh:
            kind, mount = cpu_hierarchy(fh.read())
        parent = make_parent(kind, mount)
    except (OSError, CgroupError) as exc:
        print(f"suite_cpu: {exc}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="suite-cpu-"))
    try:
        lines = tmp / "tests.jsonl"
        rc, wall = run(args.workers, args.pytest_args, lines, parent, kind)
        workers_cpu = sum(usage_s(p, kind) for p in parent.iterdir() if p.is_dir())
        left = remove(parent, mount)
        records = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
        if args.out is not None and lines.exists():
            shutil.copyfile(lines, args.out)
    finally:
        if parent.exists():
            remove(parent, mount)
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
