"""``slurmft sweep`` refuses bad input with one line and exit 2, before touching Slurm; so does
``python -m slurmft.sweep.main`` (the pre-flight's way in), whose options are the command's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from slurmft.cli import app, build
from slurmft.sweep import main as sweep_main


def _run(door: str, args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """(exit code, output) of the sweep with ``args``, through the CLI or the module's parser."""
    if door == "cli":
        result = CliRunner().invoke(app, ["sweep", *args], env={"SLURMFT_CONFIG": ""})
        return result.exit_code, result.output
    monkeypatch.setenv("SLURMFT_CONFIG", "")
    try:
        code = sweep_main.main(args)
    except SystemExit as exc:   # argparse's refusal
        code = exc.code
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("args,toml,message", [
    (["--quick", "--deep"], None, "--quick and --deep exclude each other"),
    (["--node", "n1/../../etc"], None, "invalid node name 'n1/../../etc'"),
    (["--node", "n1"], '[sweep]\nchecks = ["gpu_ecc", "gpu_temp"]\n', "unknown check 'gpu_temp'"),
    (["--node", "n1"], "[sweep]\nmax_drain_share = \"lots\"\n", "[sweep] max_drain_share must be a number"),
    (["--node", "n1"], "[health_gpu]\nexpected_count = 8.5\n", "[health_gpu] expected_count must be an integer"),
    (["--node", "n1"], "[sweep]\nmax_drian_share = 0.2\n", "[sweep] unknown key 'max_drian_share'"),
])
@pytest.mark.parametrize("door", ["cli", "module"])
def test_bad_input_exits_2_with_one_line(tmp_path, args, toml, message, door, capsys, monkeypatch):
    if toml is not None:
        (tmp_path / "slurmft.toml").write_text(toml)
        cfg = tmp_path / "slurmft.toml"
        args = args + ["--config", str(cfg)]
    code, output = _run(door, args, capsys, monkeypatch)
    assert code == 2, output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("slurmft-sweep: error: ") and message in lines[0]


@pytest.mark.parametrize("door", ["cli", "module"])
@pytest.mark.parametrize("args,expected", [
    ([], dict(node=None, config=None, quick=False, deep=False, dry_run=False, as_json=False, forget_xids=False)),
    (["--node", "n3", "--config", "c.toml", "--quick"], dict(node="n3", config="c.toml", quick=True)),
    (["--deep"], dict(deep=True)), (["--dry-run"], dict(dry_run=True)), (["--json"], dict(as_json=True)),
    (["--forget-xids"], dict(forget_xids=True)),
])
def test_each_option_reaches_the_same_parameter_of_the_sweep_both_ways_in(door, args, expected, capsys,
                                                                          monkeypatch):
    import slurmft.commands.sweep as command

    calls: list[dict] = []

    def fake(node, config, quick, deep, dry_run, as_json, forget_xids):
        calls.append(dict(node=node, config=None if config is None else str(config), quick=quick, deep=deep,
                          dry_run=dry_run, as_json=as_json, forget_xids=forget_xids))
        return 7

    monkeypatch.setattr(command, "run", fake)
    monkeypatch.setattr(sweep_main, "run", fake)
    code, output = _run(door, args, capsys, monkeypatch)
    assert code == 7, output
    [call] = calls
    assert {k: call[k] for k in expected} == expected
    assert sum(call[k] is True for k in ("quick", "deep", "dry_run", "as_json", "forget_xids")) == \
        sum(v is True for v in expected.values())


def test_the_modules_options_are_the_commands_with_the_same_help():
    command = typer.main.get_command(build("sweep")).commands["sweep"]
    cli = {opt: param.help for param in command.params for opt in param.opts if opt != "--help"}
    assert cli == dict(sweep_main.OPTIONS)
    module = {opt for action in sweep_main.parser()._actions for opt in action.option_strings}
    assert module - {"-h", "--help"} == set(cli)


def test_the_module_refuses_an_unknown_or_abbreviated_option_in_one_line(capsys, monkeypatch):
    for args, named in ((["--quik"], "--quik"), (["--dry"], "--dry"), (["--node"], "--node")):
        code, output = _run("module", args, capsys, monkeypatch)
        lines = [ln for ln in output.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and named in lines[0], output
        assert lines[0].startswith("slurmft-sweep: error: ")


@pytest.mark.timeout(60)
def test_the_module_runs_as_a_script(tmp_path):
    """Its own process, as the pre-flight starts it: a config error is its exit 2 and one line."""
    done = subprocess.run([sys.executable, "-m", "slurmft.sweep.main", "--quick", "--dry-run", "--json",
                           "--node", "n1", "--config", str(tmp_path / "nope.toml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"slurmft-sweep: error: config file {tmp_path / 'nope.toml'} does not exist"


def test_missing_config_file_is_named(tmp_path):
    result = CliRunner().invoke(app, ["sweep", "--node", "n1", "--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and f"config file {tmp_path / 'nope.toml'} does not exist" in result.output


def test_a_drain_whose_report_cannot_be_written_exits_5_and_says_it_drained(tmp_path, monkeypatch):
    """A full disk (what node_disk drains for) must not turn "drained" into exit 2 "nothing
    drained"."""
    from test_sweep_run import MemorySlurm, configs

    import slurmft.sweep.main as command

    cfg, _, _ = configs(tmp_path, exit_code=1)
    (tmp_path / "reports").write_text("not a directory")
    config = tmp_path / "slurmft.toml"
    config.write_text(f"""[sweep]
checks = ["external_site"]
state_dir = "{cfg.state_dir}"
report_dir = "{cfg.report_dir}"
textfile_dir = "{cfg.textfile_dir}"
[[health_external.commands]]
name = "site"
argv = ["{tmp_path / 'site-check'}"]
""")
    slurm = MemorySlurm()
    monkeypatch.setattr(command, "_client", lambda config_file: slurm)
    result = CliRunner().invoke(app, ["sweep", "--node", "n2", "--config", str(config)],
                                env={"SLURMFT_CONFIG": ""})
    assert result.exit_code == 5, result.output
    assert slurm.calls == [("drain", "n2")]
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("slurmft-sweep: node=n2 status=fail action=drain acted=drained ")
    assert f"write_errors='report: {tmp_path / 'reports'}: File exists'" in last
