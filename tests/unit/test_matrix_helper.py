"""matrix/helper.py (requirements for the rootfs venvs, the results report) and matrix/run.sh's
input checks, which refuse before building or running anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def helper():
    spec = importlib.util.spec_from_file_location("matrix_helper", REPO / "matrix" / "helper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deps_are_core_plus_dev_extra(helper, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["typer>=0.12", "tomli; python_version < \'3.11\'"]\n'
        '[project.optional-dependencies]\ntrain = ["torch>=2.6"]\ndev = ["pytest>=8"]\n'
    )
    assert helper.dev_requirements(pyproject) == [
        "typer>=0.12", "tomli; python_version < '3.11'", "pytest>=8"]


def test_deps_of_this_repo_leave_torch_out(helper):
    deps = helper.dev_requirements(REPO / "pyproject.toml")
    assert any(d.startswith("pytest") for d in deps)
    assert not any(d.startswith("torch") for d in deps)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
 failures="2" skipped="1" tests="9" time="41.7"><testcase name="a"/></testsuite></testsuites>"""


def test_report_counts_outcomes_and_tabulates_features(helper, tmp_path):
    (tmp_path / "trixie.xml").write_text(JUNIT)
    (tmp_path / "trixie.jsonl").write_text(
        json.dumps({"feature": "slurm release", "value": "24.11.5"}) + "\n"
        + json.dumps({"feature": "requeue delay (s)", "value": "121"}) + "\n"
        + json.dumps({"feature": "requeue delay (s)", "value": "120"}) + "\n"
        + '{"feature": "torn')
    (tmp_path / "sid.jsonl").write_text(json.dumps({"feature": "a|b", "value": "x|y"}) + "\n")
    outcome = helper.outcome_table(tmp_path, ["trixie", "sid"])
    assert outcome[2] == "| trixie | 24.11.5 | 9 | 5 | 2 | 1 | 1 | 42 |"
    assert "no result" in outcome[3]
    features = helper.feature_table(tmp_path, ["trixie", "sid"])
    assert features[0] == "| feature | 24.11.5 | sid |"
    assert "| requeue delay (s) | 120 | not measured |" in features
    assert "| a\\|b | not measured | x\\|y |" in features


FAILING_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
 failures="1" skipped="1" tests="3" time="9.1">
<testcase classname="tests.integration.test_x" name="test_ok"/>
<testcase classname="tests.integration.test_x" name="test_bad[2]">
<failure message="AssertionError: 3 != 2&#10;more">trace</failure></testcase>
<testcase classname="tests.integration.test_x" name="test_skip"><skipped message="no devcluster"/></testcase>
</testsuite></testsuites>"""


def test_report_names_every_failed_or_skipped_test_and_fails(helper, tmp_path, capsys):
    (tmp_path / "sid.xml").write_text(FAILING_JUNIT)
    (tmp_path / "sid.jsonl").write_text(json.dumps({"feature": "slurm release", "value": "26.05.5"}) + "\n")
    nothing_ran = FAILING_JUNIT.split("<testcase")[0].replace('failures="1" skipped="1" tests="3"', 'tests="0"')
    (tmp_path / "trixie.xml").write_text(nothing_ran + "</testsuite></testsuites>")
    assert helper.main(["report", str(tmp_path), "sid", "trixie", "bookworm"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("matrix: FAILED")]
    sid = "matrix: FAILED sid (Slurm 26.05.5): tests/integration/test_x.py::"
    assert lines == [
        sid + "test_bad[2]: failure: AssertionError: 3 != 2",  # the first line of the message
        sid + "test_skip: skipped: no devcluster",
        "matrix: FAILED trixie (Slurm ?): no test ran",
        "matrix: FAILED bookworm: no test results (rootfs, venv or pytest start failed)",
    ]


def test_report_of_an_all_passing_run_exits_0(helper, tmp_path, capsys):
    passing = FAILING_JUNIT.split("<testcase")[0].replace('failures="1" skipped="1" tests="3"', 'tests="1"')
    (tmp_path / "sid.xml").write_text(passing + '<testcase classname="t" name="a"/></testsuite></testsuites>')
    assert helper.main(["report", str(tmp_path), "sid"]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_report_cli_rejects_unknown_command(helper, capsys):
    assert helper.main(["frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err


def _run_sh(args, **env):
    return subprocess.run([str(REPO / "matrix" / "run.sh"), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **env}, check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="matrix/run.sh checks for root first")
def test_run_sh_names_a_bad_suite_and_builds_nothing(tmp_path):
    proc = _run_sh(["Bookworm;rm"], SLURMFT_MATRIX_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == "matrix: 'Bookworm;rm' is not a Debian suite name (e.g. bookworm trixie sid)"
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="matrix/run.sh checks for root first")
def test_run_sh_refuses_a_cache_inside_the_repository():
    proc = _run_sh(["trixie"], SLURMFT_MATRIX_CACHE=str(REPO / "rootfs"))
    assert proc.returncode == 2
    assert "must be outside the repository" in proc.stderr
    assert not (REPO / "rootfs").exists()
