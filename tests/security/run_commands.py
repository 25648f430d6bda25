"""Run every ``slurmft ckpt`` command, ``slurmft status`` and ``interval``, two cycles of the
watcher, the launcher's settings, ``load_latest`` and the journal's ``append``/``outcome`` over
hostile run dirs, in this process, as whoever runs this script; print one JSON result list.

    python run_commands.py SPEC.json   # SPEC: [{"case": name, "run": dir, "out": dir, "commands": [...]}]

Each command gets a bound (``BOUND_S``): one that blocks is interrupted by SIGALRM and recorded as
hung. The test (test_hostile_rundir.py) runs this once as root and once as an unprivileged user.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shlex
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

BOUND_S = 30


class Hung(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hung(f"no answer within {BOUND_S} s")


def run_ckpt(args: list[str]) -> tuple[int, str]:
    return run_cli(["ckpt", *args])


def run_cli(args: list[str]) -> tuple[int, str]:
    from typer.testing import CliRunner

    from slurmft.cli import app

    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        text = "".join(traceback.format_exception(result.exception))
        return 99, result.output + text
    return result.exit_code, result.output


def run_load_latest(run: str) -> tuple[int, str]:
    sys.path.insert(0, str(Path(__file__).parent))
    from hostile import make_model_state  # noqa: PLC0415

    from slurmft.checkpoint.manager import CheckpointError, CheckpointManager

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("slurmft").addHandler(handler)
    logging.getLogger("slurmft").setLevel(logging.INFO)
    manager = CheckpointManager(run)
    try:
        step = manager.load_latest(make_model_state())
        return 0, f"loaded {step}\n{log.getvalue()}"
    except CheckpointError as exc:
        return 2, f"CheckpointError: {exc}\n{log.getvalue()}"
    finally:
        manager.close()
        logging.getLogger("slurmft").removeHandler(handler)


class RecordingSlurm:
    """What the watcher asks Slurm to do, recorded (the watcher's own Slurm calls are tested on
    the devcluster: tests/integration/test_watch_*.py); no submission to save."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def requeue(self, job_id: str) -> bool:
        self.calls.append(f"requeue {job_id}")
        return True

    def update_pending(self, job_id, *, exclude_nodes=(), readmit_nodes=(), start_now=False) -> None:
        self.calls.append(f"update {job_id} exclude={list(exclude_nodes)} start_now={start_now}")

    def hold(self, job_id: str) -> None:
        self.calls.append(f"hold {job_id}")

    def requeue_hold(self, job_id: str) -> bool:
        self.calls.append(f"requeue_hold {job_id}")
        return True

    def submit_line(self, job_id: str):
        return None


def run_watch(run: str) -> tuple[int, str]:
    """Two cycles of the watcher over this run dir's job 7, which failed: the run dir resolved
    and the state loaded as ``slurmft watch`` does (exit 2, one line, when either is refused),
    then what it asked of Slurm; a cycle that raised is 97."""
    from datetime import datetime, timezone

    from slurmft.rundir import RunDir
    from slurmft.slurm.client import Job, JobState
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.resolve import ResolveError, current_user, run_dir_for
    from slurmft.watch.runwatch import RunWatch
    from slurmft.watch.state import StateError, load_state

    now = 1_800_000_100.0
    job = Job(job_id="7", name="train", state=JobState.FAILED, restart_count=0, nodes=("n1",),
              node_count=1, exit_code=1, user=current_user(), run_dir=Path(run),
              end_time=datetime.fromtimestamp(now - 5, tz=timezone.utc))
    try:
        rd = RunDir(run_dir_for(job, None))
        state = load_state(rd, "7")
    except (ResolveError, StateError) as exc:
        return 2, f"slurmft watch: {exc}"
    client = RecordingSlurm()
    watch = RunWatch(rd, state, client, WatchConfig())
    for cycle in range(2):
        try:
            watch.step(job, {}, now + cycle)
        except Exception as exc:  # noqa: BLE001 - what `slurmft watch` logs as "this cycle failed"
            return 97, f"cycle {cycle} failed: {type(exc).__name__}: {exc}"
    return 0, "\n".join(client.calls)


def run_launch_env(run: str, extra: dict[str, str]) -> tuple[int, str]:
    """The launcher's settings from a real job's environment (tests/fixtures/launch-env) with
    ``extra`` over it: 0, or 86 and the line the launcher prints before anything runs."""
    from slurmft.launch import identity, settings

    env = {}
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "launch-env" / "nonarray.env"
    for line in fixture.read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    env.update({"SLURMFT_RUN_DIR": run, **extra})
    try:
        settings.from_environ(env, identity.from_environ(env))
    except (settings.SettingsError, identity.IdentityError) as exc:
        return 86, f"slurmft-launch: {exc}"
    return 0, ""


def run_journal(args: list[str]) -> tuple[int, str]:
    from slurmft import journal

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = journal.main(args)
    return code, out.getvalue()


def one(case: dict, command: str) -> dict:
    run, out = case["run"], case["out"]
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(BOUND_S)
    started = time.monotonic()
    try:
        if command == "load_latest":
            code, text = run_load_latest(run)
        elif command == "outcome":
            code, text = run_journal(["outcome", run, "7", "0"])
        elif command == "append":
            code, text = run_journal(["append", run, "template", "note=hostile"])
        elif command == "status":
            code, text = run_cli(["status", run, "--no-slurm", "--json"])
        elif command == "interval":
            code, text = run_cli(["interval", "--run-dir", run, "--mtbf", "3600"])
        elif command == "watch":
            code, text = run_watch(run)
        elif command == "launch_env":
            code, text = run_launch_env(run, case.get("env", {}))
        else:
            words = shlex.split(command)
            if words[0] == "prune":
                words += ["--keep-last", "1"]
            if words[0] == "export":
                words.append(str(Path(out) / f"{case['case']}.safetensors"))
            code, text = run_ckpt([words[0], run, *words[1:]])
    except Hung as exc:
        code, text = 124, str(exc)
    except BaseException as exc:  # noqa: BLE001 - reported, the test fails on it
        code, text = 98, "".join(traceback.format_exception(exc))
    finally:
        signal.alarm(0)
    return {"case": case["case"], "command": command, "code": code, "output": text[-4000:],
            "seconds": round(time.monotonic() - started, 3)}


def main() -> None:
    warnings.simplefilter("ignore")
    import slurmft.cli, slurmft.checkpoint.manager, slurmft.checkpoint.export  # noqa: F401,E401 - not timed
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = [one(case, command) for case in spec for command in case["commands"]]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
