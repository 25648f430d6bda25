"""A generator of hostile run directories: what a job's user can put in their own run dir.

Each case starts from a real run (steps 1, 2, 3 written by :class:`CheckpointManager`) and adds
one hostile thing: links out of the run dir (to a secret, to another run's checkpoints, to
``/dev/zero``), a run dir that is itself a link to another run, FIFOs, odd and non-canonical step
names, huge and deeply nested manifests and journal lines, a ``.metadata`` pickle that would run a
command. Next to the cases, ``outside/`` holds what must never be read, changed or deleted: a
secret, a FIFO, another run's checkpoints, and the path the pickle's command would create (the
test puts all of them within reach of the unprivileged identity too: a check that could not fail
for it would prove nothing).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmft.journal import Journal
from slurmft.rundir import RunDir, step_dirname
from slurmft.checkpoint.checksum import hash_file
from slurmft.checkpoint.manifest import DCP_METADATA_NAME, MANIFEST_NAME, FileEntry, read_manifest, write_manifest

SECRET_TEXT = b"TOP-SECRET-slurmft-hostile-test-7f3a9c\n"


@dataclass(frozen=True)
class Outside:
    root: Path

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    @property
    def fifo(self) -> Path:
        return self.root / "fifo"

    @property
    def other_run(self) -> Path:
        return self.root / "other_run"

    @property
    def pwned(self) -> Path:
        return self.root / "PWNED"


def make_outside(root: Path, pristine: Path) -> Outside:
    out = Outside(root)
    root.mkdir(parents=True)
    out.secret.write_bytes(SECRET_TEXT)
    out.secret.chmod(0o600)
    os.mkfifo(out.fifo, 0o666)
    shutil.copytree(pristine, out.other_run, symlinks=True)
    return out


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything about a tree that a hostile run dir must not change (FIFOs are not opened)."""
    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            st = os.lstat(path)
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
            out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, data)
    return out


# ----------------------------------------------------------------------------- helpers


def _ckpt(run: Path, step: int) -> Path:
    return RunDir(run).checkpoint(step)


def _rehash(ckpt: Path, name: str, size: int | None = None, digest: str | None = None) -> None:
    """Make the manifest agree with ``name`` as it is now (what a hostile user would do)."""
    manifest = read_manifest(ckpt)
    path = ckpt / name
    size = path.stat().st_size if size is None else size
    digest = hash_file(path) if digest is None else digest
    files = tuple(FileEntry(f.path, size, digest) if f.path == name else f for f in manifest.files)
    if name not in {f.path for f in manifest.files}:
        files += (FileEntry(name, size, digest),)
    write_manifest(ckpt, manifest.__class__(**{**manifest.__dict__, "files": files}))


def _shard(run: Path, step: int) -> str:
    return next(p.name for p in sorted(_ckpt(run, step).iterdir()) if p.suffix == ".distcp")


class Payload:
    """Unpickling this runs ``touch <path>``: the proof that a pickle was loaded freely."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path, Outside], None]
    # command -> (exit code, text the output must contain); commands not named: exit 0
    expect: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    loads: int | None = 3  # the step load_latest must resume from (None: fresh start)
    outcome: str = ""  # what `python -m slurmft.journal outcome RUN 7 0` prints
    skip: frozenset[str] = frozenset()  # commands not run over this case (the case says why)
    # The job's environment for `launch_env` (the launcher's settings), over a real one's.
    env: dict[str, str] = field(default_factory=dict)


def _symlink_checkpoints(run: Path, out: Outside) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(out.other_run / "checkpoints")


def _symlink_run_dir(run: Path, out: Outside) -> None:
    shutil.rmtree(run)
    run.symlink_to(out.other_run)


def _symlink_step(run: Path, out: Outside) -> None:
    (RunDir(run).checkpoints / step_dirname(4)).symlink_to(RunDir(out.other_run).checkpoint(1))
    (RunDir(run).checkpoints / f"{step_dirname(1)}.tmp-evil").symlink_to(RunDir(out.other_run).checkpoint(2))


def _entry_link_to_secret(run: Path, out: Outside) -> None:
    ckpt, name = _ckpt(run, 3), _shard(run, 3)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(out.secret)
    _rehash(ckpt, name, len(SECRET_TEXT), "0" * 32)  # a follower would print the secret's checksum


def _entry_fifo(run: Path, out: Outside) -> None:
    ckpt, name = _ckpt(run, 3), _shard(run, 3)
    size = (ckpt / name).stat().st_size
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    _rehash(ckpt, name, size, "0" * 32)


def _entry_dev_zero(run: Path, out: Outside) -> None:
    ckpt, name = _ckpt(run, 3), _shard(run, 3)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to("/dev/zero")


def _entry_link_to_outside_fifo(run: Path, out: Outside) -> None:
    ckpt = _ckpt(run, 3)
    (ckpt / DCP_METADATA_NAME).unlink()
    (ckpt / DCP_METADATA_NAME).symlink_to(out.fifo)


def _manifest_link(run: Path, out: Outside) -> None:
    ckpt = _ckpt(run, 3)
    (ckpt / MANIFEST_NAME).unlink()
    (ckpt / MANIFEST_NAME).symlink_to(out.secret)


def _manifest_fifo(run: Path, out: Outside) -> None:
    ckpt = _ckpt(run, 3)
    (ckpt / MANIFEST_NAME).unlink()
    os.mkfifo(ckpt / MANIFEST_NAME)


def _manifest_nested(run: Path, out: Outside) -> None:
    (_ckpt(run, 3) / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)


def _manifest_huge_number(run: Path, out: Outside) -> None:
    path = _ckpt(run, 3) / MANIFEST_NAME
    data = json.loads(path.read_text())
    text = json.dumps(data).replace(f'"step": {data["step"]}', '"step": ' + "9" * 50_000)
    path.write_text(text)


def _manifest_huge_file(run: Path, out: Outside) -> None:
    with open(_ckpt(run, 3) / MANIFEST_NAME, "r+b") as fh:
        fh.truncate(65 << 20)  # sparse: larger than any reader accepts


def _metadata_pickle(run: Path, out: Outside) -> None:
    ckpt = _ckpt(run, 3)
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(Payload(out.pwned)))
    _rehash(ckpt, DCP_METADATA_NAME)


def _metadata_pickle_in_allowed_wrapper(run: Path, out: Outside) -> None:
    """The payload hidden inside a real Metadata object (the outer type is allowed)."""
    ckpt = _ckpt(run, 3)
    metadata = pickle.loads((ckpt / DCP_METADATA_NAME).read_bytes())  # the test's own, just written
    metadata.planner_data = {"x": Payload(out.pwned)}
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
    _rehash(ckpt, DCP_METADATA_NAME)


def _odd_step_names(run: Path, out: Outside) -> None:
    root = RunDir(run).checkpoints
    for name in ("step_5", "step_\u0663\u0663", "step_00000000a", "step_" + "9" * 5000, "step_000000009.tmp-"):
        try:
            (root / name).mkdir()
        except OSError:  # the 5000-digit name is too long for the file system
            pass
    os.mkfifo(root / step_dirname(8))


def _stray_link_in_checkpoint(run: Path, out: Outside) -> None:
    ckpt = _ckpt(run, 3)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "link").symlink_to(out.secret)
    (ckpt / "up").symlink_to("..")


def _journal_fifo(run: Path, out: Outside) -> None:
    os.mkfifo(RunDir(run).events)


def _journal_link(run: Path, out: Outside) -> None:
    RunDir(run).events.symlink_to(out.secret)


def _journal_hostile_lines(run: Path, out: Outside) -> None:
    lines = [
        "[" * 100_000,
        '{"v":1,"t":1,"kind":"segment_end","job_id":"7","restart_count":0,"exit_code":' + "9" * 10_000 + "}",
        "\xff\xfe not utf-8",
        '{"v":1,"t":2,"kind":"segment_end","job_id":"7","restart_count":0,"exit_code":85}',
        '{"v":1,"t":3,"kind":"x","deep":' + "[" * 5000 + "]" * 5000 + "}",
        "x" * (2 << 20),
    ]
    RunDir(run).events.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")


HUGE = "9" * 400  # an integer float() refuses (OverflowError), well under Python's 4300 digits


def _journal_hostile_numbers(run: Path, out: Outside) -> None:
    """Times and fields no float can hold, or that are not JSON (NaN, Infinity), around a real
    segment's start, a checkpoint and its recorded 85."""
    def line(t: str, kind: str, **fields: str) -> str:
        body = "".join(f',"{k}":{v}' for k, v in {"job_id": '"7"', "restart_count": "0", **fields}.items())
        return f'{{"v":1,"t":{t},"kind":"{kind}"{body}}}'
    lines = [
        line("1800000000", "segment_start", world_size=HUGE, num_nodes="-1", load_s=HUGE, load_bytes=HUGE),
        line(HUGE, "loss", step="1"), line("NaN", "loss", step="2"), line("Infinity", "loss", step="3"),
        line("-Infinity", "segment_end", exit_code="0"), line("1e400", "segment_end", exit_code="0"),
        line("1800000001", "loss", step=HUGE), line("1800000002", "loss", step="4", loss="NaN"),
        line("1800000003", "checkpoint_committed", step="3", blocking_s=HUGE),
        line("1800000003.5", "checkpoint_committed", step="3", blocking_s="2.5"),
        line("1800000004", "fault_detected", cause=HUGE, nodes="5", fault_time=HUGE, evidence="Infinity"),
        line("1800000005", "recovery_action", action="[]", ok="1"),
        line("1800000006", "watch_warning", what="{}", detail="[[]]", nodes='{"n1":1}'),
        line("1800000007", "segment_end", exit_code="85", reason='"preempted"'),
    ]
    RunDir(run).events.write_text("\n".join(lines) + "\n")


def _watch_state(run: Path, **recovery: object) -> None:
    """A watcher's state as a user could leave it: a run recovering from a crash, with
    ``recovery``'s fields written over the real ones (Python's json writes NaN: a user can)."""
    from slurmft.watch.state import Recovery, RunState, save_state

    state = RunState(job_id="7", phase="recovering", restarts=1,
                     recovery=Recovery("crash", "exit 1", 1.8e9, 1.8e9 + 1, 0))
    save_state(RunDir(run), state)
    data = json.loads(RunDir(run).watch_state.read_text())
    data["recovery"].update(recovery)
    RunDir(run).watch_state.write_text(json.dumps(data))
    journal = Journal(run, job_id="7", restart_count=0)
    journal.append("segment_start", world_size=1, num_nodes=1, nodelist="n1", restored_step=None)
    journal.append("segment_end", exit_code=1, outcome="crash", reason="exit 1")


def _watch_state_wrong_types(run: Path, out: Outside) -> None:
    _watch_state(run, fault_time="yesterday", exclude=5)


def _watch_state_not_json(run: Path, out: Outside) -> None:
    _watch_state(run, cause=float("nan"), requeued_at=float("inf"))


def _watch_state_huge_numbers(run: Path, out: Outside) -> None:
    _watch_state(run, pending_since=10**400, start_now_attempts=-1)


def _manifest_time(run: Path, text: str) -> None:
    path = _ckpt(run, 3) / MANIFEST_NAME
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data).replace(f'"created_at": {data["created_at"]!r}', f'"created_at": {text}'))


def _manifest_nan_time(run: Path, out: Outside) -> None:
    _manifest_time(run, "NaN")


def _manifest_huge_time(run: Path, out: Outside) -> None:
    _manifest_time(run, HUGE)


def _tiers_hostile_record(run: Path, out: Outside) -> None:
    RunDir(run).ckpt_tiers.write_text(f'{{"format":1,"updated":NaN,"nodes":{{"n1":[3,{HUGE}]}}}}')


def _tiers_huge_step(run: Path, out: Outside) -> None:
    RunDir(run).ckpt_tiers.write_text(f'{{"format":1,"updated":1800000000,"nodes":{{"n1":[3,{HUGE}]}}}}')


def _inalloc_journal(run: Path) -> None:
    """Job 7's first segment, as the ranks journal it (the run then failed)."""
    Journal(RunDir(run), job_id="7", restart_count=0, attempt=0).append(
        "segment_start", world_size=1, num_nodes=1, nodelist="n1", restored_step=None)


def _allocation_link_to_secret(run: Path, out: Outside) -> None:
    _inalloc_journal(run)
    RunDir(run).allocation.symlink_to(out.secret)


def _allocation_fifo(run: Path, out: Outside) -> None:
    _inalloc_journal(run)
    os.mkfifo(RunDir(run).allocation)


def _allocation_hostile_record(run: Path, out: Outside) -> None:
    """Job 7's record naming a path as a fenced node, and a node both active and a spare."""
    _inalloc_journal(run)
    RunDir(run).allocation.write_text('{"version":1,"job_id":"7","generation":1,"active":["n1"],'
                                      '"spares":["n1"],"fenced":[{"node":"../../etc/shadow"}]}')


# Cases that change no checkpoint: the torch-heavy checkpoint commands would answer as over the
# pristine run (the first cases show that), so they are not run again (the module stays fast).
NO_CHECKPOINT_CHANGE = frozenset({"inspect --tensors 3", "export 3", "load_latest", "verify --all"})

LAUNCH_HOSTILE_ENV = {"SLURMFT_NPROC_PER_NODE": HUGE, "SLURMFT_RESIGNAL_S": "nan", "SLURMFT_PG_TIMEOUT_S": "1e400",
                      "SLURMFT_MIN_FREE_GB": "inf"}


def _bad3(text: str) -> dict[str, tuple[int, str | None]]:
    """Step 3 fails verification naming ``text`` (export verifies first); the newest valid is 2."""
    return {"verify": (1, text), "verify --all": (1, text), "export 3": (1, text)}


CASES: list[Case] = [
    Case("symlink_checkpoints", _symlink_checkpoints,
         {cmd: (2, "a symbolic link") for cmd in
          ("ls", "verify", "verify --all", "prune --dry-run", "prune", "inspect 3", "inspect --tensors 3",
           "export 3")}, loads=None),
    # The in-job side follows a linked run dir (SLURMFT_RUN_DIR is the job's own, used with its
    # rights): load_latest reads the other run, and `append` would write to it, so it is not run.
    Case("symlink_run_dir", _symlink_run_dir,
         {cmd: (2, "a symbolic link") for cmd in
          ("ls", "verify", "verify --all", "prune --dry-run", "prune", "inspect 3", "inspect --tensors 3",
           "export 3")}, skip=frozenset({"append"})),
    Case("symlink_step_and_tmp_dirs", _symlink_step,
         {"ls": (0, "step_000000004: a symbolic link"), "inspect 4": (2, "a symbolic link")}),
    Case("entry_link_to_secret", _entry_link_to_secret, _bad3("a symbolic link"), loads=2),
    Case("entry_fifo", _entry_fifo, _bad3("a FIFO"), loads=2),
    Case("entry_link_to_dev_zero", _entry_dev_zero, _bad3("a symbolic link"), loads=2),
    Case("metadata_link_to_outside_fifo", _entry_link_to_outside_fifo,
         _bad3("a symbolic link") | {"inspect --tensors 3": (2, "a symbolic link")}, loads=2),
    Case("manifest_link_to_secret", _manifest_link,
         _bad3("manifest.json: a symbolic link") | {"inspect 3": (2, "a symbolic link"),
                                                                  "inspect --tensors 3": (2, "a symbolic link"),
                                                                  "export 3": (2, "a symbolic link")},
         loads=2),
    Case("manifest_fifo", _manifest_fifo,
         _bad3("a FIFO") | {"inspect 3": (2, "a FIFO"), "inspect --tensors 3": (2, "a FIFO"),
                                          "export 3": (2, "a FIFO")}, loads=2),
    Case("manifest_nested", _manifest_nested,
         _bad3("nested too deeply") | {"inspect 3": (2, "nested too deeply"),
                                                      "inspect --tensors 3": (2, None), "export 3": (2, None)},
         loads=2),
    Case("manifest_huge_number", _manifest_huge_number,
         _bad3("not valid JSON") | {"inspect 3": (2, "not valid JSON"),
                                                   "inspect --tensors 3": (2, None), "export 3": (2, None)},
         loads=2),
    Case("manifest_huge_file", _manifest_huge_file,
         _bad3("more than") | {"inspect 3": (2, "more than"), "inspect --tensors 3": (2, None),
                                              "export 3": (2, None)}, loads=2),
    Case("metadata_pickle", _metadata_pickle,
         _bad3("posix.system") | {"inspect --tensors 3": (2, "posix.system")}, loads=2),
    Case("metadata_pickle_inside_metadata", _metadata_pickle_in_allowed_wrapper,
         _bad3("posix.system") | {"inspect --tensors 3": (2, "posix.system")}, loads=2),
    Case("odd_step_names", _odd_step_names,
         {"ls": (0, "not a canonical checkpoint name"), "inspect step_\u0663\u0663": (2, "not a step number"),
          "inspect " + "9" * 5000: (2, "not a step number"), "inspect 8": (2, "a FIFO")}),
    Case("stray_links_inside_a_checkpoint", _stray_link_in_checkpoint,
         _bad3("a symbolic link"), loads=2),
    Case("journal_fifo", _journal_fifo, {}, outcome="a FIFO"),
    Case("journal_link_to_secret", _journal_link, {}, outcome="a symbolic link"),
    Case("journal_hostile_lines", _journal_hostile_lines, {}, outcome="85"),
    # Issue 26: numbers no float can hold, NaN and Infinity, records of the wrong shape.
    Case("journal_hostile_numbers", _journal_hostile_numbers,
         {"status": (0, None), "interval": (0, None), "watch": (0, "requeue")}, outcome="85",
         skip=NO_CHECKPOINT_CHANGE),
    Case("watch_state_wrong_types", _watch_state_wrong_types,
         {"status": (0, "unreadable"), "watch": (2, "field recovery.fault_time")}, skip=NO_CHECKPOINT_CHANGE),
    Case("watch_state_not_json", _watch_state_not_json,
         {"status": (0, "unreadable"), "watch": (2, "not valid JSON (NaN is not a JSON number")},
         skip=NO_CHECKPOINT_CHANGE),
    Case("watch_state_huge_numbers", _watch_state_huge_numbers,
         {"status": (0, "unreadable"), "watch": (2, "field recovery.pending_since")}, skip=NO_CHECKPOINT_CHANGE),
    Case("manifest_nan_time", _manifest_nan_time,
         _bad3("not valid JSON") | {"inspect 3": (2, "NaN is not a JSON number"),
                                    "inspect --tensors 3": (2, None), "export 3": (2, None)}, loads=2),
    Case("manifest_huge_time", _manifest_huge_time,
         _bad3("must be a unix time") | {"inspect 3": (2, "must be a unix time"),
                                         "inspect --tensors 3": (2, None), "export 3": (2, None)}, loads=2),
    Case("tiers_not_json", _tiers_hostile_record, {"ls": (0, "node-local tiers not shown")},
         skip=NO_CHECKPOINT_CHANGE),
    Case("tiers_huge_step", _tiers_huge_step, {"ls": (0, "malformed entry for node 'n1'")},
         skip=NO_CHECKPOINT_CHANGE),
    # Issue 27: allocation.json, the in-allocation launcher's record, read by status and the
    # watcher: never followed, never blocking, never trusted; the failed job is still recovered.
    Case("allocation_link_to_secret", _allocation_link_to_secret,
         {"status": (0, "symbolic link"), "watch": (0, "requeue")}, skip=NO_CHECKPOINT_CHANGE),
    Case("allocation_fifo", _allocation_fifo,
         {"status": (0, "FIFO"), "watch": (0, "requeue")}, skip=NO_CHECKPOINT_CHANGE),
    Case("allocation_hostile_record", _allocation_hostile_record,
         {"status": (0, "both active and a spare"), "watch": (0, "requeue")}, skip=NO_CHECKPOINT_CHANGE),
    Case("launch_env_hostile_numbers", lambda run, out: None,
         {"launch_env": (86, "SLURMFT_")}, env=LAUNCH_HOSTILE_ENV, skip=NO_CHECKPOINT_CHANGE),
]


# ----------------------------------------------------------------------------- the real run


def make_model_state():
    """The training state the pristine run was saved from (and load_latest restores into)."""
    import torch

    from slurmft.checkpoint.state import TrainState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return TrainState(model, torch.optim.Adam(model.parameters(), lr=0.01))


def make_pristine(root: Path) -> Path:
    """A run dir with committed steps 1, 2, 3 written by slurmft's own manager (real DCP)."""
    import torch

    from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager

    state = make_model_state()
    manager = CheckpointManager(root, CheckpointConfig(keep_last=10), job_id="7", restart_count=0)
    for step in (1, 2, 3):
        state.model(torch.randn(4, 8)).square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        manager.save(step, state, block=True)
    manager.close()
    return root


def build_case(case: Case, pristine: Path, run: Path, outside: Outside) -> None:
    shutil.copytree(pristine, run, symlinks=True)
    case.build(run, outside)


COMMANDS = ("ls", "verify", "verify --all", "inspect 3", "inspect --tensors 3", "export 3",
            "prune --dry-run", "status", "interval", "outcome", "launch_env", "watch", "append", "load_latest",
            "prune")
# Commands that read the journal and the watcher's state, not the checkpoints (``watch``: two
# cycles of the watcher over a job that failed): each answers 0 or 2 (one line), never a
# traceback, a hang or a failed cycle, whatever the case; a case may name what it must answer.
JOURNAL_READERS = ("status", "interval", "watch")


def commands_for(case: Case) -> list[str]:
    """Every command, read-only ones first (prune last: it changes the run dir)."""
    extra = [c for c in case.expect if c not in COMMANDS]
    return [c for c in (*COMMANDS[:-1], *extra, COMMANDS[-1]) if c not in case.skip]
