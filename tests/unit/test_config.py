"""Config layering and validation: defaults < toml < environment < overrides; errors name keys."""

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
