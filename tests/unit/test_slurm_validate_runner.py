"""Argument validation, error classification, retries and the [slurm] config."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from procs import alive
from slurmft.config import ConfigError, load_section
from slurmft.slurm import validate
from slurmft.slurm.client import (
    InvalidArgument, JobNotFound, OutcomeUnknown, PermissionDenied, SlurmError, SlurmUnavailable,
    UnsupportedShape,
)
from slurmft.slurm.config import SlurmConfig
from slurmft.slurm.parse_jobs import parse_squeue
from slurmft.slurm.parse_nodes import parse_nodes
from slurmft.slurm.release import Capabilities, listed_parsers, parse_version
from slurmft.slurm.runner import Runner


@pytest.mark.parametrize("value", ["123", "4_7", 42])
def test_job_id_ok(value):
    assert validate.job_id(value) == str(value)


@pytest.mark.parametrize("value", ["", "0", "12;rm", "1 2", "-1", "12_", True, None, "1,2", "abc"])
def test_job_id_rejected(value):
    with pytest.raises(InvalidArgument, match="invalid job id"):
        validate.job_id(value)


@pytest.mark.parametrize("value", ["n1", "gpu-07.rack2", "node_3"])
def test_node_name_ok(value):
    assert validate.node_name(value) == value


@pytest.mark.parametrize("value", ["", "n[1-3]", "n1,n2", "n1 n2", "-n1", "n1\n", 7])
def test_node_name_rejected(value):
    with pytest.raises(InvalidArgument, match="invalid node name"):
        validate.node_name(value)


def test_node_names_refuses_a_bare_string():
    with pytest.raises(InvalidArgument, match="list of node names"):
        validate.node_names("n1")


def test_compress_nodes_sorts_and_dedups():
    assert validate.compress_nodes(["n3", "n1", "n2", "n1", "n7"]) == "n[1-3,7]"


def test_reason_cleaned_and_cut():
    assert validate.reason("gpu:\n xid 79\t(bus)\x07") == "gpu: xid 79 (bus)"
    long = validate.reason("x" * 500)
    assert len(long) == validate.MAX_REASON and long.endswith("...")
    with pytest.raises(InvalidArgument, match="empty"):
        validate.reason(" \n\t")


@pytest.mark.parametrize("value,name", [("USR2", "USR2"), ("sigusr2", "USR2"), (12, "USR2"), ("TERM", "TERM")])
def test_signal_names(value, name):
    assert validate.signal_name(value) == name


@pytest.mark.parametrize("value", ["USR9", "", "9;x", 999])
def test_signal_rejected(value):
    with pytest.raises(InvalidArgument, match="invalid signal"):
        validate.signal_name(value)


def test_release_helpers():
    assert parse_version("slurm-wlm 22.05.8") == (22, 5, 8)
    assert parse_version("slurm 24.11.5") == (24, 11, 5)
    listing = "Possible data_parser plugins:\ndata_parser/v0.0.42\ndata_parser/v0.0.40\ndata_parser/v0.0.41\n"  # 24.11.5
    assert listed_parsers(listing) == ["v0.0.40", "v0.0.41", "v0.0.42"]
    old, new = Capabilities((22, 5, 8)), Capabilities((24, 11, 5))
    assert not old.json_filters and not old.scontrol_json and not old.sacct_json_exit_codes
    assert new.json_filters and new.scontrol_json and new.data_parser_pins


def test_config_defaults_env_and_errors(tmp_path):
    cfg = load_section(SlurmConfig, "slurm", environ={"SLURMFT_SLURM_TIMEOUT": "5", "SLURMFT_SLURM_DATA_PARSER": "v0.0.42"},
                       config_file=_toml(tmp_path, "[slurm]\nretries = 1\nbackend = 'cli'\n"))
    assert (cfg.timeout, cfg.retries, cfg.data_parser, cfg.backend) == (5.0, 1, "v0.0.42", "cli")
    with pytest.raises(ConfigError, match=r"\[slurm\] timeout must be > 0"):
        load_section(SlurmConfig, "slurm", environ={"SLURMFT_SLURM_TIMEOUT": "0"}, config_file=_toml(tmp_path, ""))
    with pytest.raises(ConfigError, match="data_parser must look like"):
        load_section(SlurmConfig, "slurm", environ={"SLURMFT_SLURM_DATA_PARSER": "latest"}, config_file=_toml(tmp_path, ""))
    with pytest.raises(ConfigError, match="backend must be one of"):
        load_section(SlurmConfig, "slurm", environ={"SLURMFT_SLURM_BACKEND": "rest"}, config_file=_toml(tmp_path, ""))


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slurmft.toml"
    path.write_text(text)
    return path


# -- the runner, on small real programs standing in for a failing Slurm command -------------------

def fake_command(tmp_path: Path, name: str, body: str) -> str:
    """A Python script that behaves like a Slurm tool (stderr text, exit status)."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport sys, time, pathlib\n{body}\n")
    path.chmod(0o755)
    return str(path)


def runner(retries=2, timeout=5.0):
    sleeps = []
    return Runner(SlurmConfig(timeout=timeout, retries=retries, backoff=0.01, max_backoff=0.02), sleep=sleeps.append), sleeps


@pytest.mark.parametrize("stderr,error", [
    ("slurm_load_jobs error: Invalid job id specified", JobNotFound),
    ("slurm_update error: Invalid node name specified", InvalidArgument),
    ("scontrol: error: Access/permission denied", PermissionDenied),
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", SlurmError),
])
def test_permanent_errors_raise_at_once_with_slurms_message(tmp_path, stderr, error):
    counter = tmp_path / "calls"
    cmd = fake_command(tmp_path, "scontrol",
                       f"p = pathlib.Path({str(counter)!r}); "
                       "p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
                       f"print({stderr!r}, file=sys.stderr); sys.exit(1)")
    run, sleeps = runner()
    with pytest.raises(error) as info:
        run.run([cmd, "show", "job", "1"])
    assert stderr.split(": ")[-1] in str(info.value)
    assert counter.read_text() == "x" and sleeps == []


def test_transient_error_retried_then_succeeds(tmp_path):
    counter = tmp_path / "calls"
    cmd = fake_command(tmp_path, "squeue", f"""
p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n))
if n < 3:
    print("squeue: error: slurm_load_jobs error: Unable to contact slurm controller (connect failure)", file=sys.stderr); sys.exit(1)
print('{{"jobs": []}}')""")
    run, sleeps = runner(retries=3)
    assert json.loads(run.run([cmd]).stdout) == {"jobs": []}
    assert counter.read_text() == "3" and len(sleeps) == 2


def test_persistent_timeout_is_unavailable_not_empty(tmp_path):
    cmd = fake_command(tmp_path, "squeue", "time.sleep(30)")
    run, sleeps = runner(retries=1, timeout=0.3)
    with pytest.raises(SlurmUnavailable, match="could not observe.*no answer within 0.3 s.*2 attempts"):
        run.run([cmd])
    assert len(sleeps) == 1


@pytest.mark.timeout(20)
def test_a_timed_out_command_leaves_no_process_behind(tmp_path):
    # subprocess.run kills only the command: a child it started (a helper stuck on a mount, say)
    # lived on, holding whatever it held. The whole process group goes now, within a bound.
    pidfile = tmp_path / "child.pid"
    cmd = fake_command(tmp_path, "squeue",
                       "import subprocess; p = subprocess.Popen(['sleep', '60']); "
                       f"pathlib.Path({str(pidfile)!r}).write_text(str(p.pid)); time.sleep(60)")
    run, _ = runner(retries=0, timeout=5.0)  # room for the command's own start on a busy box
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable, match="no answer within 5 s"):
        run.run([cmd])
    assert time.monotonic() - started < 12
    assert pidfile.exists(), "the stand-in command did not start its child within 5 s"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.05)
    assert not alive(child), f"the command's child {child} outlived the timeout"


def test_non_idempotent_call_not_retried_after_timeout(tmp_path):
    cmd = fake_command(tmp_path, "sbatch", "time.sleep(30)")
    run, sleeps = runner(retries=3, timeout=0.3)
    with pytest.raises(OutcomeUnknown, match="not retried"):
        run.run([cmd, "--parsable"], idempotent=False)
    assert sleeps == []


def counting(tmp_path: Path, name: str, stderr: str) -> tuple[str, Path]:
    counter = tmp_path / "calls"
    body = (f"p = pathlib.Path({str(counter)!r}); p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
            f"print({stderr!r}, file=sys.stderr); sys.exit(1)")
    return fake_command(tmp_path, name, body), counter


# What scontrol prints when slurmctld took the request but did not answer in time (22.05).
SOCKET_TIMED_OUT = "slurm_requeue error: Socket timed out on send/recv operation"


def test_a_change_slurm_timed_out_on_is_not_sent_again(tmp_path):
    cmd, counter = counting(tmp_path, "scontrol", SOCKET_TIMED_OUT)
    run, sleeps = runner(retries=3)
    with pytest.raises(OutcomeUnknown, match="Socket timed out.*not retried \\(it may have taken effect\\)"):
        run.run([cmd, "requeue", "7"], idempotent=False)
    assert counter.read_text() == "x" and sleeps == []
    counter.unlink()
    with pytest.raises(SlurmUnavailable, match="could not observe"):
        run.run([cmd, "show", "job", "7"])  # a read is retried
    assert counter.read_text() == "xxxx"


def test_a_change_that_never_reached_the_controller_is_retried(tmp_path):
    cmd, counter = counting(tmp_path, "scontrol",
                            "slurm_update error: Unable to contact slurm controller (connect failure)")
    run, _ = runner(retries=2)
    with pytest.raises(SlurmUnavailable) as info:
        run.run([cmd, "update", "NodeName=n1", "State=DRAIN"], idempotent=False)
    assert not isinstance(info.value, OutcomeUnknown) and counter.read_text() == "xxx"


def test_a_command_killed_by_a_signal_not_ours_is_no_verdict(tmp_path):
    """Slurm TERMs a batch step it requeues, and with it the squeue the launcher runs to confirm
    its own requeue: that read is retried (it was once 'scontrol requeue failed: exit status
    -15', and the exclusion was never sent); a change killed so may have happened."""
    counter = tmp_path / "calls"
    cmd = fake_command(tmp_path, "squeue", f"""
import os, signal
p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n))
if n == 1:
    os.kill(os.getpid(), signal.SIGTERM)
print('{{"jobs": []}}')""")
    run, sleeps = runner(retries=2)
    assert json.loads(run.run([cmd, "--json"]).stdout) == {"jobs": []}
    assert counter.read_text() == "2" and len(sleeps) == 1
    counter.unlink()
    with pytest.raises(OutcomeUnknown, match="killed by signal 15; not retried"):
        run.run([cmd, "requeue", "7"], idempotent=False)
    assert counter.read_text() == "1"


def test_missing_binary_and_bad_argv(tmp_path):
    run, _ = runner()
    with pytest.raises(SlurmError, match="command not found"):
        run.run([str(tmp_path / "nope")])
    with pytest.raises(InvalidArgument):
        run.run(["squeue", 3])  # type: ignore[list-item]


def test_env_overlay_reaches_the_command(tmp_path):
    cmd = fake_command(tmp_path, "sinfo", "import os; print(os.environ['SLURM_CONF'])")
    run = Runner(SlurmConfig(), env={"SLURM_CONF": "/x/slurm.conf"})
    assert run.run([cmd]).stdout.strip() == "/x/slurm.conf"


# -- unknown shapes -------------------------------------------------------------------------------

def test_unknown_job_state_shape_names_the_field():
    doc = {"jobs": [{"job_id": 5, "job_state": {"current": "RUNNING"}}]}
    with pytest.raises(UnsupportedShape, match=r"squeue --json: jobs\[0\]\.job_state: expected str or list, got dict"):
        parse_squeue(json.dumps(doc))


def test_unknown_state_name_and_number_shapes():
    with pytest.raises(UnsupportedShape, match=r"jobs\[0\]\.job_state: unknown job state \['WARPING'\]"):
        parse_squeue(json.dumps({"jobs": [{"job_id": 5, "job_state": ["WARPING"]}]}))
    with pytest.raises(UnsupportedShape, match=r"jobs\[0\]\.node_count: expected int or"):
        parse_squeue(json.dumps({"jobs": [{"job_id": 5, "job_state": "RUNNING", "node_count": "2"}]}))
    with pytest.raises(UnsupportedShape, match=r"nodes\[0\]\.state: unknown node state"):
        parse_nodes(json.dumps({"nodes": [{"name": "n1", "state": ["SLEEPY"]}]}), "scontrol --json show nodes")


def test_empty_or_non_json_output_is_an_error():
    with pytest.raises(UnsupportedShape, match="printed no JSON"):
        parse_squeue("")
    with pytest.raises(UnsupportedShape, match="not JSON"):
        parse_squeue("squeue: error: something")
    with pytest.raises(UnsupportedShape, match="jobs: expected list"):
        parse_squeue('{"meta": {}}')


def test_flag_only_state_strings_of_2205():
    doc = {"jobs": [{"job_id": 5, "job_state": "COMPLETING"}, {"job_id": 6, "job_state": "REQUEUED"}]}
    completing, requeued = parse_squeue(json.dumps(doc))
    assert completing.state.value == "RUNNING" and completing.completing
    assert requeued.state.value == "PENDING" and "REQUEUED" in requeued.flags
