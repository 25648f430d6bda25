"""Config layering and validation: defaults < toml < environment < overrides; errors name keys."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurmft.config import ConfigError, load_section


@dataclass(frozen=True)
class Demo:
    interval: int = 10
    share: float = 0.1
    paths: tuple[str, ...] = ()
    dry: bool = False
    where: Path | None = None


def write(tmp_path, text):
    p = tmp_path / "slurmft.toml"
    p.write_text(text)
    return p


def test_layers_in_order(tmp_path):
    cfg = write(tmp_path, "[demo]\ninterval = 20\nshare = 0.2\n")
    got = load_section(Demo, "demo", config_file=cfg, environ={"SLURMFT_DEMO_SHARE": "0.3"},
                       overrides={"dry": True, "interval": None})
    assert got == Demo(interval=20, share=0.3, dry=True)


def test_unknown_key_lists_valid_ones(tmp_path):
    cfg = write(tmp_path, "[demo]\nintervall = 3\n")
    with pytest.raises(ConfigError, match=r"\[demo\] unknown key 'intervall'; valid keys: dry, interval"):
        load_section(Demo, "demo", config_file=cfg, environ={})


def test_wrong_type_names_key(tmp_path):
    cfg = write(tmp_path, '[demo]\ninterval = "often"\n')
    with pytest.raises(ConfigError, match=r"\[demo\] interval must be an integer"):
        load_section(Demo, "demo", config_file=cfg, environ={})


def test_bool_is_not_an_int(tmp_path):
    cfg = write(tmp_path, "[demo]\ninterval = true\n")
    with pytest.raises(ConfigError, match="interval"):
        load_section(Demo, "demo", config_file=cfg, environ={})


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_section(Demo, "demo", config_file=tmp_path / "nope.toml", environ={})


def test_env_list_and_path(tmp_path):
    got = load_section(Demo, "demo", config_file=write(tmp_path, ""),
                       environ={"SLURMFT_DEMO_PATHS": "/a, /b", "SLURMFT_DEMO_WHERE": "/x"})
    assert got.paths == ("/a", "/b") and got.where == Path("/x")


@dataclass(frozen=True)
class Inner:
    argv: tuple[str, ...] = ()
    timeout: float = 1.0


@dataclass(frozen=True)
class Outer:
    inner: Inner = Inner()


def test_nested_error_label_is_balanced(tmp_path):
    cfg = write(tmp_path, '[outer.inner]\ntimeout = "soon"\n')
    with pytest.raises(ConfigError, match=r"^\[outer\.inner\] timeout must be a number"):
        load_section(Outer, "outer", config_file=cfg, environ={})


def test_toml_list_stays_a_list_even_with_commas_inside(tmp_path):
    cfg = write(tmp_path, '[demo]\npaths = ["/a,b", "/c"]\n')
    assert load_section(Demo, "demo", config_file=cfg, environ={}).paths == ("/a,b", "/c")


def test_toml_string_for_a_list_field_is_an_error_naming_the_key(tmp_path):
    cfg = write(tmp_path, '[demo]\npaths = "/a, /b"\n')
    with pytest.raises(ConfigError, match=r"^\[demo\] paths must be a list, got str$"):
        load_section(Demo, "demo", config_file=cfg, environ={})


def test_only_environment_strings_are_split(tmp_path):
    cfg = write(tmp_path, '[demo]\npaths = ["/toml"]\n')
    got = load_section(Demo, "demo", config_file=cfg, environ={"SLURMFT_DEMO_PATHS": "/x,/y"})
    assert got.paths == ("/x", "/y")
    # an override replaces the environment value and is not split: it must already be a list
    with pytest.raises(ConfigError, match=r"\[demo\] paths must be a list"):
        load_section(Demo, "demo", config_file=cfg, environ={"SLURMFT_DEMO_PATHS": "/x,/y"},
                     overrides={"paths": "/o,/p"})
    got = load_section(Demo, "demo", config_file=cfg, environ={"SLURMFT_DEMO_PATHS": "/x,/y"},
                       overrides={"paths": ["/o"]})
    assert got.paths == ("/o",)


@dataclass(frozen=True)
class Steps:
    milestones: tuple[int, ...] | None = None


def test_env_list_items_are_parsed_as_their_type_and_named_on_error(tmp_path):
    cfg = write(tmp_path, "")
    assert load_section(Steps, "s", config_file=cfg, environ={"SLURMFT_S_MILESTONES": "10, 20"}).milestones == (10, 20)
    with pytest.raises(ConfigError, match=r"\[s\] milestones\[1\] must be an integer, got 'x'"):
        load_section(Steps, "s", config_file=cfg, environ={"SLURMFT_S_MILESTONES": "10,x"})
    with pytest.raises(ConfigError, match=r"\[s\] milestones must be a list, got str"):
        load_section(Steps, "s", config_file=write(tmp_path, '[s]\nmilestones = "10"\n'), environ={})


@pytest.mark.parametrize("line, message", [
    ('interval = "20"', r"\[demo\] interval must be an integer, got '20'"),
    ('share = "0.5"', r"\[demo\] share must be a number, got '0.5'"),
    ('dry = "true"', r"\[demo\] dry must be a boolean, got 'true'"),
])
def test_toml_strings_are_not_numbers_or_booleans(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message):
        load_section(Demo, "demo", config_file=write(tmp_path, f"[demo]\n{line}\n"), environ={})


def test_environment_strings_are_parsed_as_numbers_and_booleans(tmp_path):
    env = {"SLURMFT_DEMO_INTERVAL": "20", "SLURMFT_DEMO_SHARE": "0.5", "SLURMFT_DEMO_DRY": "yes"}
    got = load_section(Demo, "demo", config_file=write(tmp_path, ""), environ=env)
    assert (got.interval, got.share, got.dry) == (20, 0.5, True)


def test_unknown_section_is_rejected_with_the_valid_ones(tmp_path):
    cfg = write(tmp_path, "[sweeep]\nmax_drain_share = 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_section(Demo, "demo", config_file=cfg, environ={})
    assert str(err.value) == (
        f"config file {cfg}: unknown section [sweeep]; valid sections: checkpoint, demo, guards, "
        "health_dcgm, health_external, health_gpu, health_node, health_xid, journal, loop, preemption, slurm, sweep, watch")


def test_known_sections_of_other_components_are_accepted(tmp_path):
    cfg = write(tmp_path, "[demo]\ninterval = 3\n[sweep]\nmax_drain_share = 0.2\n[checkpoint]\n")
    assert load_section(Demo, "demo", config_file=cfg, environ={}).interval == 3


def test_env_variable_of_a_known_section_with_an_unknown_field_is_rejected(tmp_path):
    from slurmft.sweep.config import SweepConfig

    with pytest.raises(ConfigError) as err:
        load_section(SweepConfig, "sweep", config_file=write(tmp_path, ""),
                     environ={"SLURMFT_SWEEP_MAX_DRIAN_SHARE": "0.2"})
    assert str(err.value) == (
        "SLURMFT_SWEEP_MAX_DRIAN_SHARE: [sweep] has no key 'max_drian_share'; valid keys: checks, "
        "fact_timeout_s, max_drain_share, min_drain_allowed, report_dir, state_dir, textfile_dir "
        "(as SLURMFT_SWEEP_<KEY>)")


def test_env_variables_of_other_sections_and_longer_section_names_are_not_this_section_s():
    from slurmft.config import section_env

    env = {"SLURMFT_HEALTH_GPU_EXPECTED_COUNT": "8", "SLURMFT_RUN_DIR": "/r", "SLURMFT_CONFIG": "x",
           "SLURMFT_SWEEP_CHECKS": "gpu_ecc"}
    assert section_env(env, "sweep") == [("SLURMFT_SWEEP_CHECKS", "checks")]
    assert section_env(env, "health") == []  # no such section, but health_gpu's are not its
    assert section_env(env, "health_gpu") == [("SLURMFT_HEALTH_GPU_EXPECTED_COUNT", "expected_count")]


def test_every_section_a_component_loads_is_registered():
    """A section loaded somewhere but missing from SECTIONS would be rejected in every file."""
    import re

    from slurmft.config import SECTIONS

    root = Path(__file__).resolve().parents[2] / "slurmft"
    loaded = set()
    for source in root.rglob("*.py"):
        text = source.read_text()
        loaded |= set(re.findall(r'load_section\(\s*\w+,\s*"(\w+)"', text))
        loaded |= set(re.findall(r'^SECTION = "(\w+)"', text, re.M))
    assert loaded and loaded <= set(SECTIONS), loaded - set(SECTIONS)


def test_root_never_reads_the_working_directory_s_config(tmp_path, monkeypatch):
    from slurmft import config

    write(tmp_path, "[[health_external.commands]]\nname = 'x'\nargv = ['/bin/true']\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURMFT_CONFIG", raising=False)
    monkeypatch.setattr(config, "SYSTEM_CONFIG", tmp_path / "etc" / "slurmft.toml")
    assert config.find_config_file(root=False) == Path("slurmft.toml")
    assert config.find_config_file(root=True) is None
    (tmp_path / "etc").mkdir()
    system = write(tmp_path / "etc", "")
    if os.geteuid() == 0:  # only root can make a root-owned file
        assert config.find_config_file(root=True) == system


@pytest.mark.parametrize("what, mode", [("file", 0o666), ("directory", 0o777)])
def test_root_refuses_a_config_others_can_change(tmp_path, what, mode):
    from slurmft.config import find_config_file

    folder = tmp_path / "conf"
    folder.mkdir()
    path = write(folder, "[sweep]\n")
    target = path if what == "file" else folder
    target.chmod(mode)
    with pytest.raises(ConfigError) as err:
        find_config_file(path, root=True)
    assert str(err.value) == (f"config file {path}: {target} is writable by group or others "
                              f"(mode {mode:o}); as root, slurmft reads only a config that no one "
                              "else can change")
    assert find_config_file(path, root=False) == path


def test_root_refuses_a_config_owned_by_someone_else(tmp_path):
    from slurmft.config import find_config_file

    path = write(tmp_path, "[sweep]\n")
    if os.geteuid() == 0:
        os.chown(path, 1000, 1000)
    with pytest.raises(ConfigError, match=rf"config file {path}: {path} is owned by uid \d+; as root"):
        find_config_file(path, root=True)
