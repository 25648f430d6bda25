"""benchmarks/suite_cpu.py: which cgroup hierarchy it finds, its one-line refusal, and one real
run of pytest under it (a cgroup per worker, a test's CPU charged to it, a failing test named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import suite_cpu  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "cgroup"


def test_cgroup_v2_is_preferred_and_v1_cpuacct_is_the_fallback():
    hybrid = (FIXTURES / "mountinfo-hybrid-debian12-vm").read_text()
    assert suite_cpu.cpu_hierarchy(hybrid) == ("v2", Path("/sys/fs/cgroup/unified"))
    v1 = (FIXTURES / "mountinfo-v1-only").read_text()
    assert suite_cpu.cpu_hierarchy(v1) == ("v1", Path("/sys/fs/cgroup/cpuacct"))
    only_cpu = "\n".join(line for line in v1.splitlines() if "cpuacct" not in line)
    with pytest.raises(suite_cpu.CgroupError, match="no cgroup v2 mount and no v1 cpuacct"):
        suite_cpu.cpu_hierarchy(only_cpu)


def test_its_cgroups_go_under_its_own_in_either_hierarchy():
    here = (FIXTURES / "proc-self-cgroup-debian12-vm").read_text()
    assert suite_cpu.own_cgroup("v2", here) == "/" and suite_cpu.own_cgroup("v1", here) == "/"
    # the shape of the paths Slurm's cgroup plugins give a step (constructed: none runs here)
    in_job = "12:cpu,cpuacct:/slurm/uid_0/job_7/step_0\n0::/slurm/uid_0/job_7/step_0/user/task_0\n"
    assert suite_cpu.own_cgroup("v1", in_job) == "/slurm/uid_0/job_7/step_0"
    assert suite_cpu.own_cgroup("v2", in_job) == "/slurm/uid_0/job_7/step_0/user/task_0"


def test_xdist_group_suffixes_are_cut_and_parameters_kept():
    assert suite_cpu._name("tests/a.py::test_x@world") == "tests/a.py::test_x"
    assert suite_cpu._name("tests/a.py::test_x[u@h]@world") == "tests/a.py::test_x[u@h]"
    assert suite_cpu._name("tests/a.py::test_x[u@h]") == "tests/a.py::test_x[u@h]"


def test_without_a_cgroup_or_with_a_bad_out_it_says_so_in_one_line_and_runs_nothing(
        monkeypatch, capsys, tmp_path):
    def refuse(kind, mount, own):
        raise suite_cpu.CgroupError(f"cannot make the cgroup {mount}/x (Permission denied): run as root")

    ran = []
    monkeypatch.setattr(suite_cpu, "cpu_hierarchy", lambda text: ("v2", Path("/sys/fs/cgroup")))
    monkeypatch.setattr(suite_cpu, "make_parent", refuse)
    monkeypatch.setattr(suite_cpu, "run", lambda *a: ran.append(a))
    assert suite_cpu.main(["--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("suite_cpu: cannot make the cgroup ")
    assert suite_cpu.main(["--out", str(tmp_path / "missing" / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"suite_cpu: --out {tmp_path / 'missing' / 'x.jsonl'}: its directory is missing or not writable"
    assert ran == []


def _can_make_cgroups() -> bool:
    try:
        with open("/proc/self/mountinfo") as fh:
            kind, mount = suite_cpu.cpu_hierarchy(fh.read())
    except (OSError, suite_cpu.CgroupError):
        return False
    return os.geteuid() == 0 and os.access(mount, os.W_OK)


@pytest.mark.skipif(not _can_make_cgroups(), reason="needs root and a writable cgroup hierarchy")
@pytest.mark.timeout(300)
def test_a_run_charges_each_test_its_cpu_and_names_the_one_that_failed(tmp_path):
    tests = tmp_path / "test_spin.py"
    tests.write_text(
        "import subprocess, sys, time\n"
        "def test_spins_in_a_child():\n"   # CPU spent by a process the test started
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 1.0: pass'], check=True)\n"
        "def test_sleeps():\n"
        "    time.sleep(1.0)\n"
        "def test_fails():\n"
        "    assert False\n"
        "def test_sees_the_suites_environment():\n"   # not the benchmark's settings
        "    import os\n"
        "    assert not [k for k in os.environ if k.startswith('SLURMFT_SUITE_CPU')]\n"
        "    assert 'benchmarks' not in os.environ.get('PYTHONPATH', '')\n")
    lines = tmp_path / "lines.jsonl"
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), "--workers", "2", "--json",
         "--out", str(lines), "--", str(tests), "-p", "no:randomly", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'bt'}", f"--rootdir={tmp_path}", "-c", os.devnull],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})  # the outer run's options stay out
    assert res.returncode == 1, res.stderr[-3000:]
    assert "pytest failed (rc 1)" in res.stderr
    result = json.loads(res.stdout)
    assert result["tests"] == 4 and result["left_behind"] == 0
    assert result["not_passed"] == ["test_spin.py::test_fails (call failed)"]  # ids from its rootdir
    cpu = {t["id"].rsplit("::", 1)[1]: t["cpu_s"] for t in result["top_tests"]}
    assert cpu["test_spins_in_a_child"] >= 0.9          # the child's second is charged
    assert cpu["test_sleeps"] < 0.5 < cpu["test_spins_in_a_child"]
    assert result["workers_cpu_s"] >= result["tests_cpu_s"] >= 0.9
    assert len(lines.read_text().splitlines()) == 4
    assert Path(result["cgroup_dir"]).name.startswith("slurmft-suite-cpu-")
    assert not Path(result["cgroup_dir"]).exists()   # removed, its workers' cgroups with it
