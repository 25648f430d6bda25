"""Every ``slurmft ckpt`` command, ``load_latest`` and the journal's template operations over
hostile run dirs (tests/security/hostile.py), as root and as an unprivileged user made for the
test. For each: nothing outside the run dir is read (the secret never shows), changed or deleted;
no code runs (the pickle's marker file never appears); every command returns within a bound
(none is interrupted as hung); the exit code is the documented one, with a line naming the bad
thing; no traceback.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import hostile

from slurmft.checkpoint.checksum import hash_file

HERE = Path(__file__).parent
IDENTITIES = ("root", "user")
# Liveness bounds: ~14 s on a quiet 2-core box, past 200 s on one loaded by other work (the two
# runners each run every command over every case).
RUNNER_BOUND_S = 600
pytestmark = pytest.mark.timeout(RUNNER_BOUND_S + 60)


def _make_user() -> pwd.struct_passwd:
    name = f"sfthost{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, timeout=30, capture_output=True)
    return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def world():
    """The pristine run, ``outside/``, one copy of every case per identity, and each identity's results."""
    base = Path(tempfile.mkdtemp(prefix="slurmft-hostile-", dir="/tmp"))
    base.chmod(0o755)
    user = _make_user() if os.geteuid() == 0 else None
    procs: dict[str, subprocess.Popen] = {}
    try:
        pristine = hostile.make_pristine(base / "pristine")
        outside = hostile.make_outside(base / "outside", pristine)
        # Within reach of BOTH identities, so a check can fail for the unprivileged one too: the
        # secret is readable, the marker's directory writable (sticky), the other run its own.
        outside.root.chmod(0o1777)
        outside.secret.chmod(0o644)
        if user is not None:
            subprocess.run(["chown", "-hR", f"{user.pw_uid}:{user.pw_gid}", str(outside.other_run)],
                           check=True, timeout=60)
        specs = {}
        for who in IDENTITIES:
            if who == "user" and user is None:
                continue
            spec = []
            for case in hostile.CASES:
                run = base / who / case.name / "run"
                hostile.build_case(case, pristine, run, outside)
                spec.append({"case": case.name, "run": str(run), "out": str(base / who / "out"),
                             "commands": hostile.commands_for(case), "env": case.env})
            (base / who / "out").mkdir()
            (base / who / "cwd").mkdir()
            if who == "user":
                subprocess.run(["chown", "-hR", f"{user.pw_uid}:{user.pw_gid}", str(base / who)], check=True,
                               timeout=60)
            spec_path = base / f"{who}.json"
            spec_path.write_text(json.dumps(spec))
            spec_path.chmod(0o644)
            specs[who] = spec
        before = hostile.snapshot(outside.root)
        for who in specs:  # both identities at once: the suite stays fast
            argv = [sys.executable, str(HERE / "run_commands.py"), str(base / f"{who}.json")]
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
            if who == "user":
                argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv]
                env["HOME"] = str(base / who / "cwd")
            procs[who] = subprocess.Popen(argv, cwd=base / who / "cwd", env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
        results = {}
        for who, proc in procs.items():
            out, err = proc.communicate(timeout=RUNNER_BOUND_S)
            assert proc.returncode == 0, f"{who}: runner failed: {err[-3000:]}"
            results[who] = {(r["case"], r["command"]): r for r in json.loads(out)}
        yield {"results": results, "outside": outside, "before": before, "after": hostile.snapshot(outside.root),
               "base": base}
    finally:
        for proc in procs.values():  # a runner that overran: gone before its user is removed
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
        if user is not None:
            subprocess.run(["userdel", user.pw_name], timeout=30, capture_output=True)


def _identity(world, who):
    if who not in world["results"]:
        pytest.skip("needs root to create an unprivileged user")
    return world["results"][who]


def test_nothing_outside_the_run_dirs_changed_or_was_deleted(world):
    assert world["after"] == world["before"]


def test_no_code_from_a_pickle_ran(world):
    assert not world["outside"].pwned.exists()


@pytest.mark.parametrize("who", IDENTITIES)
@pytest.mark.parametrize("case", hostile.CASES, ids=lambda c: c.name)
def test_each_command_over_each_hostile_run_dir(world, who, case):
    results = _identity(world, who)
    secret_hash = hash_file(world["outside"].secret)
    for command in hostile.commands_for(case):
        r = results[(case.name, command)]
        where = f"{who} {case.name} `{command}`: exit {r['code']} in {r['seconds']} s\n{r['output']}"
        assert r["code"] not in (98, 99, 124), where  # no traceback, no hang
        assert "Traceback" not in r["output"], where
        assert hostile.SECRET_TEXT.decode().strip() not in r["output"] and secret_hash not in r["output"], where
        if command in hostile.JOURNAL_READERS:
            assert r["code"] in (0, 2), where
            if r["code"] == 2:
                errors = [ln for ln in r["output"].splitlines() if ln.startswith(f"slurmft {command}: ")]
                assert errors and len(errors[-1]) < 2000, where
            if command in case.expect:
                code, text = case.expect[command]
                assert r["code"] == code and (text is None or text in r["output"]), where
            continue
        if command == "launch_env":
            code, text = case.expect.get(command, (0, None))
            assert r["code"] == code and (text is None or text in r["output"]), where
            if code:
                assert len(r["output"].strip().splitlines()) == 1 and len(r["output"]) < 2000, where
            continue
        code, text = _expected(case, command)
        assert r["code"] == code, where
        if text is not None:
            assert text in r["output"], where
        if command not in ("load_latest", "outcome", "append") and r["code"] == 2:
            errors = [ln for ln in r["output"].splitlines() if ln.startswith("slurmft ckpt: ")]
            assert errors and len(errors[-1]) < 2000, where  # one line saying what is wrong


def _expected(case: hostile.Case, command: str) -> tuple[int, str | None]:
    if command == "load_latest":
        if case.loads is None:
            return 2, "a symbolic link"
        return 0, f"loaded {case.loads}"
    if command in ("outcome", "append"):
        refused = case.outcome not in ("", "85")
        if refused:
            return 2, case.outcome
        return 0, (case.outcome or None) if command == "outcome" else None
    if command.startswith("prune") and "prune" in case.expect:
        return case.expect["prune"]
    if command.startswith("prune --dry-run") and "prune --dry-run" in case.expect:
        return case.expect["prune --dry-run"]
    return case.expect.get(command, (0, None))


@pytest.mark.parametrize("who", IDENTITIES)
def test_prune_deleted_only_inside_each_run(world, who):
    """After `prune --keep-last 1`, a run with a valid step 3 keeps 3 and its newest valid one."""
    _identity(world, who)
    base = world["base"] / who
    for case in hostile.CASES:
        if (base / case.name / "run").is_symlink():
            continue  # refused: the other run is part of the snapshot of outside/, unchanged
        checkpoints = base / case.name / "run" / "checkpoints"
        if checkpoints.is_symlink():
            assert sorted(os.listdir(checkpoints)) == sorted(os.listdir(world["outside"].other_run / "checkpoints"))
            continue
        left = sorted(n for n in os.listdir(checkpoints) if n.startswith("step_00000000") and "tmp" not in n)
        assert "step_000000001" not in left, case.name
        assert "step_000000003" in left, case.name  # the newest is never deleted
        if case.loads == 2:
            assert "step_000000002" in left, case.name  # the newest valid one is kept
