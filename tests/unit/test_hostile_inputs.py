"""Hostile input outside the run-dir matrix (tests/security): root's locks, site checks that print
without end, config values, shell exports, step names, the watcher's run-dir trust rule,
retention below a descriptor, the journal's reader. Each test failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft.commands.devcluster import shell_exports
from slurmft.config import ConfigError, coerce, read_toml
from slurmft.health import proc
from slurmft.health.external import ExternalCheck, check_external
from slurmft.health.result import Status
from slurmft.journal import append_event, main as journal_main, read_events
from slurmft.rundir import RunDir, parse_step_dirname, step_dirname
from slurmft.safeio import UnsafeFileError
from slurmft.sweep.lock import SweepLock
from slurmft.checkpoint.retention import PrunePlan, apply_prune, scan_checkpoint_dirs

REPO = Path(__file__).resolve().parents[2]
CRON = REPO / "bin" / "slurmft-sweep-cron"
pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- root's locks


def test_sweep_lock_refuses_a_link_and_creates_nothing_elsewhere(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    (state / "sweep-n1.lock").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="a symbolic link"):
        with SweepLock(state / "sweep-n1.lock"):
            pass
    assert not victim.exists()


def test_sweep_lock_refuses_a_directory_others_can_write(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o1777)
    with pytest.raises(UnsafeFileError, match="writable by group or others"):
        with SweepLock(state / "sweep-n1.lock"):
            pass


def test_sweep_lock_refuses_a_state_dir_reached_through_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        with SweepLock(tmp_path / "link" / "sweep-n1.lock"):
            pass


def _cron(tmp_path: Path, lock: Path) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake-slurmft"
    fake.write_text("#!/bin/sh\necho swept\n")
    fake.chmod(0o755)
    env = {**os.environ, "SLURMFT_BIN": str(fake), "SLURMFT_SWEEP_LOCK": str(lock)}
    return subprocess.run([str(CRON)], env=env, capture_output=True, text=True, timeout=30)


def test_cron_lock_link_is_refused_and_its_target_not_created(tmp_path):
    private = tmp_path / "priv"
    private.mkdir(mode=0o755)
    target = tmp_path / "nologin"
    (private / "cron.lock").symlink_to(target)
    result = _cron(tmp_path, private / "cron.lock")
    assert result.returncode == 2, result.stderr
    assert "not a regular file of ours" in result.stderr and "swept" not in result.stdout
    assert not target.exists()


def test_cron_lock_in_a_world_writable_dir_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    result = _cron(tmp_path, shared / "cron.lock")
    assert result.returncode == 2 and "writable by group or others" in result.stderr


def test_cron_lock_in_a_private_dir_runs_the_sweep(tmp_path):
    result = _cron(tmp_path, tmp_path / "new" / "cron.lock")
    assert result.returncode == 0 and "swept" in result.stdout, result.stderr
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755


# ----------------------------------------------------------------------------- site checks


def _external(argv: list[str], timeout_s: float) -> tuple:
    check = ExternalCheck("site", tuple(argv), timeout_s=timeout_s)

    class Facts:
        def need(self, _name):
            return proc.run(check.argv, check.timeout_s)

    return check_external(check, Facts())


def test_a_check_printing_without_end_is_cut_and_fails():
    started = time.monotonic()
    result = _external(["yes"], 20)
    assert result.status is Status.FAIL and "printed more than" in result.detail
    assert time.monotonic() - started < 15  # not the 20 s timeout: cut at the output bound


def test_a_checks_children_die_with_it_and_do_not_stretch_its_timeout(tmp_path):
    marker = tmp_path / "child-alive"
    script = f"(sleep 3; touch {marker}) & echo started; exit 0"
    started = time.monotonic()
    result = _external(["sh", "-c", script], 20)
    assert result.status is Status.OK and result.detail == "started"
    assert time.monotonic() - started < 2.5  # the child held the pipe; it was killed, not waited for
    time.sleep(3.5)
    assert not marker.exists()


def test_a_check_detail_is_one_bounded_line():
    result = _external(["sh", "-c", "printf 'x%.0s' $(seq 1000); echo; exit 1"], 10)
    assert result.status is Status.FAIL and len(result.detail) <= 210


# ----------------------------------------------------------------------------- config, exports


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_path_setting_is_an_error_not_the_working_directory(value):
    from slurmft.sweep.config import SweepConfig
    from slurmft.config import from_mapping

    with pytest.raises(ConfigError, match=r"\[sweep\] textfile_dir must be a non-empty path"):
        from_mapping(SweepConfig, {"textfile_dir": value}, "sweep")
    with pytest.raises(ConfigError, match="non-empty path"):
        coerce(value, Path, "[sweep] state_dir", from_env=True)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "slurmft.toml"
    path.write_bytes(b"[sweep]\nstate_dir = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_toml(path)


def test_exports_are_quoted_for_eval(tmp_path):
    text = shell_exports({"SLURM_CONF": "/tmp/a b;touch x/slurm.conf"})
    assert text == "export SLURM_CONF='/tmp/a b;touch x/slurm.conf'\n"
    out = subprocess.run(["bash", "-c", 'eval "$1"; printf %s "$SLURM_CONF"', "_", text], cwd=tmp_path,
                         capture_output=True, text=True, timeout=10)
    assert out.stdout == "/tmp/a b;touch x/slurm.conf" and not (tmp_path / "x").exists()


def test_devcluster_up_refuses_a_dir_with_shell_metacharacters(tmp_path):
    from typer.testing import CliRunner

    from slurmft.cli import app

    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["devcluster", "up", "--dir", f"{tmp_path}/a;id>{tmp_path}/pwned"])
    assert result.exit_code == 1 and "must not contain ';' '>'" in result.output
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- step names


@pytest.mark.parametrize("name", ["step_5", "step_0000000005", "step_\u0663\u0663\u0663\u0663\u0663\u0663\u0663\u0663\u0663",
                                  "step_00000000\u00b2", "step_+00000005", "step_ 00000005", "step_" + "9" * 5000,
                                  "step_000000005.tmp-x"])
def test_only_the_canonical_step_name_is_a_step(name):
    assert parse_step_dirname(name) is None


def test_canonical_step_names_round_trip():
    for step in (0, 7, 999_999_999, 1_000_000_000, 12_345_678_901):
        assert parse_step_dirname(step_dirname(step)) == step


def test_a_non_canonical_name_is_listed_by_no_reader(tmp_path):
    root = RunDir(tmp_path).checkpoints
    root.mkdir()
    (root / "step_5").mkdir()
    (root / step_dirname(6)).mkdir()
    (root / step_dirname(7)).symlink_to(root / step_dirname(6))
    assert RunDir(tmp_path).committed_steps() == [6]
    assert scan_checkpoint_dirs(tmp_path) == ([6], [])


# ----------------------------------------------------------------------------- retention


def test_prune_never_deletes_through_a_linked_checkpoints_dir(tmp_path):
    other = tmp_path / "other" / "checkpoints"
    (other / step_dirname(1)).mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other)
    with pytest.raises(UnsafeFileError, match="a symbolic link"):
        apply_prune(run, PrunePlan((2,), (1,), ()))
    assert (other / step_dirname(1)).is_dir()


def test_prune_skips_a_linked_step_and_finishes_the_rest(tmp_path):
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    root = RunDir(tmp_path / "run").checkpoints
    for step in (1, 3, 4):
        (root / step_dirname(step)).mkdir(parents=True)
        (root / step_dirname(step) / "f").write_text("x")
    (root / step_dirname(2)).symlink_to(other)
    (root / f"{step_dirname(1)}.tmp-link").symlink_to(other)
    refused: list[str] = []
    removed = apply_prune(tmp_path / "run", PrunePlan((4,), (1, 2, 3), (f"{step_dirname(1)}.tmp-link",)),
                          refused.append)
    assert removed == [root / step_dirname(1), root / step_dirname(3)]
    assert len(refused) == 2 and all("a symbolic link" in line for line in refused)
    assert (other / "data").is_dir() and (root / step_dirname(2)).is_symlink()
    assert not any(".tmp-pruned-" in n for n in os.listdir(root))


def test_an_interrupted_prune_is_finished_by_the_next(tmp_path):
    root = RunDir(tmp_path).checkpoints
    (root / step_dirname(5)).mkdir(parents=True)
    half = root / f"{step_dirname(2)}.tmp-pruned-0123456789ab"  # a kill after the rename
    (half / "sub").mkdir(parents=True)
    (half / "sub" / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    committed, tmp = scan_checkpoint_dirs(tmp_path)
    from slurmft.checkpoint.retention import RetentionPolicy, plan_prune

    plan = plan_prune(committed, 5, tmp, RetentionPolicy(keep_last=1))
    assert apply_prune(tmp_path, plan) == [half]
    assert os.listdir(root) == [step_dirname(5)] and (tmp_path / "outside").is_dir()


# ----------------------------------------------------------------------------- journal


def test_journal_outcome_finds_85_after_hostile_lines(tmp_path, capsys):
    events = RunDir(tmp_path).events
    events.write_text("\n".join([
        "[" * 50_000,
        '{"v":1,"t":1,"kind":"segment_end","job_id":"7","restart_count":0,"exit_code":' + "9" * 5000 + "}",
        '{"v":1,"t":2,"kind":"segment_end","job_id":"7","restart_count":0,"exit_code":85}',
        '{"v":1,"t":3,"kind":"other","x":' + "[" * 3000 + "]" * 3000 + "}",
    ]) + "\n")
    assert journal_main(["outcome", str(tmp_path), "7", "0"]) == 0
    assert capsys.readouterr().out.strip() == "85"


def test_journal_on_a_fifo_fails_at_once(tmp_path, capsys):
    os.mkfifo(RunDir(tmp_path).events)
    assert journal_main(["outcome", str(tmp_path), "7", "0"]) == 2
    assert journal_main(["append", str(tmp_path), "template", "a=1"]) == 2
    assert capsys.readouterr().err.count("a FIFO") == 2


def test_journal_never_follows_a_link(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text('{"v":1,"t":1,"kind":"leak"}\n')
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).events.symlink_to(secret)
    with pytest.raises(UnsafeFileError):
        read_events(RunDir(run).events)
    with pytest.raises(UnsafeFileError):
        append_event(RunDir(run).events, "x")
    assert secret.read_text() == '{"v":1,"t":1,"kind":"leak"}\n'


def _pid_gone(pid: int) -> bool:
    """``pid`` has exited and been reaped (or is a zombie nobody will keep alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


# each leaves the check's process group with a descendant holding its stdout, then writes that
# descendant's pid to {pid} (the check waits for it before exiting)
_DAEMON = ("import os, sys; os.fork() and sys.exit(); os.{how}; os.fork() and os._exit(0); "
           "open({pid!r}, 'w').write(str(os.getpid())); os.execvp('sleep', ['sleep', '300'])")


@pytest.mark.parametrize("escape", [
    "setsid sh -c 'echo $$ > {pid}; exec sleep 300' &",  # leaves the check's session
    "double fork, own group",  # a double fork into a process group of its own
    "double fork, setsid",  # the classic daemon: fork, setsid, fork
])
def test_a_check_is_judged_when_it_exits_and_its_escaped_children_die(tmp_path, escape):
    """Issue 26 item 4: a descendant that left the check's process group (or session) and holds
    its stdout made the sweep wait the whole timeout, fail the check as timed out (draining
    the node), and outlived the sweep."""
    pid = tmp_path / "grandchild.pid"
    if escape.startswith("double fork"):
        code = _DAEMON.format(how="setpgid(0, 0)" if "group" in escape else "setsid()", pid=str(pid))
        escape = f"{sys.executable} -c \"{code}\";"
    script = escape.format(pid=pid) + f" while [ ! -s {pid} ]; do sleep 0.01; done; echo all fine; exit 0"
    result = _external(["sh", "-c", script], 40)
    assert result.status is Status.OK and result.detail == "all fine"  # not "timed out after 40 s"
    assert _pid_gone(int(pid.read_text()))  # killed and reaped before the check was judged


def test_a_check_that_overruns_takes_its_escaped_children_with_it(tmp_path):
    pid = tmp_path / "grandchild.pid"
    script = f"setsid sh -c 'echo $$ > {pid}; exec sleep 300' & sleep 300"
    result = _external(["sh", "-c", script], 2)
    assert result.status is Status.FAIL and result.detail == "timed out after 2 s"
    assert _pid_gone(int(pid.read_text()))


def test_a_check_that_cannot_start_is_an_error_naming_it():
    with pytest.raises(FileNotFoundError, match="/no/such/check"):
        proc.run(["/no/such/check"], 5)
