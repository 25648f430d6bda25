"""``slurmft ckpt``: ls / verify / prune / inspect / export on real checkpoints written by CheckpointManager.

The checkpoints are made by slurmft's own manager (single process, real DCP); export is also
checked against a 2-rank FSDP2 checkpoint (real gloo processes). The torch-free claim is checked
in a subprocess where importing torch raises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from slurmft.cli import app
from slurmft.rundir import RunDir, step_dirname
from slurmft.checkpoint.manager import CheckpointConfig, CheckpointManager
from slurmft.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME
from slurmft.checkpoint.state import TrainState

REPO = Path(__file__).resolve().parents[2]
pytest_plugins = ("warm_ranks",)   # the session fixture: the FSDP2 writer's ranks forked warm


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run dir with committed steps 1, 2, 3 and an abandoned tmp dir; the step-3 model weights."""
    root = tmp_path_factory.mktemp("run")
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = CheckpointManager(root, CheckpointConfig(keep_last=10), job_id="4242", restart_count=1)
    state = TrainState(model, optimizer)
    for step in (1, 2, 3):
        _train_step(model, optimizer)
        manager.save(step, state, block=True)
    manager.close()
    abandoned = RunDir(root).checkpoints / f"{step_dirname(2)}.tmp-deadbeef"
    abandoned.mkdir()
    (abandoned / "__0_0.distcp").write_bytes(b"half written")
    return root, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def run(pristine_run, tmp_path) -> Path:
    """A private copy of the run dir that a test may damage."""
    copy = tmp_path / "run"
    shutil.copytree(pristine_run[0], copy)
    return copy


def ckpt(*args: str):
    return CliRunner(env={"COLUMNS": "240"}).invoke(app, ["ckpt", *map(str, args)])


def shard(run: Path, step: int) -> Path:
    return next(p for p in (RunDir(run).checkpoint(step)).iterdir() if p.suffix == ".distcp")


# ----------------------------------------------------------------------------- ls


def test_ls_json_lists_committed_and_tmp(run):
    result = ckpt("ls", run, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["checkpoints"]
    assert [(r["step"], r["committed"]) for r in rows] == [(1, True), (2, True), (2, False), (3, True)]
    committed = [r for r in rows if r["committed"]]
    assert all(r["manifest_ok"] and r["files"] >= 2 and r["world_size"] == 1 for r in committed)
    assert all(r["size_bytes"] > 0 and r["age_s"] >= 0 for r in rows)


def test_ls_table_names_each_directory(run):
    result = ckpt("ls", run)
    assert result.exit_code == 0, result.output
    for name in (step_dirname(1), step_dirname(3), "tmp-deadbeef", "in flight or abandoned"):
        assert name in result.output


# ----------------------------------------------------------------------------- verify


def test_verify_newest_by_default_and_all(run):
    newest = ckpt("verify", run)
    assert newest.exit_code == 0, newest.output
    assert newest.output.startswith(f"{step_dirname(3)}: ok")
    every = ckpt("verify", run, "--all", "--json")
    assert every.exit_code == 0, every.output
    data = json.loads(every.output)
    assert data["ok"] and [c["step"] for c in data["checkpoints"]] == [1, 2, 3]


def test_verify_names_each_corrupt_file(run):
    data_file = shard(run, 2)
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(raw)
    (RunDir(run).checkpoint(2) / "stray.bin").write_bytes(b"x")
    result = ckpt("verify", run, "2")
    assert result.exit_code == 1
    assert f"{data_file}: wrong checksum" in result.output
    assert "stray.bin: extra file" in result.output
    truncated = shard(run, 3)
    truncated.write_bytes(truncated.read_bytes()[:-1])
    every = ckpt("verify", run, "--all")
    assert every.exit_code == 1
    assert f"{step_dirname(1)}: ok" in every.output
    assert f"{truncated}: wrong size" in every.output


# ----------------------------------------------------------------------------- prune


def test_prune_dry_run_deletes_nothing(run):
    before = sorted(os.listdir(RunDir(run).checkpoints))
    result = ckpt("prune", run, "--keep-last", "1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"delete {step_dirname(1)}" in result.output and "dry run" in result.output
    assert sorted(os.listdir(RunDir(run).checkpoints)) == before


def test_prune_keeps_newest_valid_when_newest_is_corrupt(run):
    shard(run, 3).write_bytes(b"garbage")
    result = ckpt("prune", run, "--keep-last", "1")
    assert result.exit_code == 0, result.output
    # keep-last 1 keeps step 3; step 2 survives as the newest valid; step 1 and the tmp dir go
    assert RunDir(run).committed_steps() == [2, 3]
    assert not list(RunDir(run).checkpoints.glob("*.tmp-*"))
    assert f"keep   {step_dirname(2)} (newest valid)" in result.output


def test_prune_keep_every_and_milestones(run):
    result = ckpt("prune", run, "--keep-last", "1", "--keep-every", "2", "--milestone", "1")
    assert result.exit_code == 0, result.output
    assert RunDir(run).committed_steps() == [1, 2, 3]


def test_prune_rejects_bad_policy(run):
    before = sorted(os.listdir(RunDir(run).checkpoints))
    result = ckpt("prune", run, "--keep-last", "0")
    assert result.exit_code == 2
    assert result.output == "slurmft ckpt: [checkpoint] keep_last must be an integer >= 1, got 0\n"
    assert sorted(os.listdir(RunDir(run).checkpoints)) == before


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slurmft.toml"
    path.write_text(text)
    return path


def test_prune_uses_the_jobs_checkpoint_section(run, tmp_path):
    config = _toml(tmp_path, "[checkpoint]\ninterval = 100\nkeep_last = 1\nmilestones = [1]\n")
    result = ckpt("prune", run, "--config", config)
    assert result.exit_code == 0, result.output
    assert f"retention: keep the last 1, no keep-every, milestones: 1 (config file: {config})" in result.output
    assert RunDir(run).committed_steps() == [1, 3]


def test_prune_flags_override_single_settings(run, tmp_path):
    config = _toml(tmp_path, "[checkpoint]\nkeep_last = 1\nkeep_every = 2\n")
    result = ckpt("prune", run, "--config", config, "--keep-last", "3", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "keep the last 3, every step divisible by 2, milestones: none" in result.output
    assert "nothing to delete" not in result.output  # the abandoned tmp dir still goes
    assert f"delete {step_dirname(1)}" not in result.output


def test_prune_reads_slurmft_config_and_environment(run, tmp_path):
    config = _toml(tmp_path, "[checkpoint]\nkeep_last = 3\n")
    env = {"SLURMFT_CONFIG": str(config), "SLURMFT_CHECKPOINT_KEEP_LAST": "2",
           "SLURMFT_CHECKPOINT_MILESTONES": "1"}
    result = CliRunner(env=env).invoke(app, ["ckpt", "prune", str(run)])
    assert result.exit_code == 0, result.output
    assert "keep the last 2, no keep-every, milestones: 1" in result.output
    assert RunDir(run).committed_steps() == [1, 2, 3]  # 2 and 3 are the last two, 1 a milestone


@pytest.mark.parametrize("text, env, message", [
    ("[checkpoint]\nkeep_last = 0\n", {}, "[checkpoint] keep_last must be an integer >= 1, got 0"),
    ('[checkpoint]\nmilestones = "1,2"\n', {}, "[checkpoint] milestones must be a list, got str"),
    ("[checkpoint]\nkeep_lats = 2\n", {}, "[checkpoint] unknown key 'keep_lats'; valid keys:"),
    ("[checkpoint]\ninterval = 0\n", {}, "[checkpoint] interval must be >= 1, got 0"),
    ("", {"SLURMFT_CHECKPOINT_KEEP_EVERY": "often"}, "[checkpoint] keep_every must be an integer, got 'often'"),
    ("[checkpoint\n", {}, "config file "),
])
def test_prune_bad_config_names_the_key_and_deletes_nothing(run, tmp_path, text, env, message):
    before = sorted(os.listdir(RunDir(run).checkpoints))
    config = _toml(tmp_path, text)
    result = CliRunner(env=env).invoke(app, ["ckpt", "prune", str(run), "--config", str(config)])
    assert result.exit_code == 2
    assert result.output.startswith(f"slurmft ckpt: {message}") and result.output.count("\n") == 1, result.output
    assert sorted(os.listdir(RunDir(run).checkpoints)) == before


def test_prune_missing_config_file(run, tmp_path):
    result = ckpt("prune", run, "--config", tmp_path / "nope.toml")
    assert result.exit_code == 2
    assert result.output == f"slurmft ckpt: config file {tmp_path / 'nope.toml'} does not exist\n"


# ----------------------------------------------------------------------------- inspect


def test_inspect_prints_manifest(run):
    result = ckpt("inspect", run, step_dirname(2), "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.output)["manifest"]
    assert (manifest["step"], manifest["job_id"], manifest["restart_count"]) == (2, "4242", 1)
    assert ".metadata" in {f["path"] for f in manifest["files"]}
    table = ckpt("inspect", run, "2")
    assert table.exit_code == 0 and "4242" in table.output and "xxh3_128" in table.output


def test_inspect_tensors_lists_model_and_optimizer(run):
    result = ckpt("inspect", run, "3", "--tensors", "--json")
    assert result.exit_code == 0, result.output
    tensors = {t["key"]: t for t in json.loads(result.output)["tensors"]}
    assert tensors["model.0.weight"]["shape"] == [32, 16]
    assert tensors["model.0.weight"]["dtype"] == "float32"
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg") for k in tensors)


# ----------------------------------------------------------------------------- export


def test_export_writes_the_model_weights(pristine_run, run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    result = ckpt("export", run, "3", out)
    assert result.exit_code == 0, result.output
    exported = load_file(out)
    expected = pristine_run[1]
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    again = ckpt("export", run, "3", out)
    assert again.exit_code == 2 and "--force" in again.output
    assert ckpt("export", run, "3", out, "--force").exit_code == 0


def test_export_refuses_a_corrupt_checkpoint(run, tmp_path):
    shard(run, 3).write_bytes(b"garbage")
    out = tmp_path / "model.safetensors"
    result = ckpt("export", run, "3", out)
    assert result.exit_code == 1
    assert "wrong size" in result.output and not out.exists()
    assert not list(tmp_path.glob(".model.safetensors.*"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("swap", ["link to the same bytes", "fifo"])
def test_export_reads_no_file_swapped_after_its_verification(run, tmp_path, swap):
    # The CLI verifies, then loads: a shard replaced in between by a link (even to identical
    # bytes elsewhere) or a FIFO was followed, or hung root's export. It is refused, naming it.
    import os

    from slurmft.checkpoint.export import ExportError, load_model_weights
    from slurmft.checkpoint.manifest import read_manifest

    ckpt_dir = RunDir(run).checkpoint(3)
    manifest = read_manifest(ckpt_dir)
    victim = shard(run, 3)
    elsewhere = tmp_path / "elsewhere.distcp"
    elsewhere.write_bytes(victim.read_bytes())
    victim.unlink()
    if swap == "fifo":
        os.mkfifo(victim)
        needle = "a FIFO, not a regular file"
    else:
        victim.symlink_to(elsewhere)
        needle = "a symbolic link, not followed or read"
    with pytest.raises(ExportError, match=needle) as refused:
        load_model_weights(ckpt_dir, manifest)
    assert "\n" not in str(refused.value) and str(victim) in str(refused.value)


FSDP_WRITER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from slurmft.checkpoint.manager import CheckpointManager
    from slurmft.checkpoint.state import TrainState

    rank, store, run_dir, reference = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    # The full state dict first: FSDP2's device mesh keeps the default group (and its gloo
    # workers) alive past destroy_process_group, and such a worker still freeing a collective's
    # tensors when Python finalizes aborts the process (pytorch/pytorch#190489), so the last
    # collectives on it stay well away from the exit. The manager's own groups are joined by close().
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, reference)
    manager = CheckpointManager(run_dir)
    manager.save(7, TrainState(model, optimizer), block=True)
    manager.close()
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_export_consolidates_an_fsdp2_checkpoint_from_two_ranks(tmp_path, warm_ranks):
    from safetensors.torch import load_file

    script = tmp_path / "writer.py"
    script.write_text(FSDP_WRITER)
    run_dir, reference = tmp_path / "run", tmp_path / "reference.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [warm_ranks.popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(run_dir),
                               str(reference)], env=env, rank=r) for r in range(2)]
    try:
        assert [p.wait(timeout=100) for p in procs] == [0, 0]
    finally:
        warm_ranks.kill_all(procs)
    out = tmp_path / "w.safetensors"
    result = ckpt("export", run_dir, "7", out)
    assert result.exit_code == 0, result.output
    assert "saved by 2 rank(s)" in result.output
    exported, expected = load_file(out), torch.load(reference, weights_only=True)
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


# ----------------------------------------------------------------------------- the run dir, opened once
# Issue 18: root's `prune` checked the run dir, verified for a while, then looked `<run>/checkpoints`
# up by path again. A user who swapped their run dir for a link to another run in between had root
# delete the other run's checkpoints by the first run's plan; a run dir that was a link was followed.


def _tree(run: Path) -> list[str]:
    return sorted(os.listdir(RunDir(run).checkpoints))


@pytest.mark.parametrize("args", [("ls",), ("verify",), ("verify", "--all"), ("prune", "--keep-last", "1"),
                                  ("prune", "--keep-last", "1", "--dry-run"), ("inspect", "3"),
                                  ("export", "3", "o.safetensors")])
def test_a_run_dir_that_is_a_link_is_refused_and_its_target_untouched(run, tmp_path, args):
    link = tmp_path / "link"
    link.symlink_to(run)
    before = _tree(run)
    result = ckpt(args[0], link, *[tmp_path / a if a.endswith(".safetensors") else a for a in args[1:]])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"slurmft ckpt: {link}: a symbolic link"), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert _tree(run) == before and not (tmp_path / "o.safetensors").exists()


def _swap_after(monkeypatch, name: str, run: Path, other: Path, calls: int = 1) -> Path:
    """After the ``calls``-th call of ``slurmft.commands.ckpt.<name>``, move the run dir away and
    put a link to ``other`` in its place (what a user can do while root's command runs)."""
    from slurmft.commands import ckpt as ckpt_command

    real, moved, seen = getattr(ckpt_command, name), run.parent / "run.moved", []

    def swapping(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(1)
        if len(seen) == calls:
            run.rename(moved)
            run.symlink_to(other)
        return result

    monkeypatch.setattr(ckpt_command, name, swapping)
    return moved


def test_prune_deletes_in_the_run_it_checked_when_the_run_dir_is_swapped_mid_command(run, tmp_path,
                                                                                       monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = _tree(other)
    moved = _swap_after(monkeypatch, "newest_valid_step", run, other)
    result = ckpt("prune", run, "--keep-last", "1")
    assert result.exit_code == 0, result.output
    assert _tree(other) == before  # the other run: untouched
    assert _tree(moved) == [step_dirname(3)]  # the plan ran on the run that was checked


def test_verify_all_reads_the_run_it_opened_when_the_run_dir_is_swapped_mid_command(run, tmp_path,
                                                                                      monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    for step in (2, 3):
        shard(other, step).write_bytes(b"garbage")
    _swap_after(monkeypatch, "verify_with_progress", run, other)
    result = ckpt("verify", run, "--all", "--json")
    assert result.exit_code == 0, result.output
    assert [c["ok"] for c in json.loads(result.output)["checkpoints"]] == [True, True, True]


def test_export_reads_the_run_it_opened_when_the_run_dir_is_swapped_mid_command(pristine_run, run, tmp_path,
                                                                                  monkeypatch):
    from safetensors.torch import load_file

    other = tmp_path / "other"
    shutil.copytree(run, other)
    shard(other, 3).write_bytes(b"garbage")
    _swap_after(monkeypatch, "verify_with_progress", run, other)
    out = tmp_path / "model.safetensors"
    result = ckpt("export", run, "3", out)
    assert result.exit_code == 0, result.output
    exported = load_file(out)
    assert all(torch.equal(exported[name], tensor) for name, tensor in pristine_run[1].items())


# ----------------------------------------------------------------------------- bad input


def test_bad_run_dirs(run, tmp_path):
    missing = ckpt("ls", tmp_path / "nope")
    assert missing.exit_code == 2 and "no such directory" in missing.output
    (tmp_path / "plain").mkdir()
    plain = ckpt("verify", tmp_path / "plain")
    assert plain.exit_code == 2 and "not a slurmft run directory" in plain.output
    inner = ckpt("ls", RunDir(run).checkpoint(1))
    assert inner.exit_code == 2 and "is a checkpoint directory; pass its run directory" in inner.output


@pytest.mark.parametrize("command", ["verify", "inspect", "export"])
def test_a_tmp_dir_named_explicitly_is_refused(run, tmp_path, command):
    extra = [str(tmp_path / "o.safetensors")] if command == "export" else []
    result = ckpt(command, run, f"{step_dirname(2)}.tmp-deadbeef", *extra)
    assert result.exit_code == 2
    assert "in-flight or abandoned" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_unknown_step_and_garbage_selector(run):
    unknown = ckpt("inspect", run, "99")
    assert unknown.exit_code == 2 and "committed steps: 1, 2, 3" in unknown.output
    garbage = ckpt("verify", run, "latest")
    assert garbage.exit_code == 2 and "not a step number" in garbage.output


NEWER = f"written by a newer slurmft (format 99, this one reads up to {FORMAT_VERSION}): upgrade slurmft"


def _make_newer(run: Path, step: int) -> Path:
    path = RunDir(run).checkpoint(step) / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("args", [("inspect", "3"), ("export", "3", "o.safetensors"), ("verify", "3"),
                                  ("verify",), ("verify", "--all", "--json"), ("ls",), ("ls", "--json")])
def test_a_newer_manifest_format_says_upgrade(run, tmp_path, args):
    path = _make_newer(run, 3)
    result = ckpt(args[0], run, *[tmp_path / a if a.endswith(".safetensors") else a for a in args[1:]])
    assert result.exit_code == 2, result.output
    assert f"slurmft ckpt: {path}: {NEWER}\n" in result.output
    assert "CORRUPT" not in result.output and not (tmp_path / "o.safetensors").exists()


def test_ls_lists_a_newer_checkpoint_before_refusing(run):
    _make_newer(run, 2)
    result = ckpt("ls", run, "--json")
    listed = json.loads(result.output[:result.output.rindex("}") + 1])
    newer = [c for c in listed["checkpoints"] if c["newer_format"]]
    assert [c["step"] for c in newer] == [2] and result.exit_code == 2


@pytest.mark.parametrize("step", [1, 3])
def test_prune_deletes_nothing_while_a_newer_checkpoint_is_present(run, step):
    before = sorted(os.listdir(RunDir(run).checkpoints))
    path = _make_newer(run, step)
    result = ckpt("prune", run, "--keep-last", "1")
    assert result.exit_code == 2
    assert result.output == f"slurmft ckpt: {path}: {NEWER}; nothing pruned\n"
    assert sorted(os.listdir(RunDir(run).checkpoints)) == before


def test_export_output_name_must_be_safetensors(run, tmp_path):
    result = ckpt("export", run, "3", tmp_path / "model.bin")
    assert result.exit_code == 2 and "must end in .safetensors" in result.output


# ----------------------------------------------------------------------------- no torch


NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch must not be imported by this command")
            return None

    sys.meta_path.insert(0, NoTorch())
    from slurmft.cli import app
    from typer.testing import CliRunner
    for args in sys.argv[1:]:
        result = CliRunner().invoke(app, args.split("|"))
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        print(result.exit_code)
""")


@pytest.mark.timeout(60)
def test_ls_verify_prune_inspect_work_without_torch(run):
    config = run.parent / "slurmft.toml"
    config.write_text("[checkpoint]\nkeep_last = 2\n")
    commands = [f"ckpt|ls|{run}", f"ckpt|verify|{run}|--all", f"ckpt|inspect|{run}|3",
                f"ckpt|prune|{run}|--keep-last|2|--dry-run", f"ckpt|prune|{run}|--config|{config}|--dry-run",
                f"ckpt|ls|{run}|--json"]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *commands], capture_output=True, text=True,
                          timeout=50, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"] * len(commands)


def test_checkpoint_config_imports_without_torch():
    code = ("import sys, slurmft.checkpoint.config as c; c.CheckpointConfig.load(environ={}); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60, cwd=REPO).returncode == 0


def test_checkpoint_config_is_the_one_the_manager_uses():
    from slurmft.checkpoint import config, manager

    assert manager.CheckpointConfig is config.CheckpointConfig
