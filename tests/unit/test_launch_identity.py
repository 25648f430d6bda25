"""Job identity and settings over real job environments (tests/fixtures/launch-env)."""

import re
from pathlib import Path

import pytest

from launch_envs import recorded
from slurmft.launch import identity, settings
from slurmft.launch.identity import IdentityError
from slurmft.launch.settings import SettingsError

pytestmark = pytest.mark.timeout(30)


def test_non_array_job_uses_its_own_id_and_expands_the_nodelist():
    ident = identity.from_environ(recorded("nonarray"))
    assert (ident.slurm_id, ident.raw_job_id, ident.is_array_task) == ("1", "1", False)
    assert ident.nodes == ("n1", "n2") and ident.restart_count == 0 and ident.batch_node == "n1"


@pytest.mark.parametrize("name, raw, slurm_id", [("array-task0", "5", "2_0"),
                                                 ("array-task1", "2", "2_1")])
def test_array_task_is_named_array_underscore_task_even_when_its_id_is_the_arrays(name, raw, slurm_id):
    ident = identity.from_environ(recorded(name))
    assert (ident.raw_job_id, ident.slurm_id, ident.array_task_id) == (raw, slurm_id, slurm_id[-1])


def test_hetjob_is_refused_with_a_clear_message():
    with pytest.raises(IdentityError, match="SLURM_HET_SIZE=2: heterogeneous jobs are not supported"):
        identity.from_environ(recorded("hetjob"))


@pytest.mark.parametrize("change, needle", [
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "12;rm"}, "is not a job id"),
    ({"SLURM_ARRAY_TASK_ID": None}, "SLURM_ARRAY_JOB_ID is set without its partner"),
    ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT='-1' is not a count"),
    ({"SLURM_JOB_NODELIST": "n[1-"}, "is not a hostlist"),
    ({"SLURM_JOB_NUM_NODES": "2"}, "names 1 node"),
])
def test_malformed_environment_names_the_variable(change, needle):
    env = recorded("array-task1")
    for key, value in change.items():
        env.pop(key) if value is None else env.__setitem__(key, value)
    with pytest.raises(IdentityError, match=needle.replace("[", r"\[")):
        identity.from_environ(env)


def test_restart_count_is_read():
    ident = identity.from_environ({**recorded("nonarray"), "SLURM_RESTART_COUNT": "3"})
    assert ident.restart_count == 3 and ident.label == "job 1 restart 3"


def _settings(extra, name="nonarray"):
    env = {**recorded(name), "SLURMFT_RUN_DIR": "/runs/a", **extra}
    return settings.from_environ(env, identity.from_environ(env))


def test_settings_defaults():
    cfg = _settings({})
    assert (cfg.run_dir, cfg.nproc_per_node, cfg.resignal_s, cfg.min_free_gb) == (Path("/runs/a"), 1, 5.0, 1.0)


@pytest.mark.parametrize("name, value, needle", [
    ("SLURMFT_RESIGNAL_S", "abc", "SLURMFT_RESIGNAL_S='abc' must be a number"),
    ("SLURMFT_RESIGNAL_S", "0.01", "must be between 1 and"),      # the floor of a Slurm loop
    ("SLURMFT_RESIGNAL_S", "nan", "must be between"),
    ("SLURMFT_RESIGNAL_S", "inf", "must be between"),
    ("SLURMFT_NPROC_PER_NODE", "two", "SLURMFT_NPROC_PER_NODE='two' must be an integer"),
    ("SLURMFT_NPROC_PER_NODE", "0", "must be between 1"),
    ("SLURMFT_MIN_FREE_GB", "-1", "SLURMFT_MIN_FREE_GB='-1' must be between 0"),
    ("SLURMFT_PG_TIMEOUT_S", "1e400", "must be an integer"),
    ("SLURMFT_PREFLIGHT_TIMEOUT_S", "1", "must be between 10"),
    ("SLURMFT_PREFLIGHT_SWEEP_WAIT_S", "x", "SLURMFT_PREFLIGHT_SWEEP_WAIT_S='x' must be a number"),
    ("SLURMFT_RUN_DIR", "rel/dir", "must be an absolute path"),
    ("SLURMFT_RUN_DIR", "/a b", "must not contain spaces, commas"),
    ("SLURMFT_RUN_DIR", "/a,b", "must not contain spaces, commas"),
    ("SLURMFT_RUN_DIR", "/runs/%a", "not an array job"),
])
def test_every_number_and_the_run_dir_are_validated(name, value, needle):
    with pytest.raises(SettingsError, match=needle):
        _settings({name: value})


def test_array_task_run_dir_spelling_is_expanded_never_judged():
    """Whether tasks share a run dir is judged on disk (test_launch_claim.py), not from %a."""
    assert _settings({}, "array-task0").run_dir == Path("/runs/a")  # a wrapper may have spelled it
    assert _settings({"SLURMFT_RUN_DIR": "/runs/x_%A_%a"}, "array-task1").run_dir == Path("/runs/x_2_1")


def test_gpus_on_node_is_the_default_rank_count():
    assert _settings({"SLURM_GPUS_ON_NODE": "8"}).nproc_per_node == 8


def test_launcher_variables_are_not_read_as_config_fields():
    """The pre-flight's sweep and the ranks load [sweep]/[loop]/[checkpoint]... from this same
    environment, where an unknown SLURMFT_<SECTION>_<FIELD> is an error."""
    from slurmft.config import SECTIONS

    names = ["SLURMFT_RUN_DIR", "SLURMFT_PYTHON", "SLURMFT_NPROC_PER_NODE", "SLURMFT_MIN_FREE_GB",
             "SLURMFT_PG_TIMEOUT_S", "SLURMFT_RESIGNAL_S", "SLURMFT_PREFLIGHT_TIMEOUT_S",
             "SLURMFT_PREFLIGHT_SWEEP_WAIT_S", "SLURMFT_PREFLIGHT_SWEEP_FRESH_S", "SLURMFT_JOB_ID"]
    for name in names:
        rest = name.removeprefix("SLURMFT_").lower()
        assert not any(rest.startswith(section + "_") for section in SECTIONS), name
    settings_src = (Path(settings.__file__)).read_text()
    assert set(re.findall(r'"(SLURMFT_[A-Z_]+)"', settings_src)) <= set(names)
