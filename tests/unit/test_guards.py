"""StepGuard verdicts: non-finite values, spikes against the rolling median, give-up window."""

import math

import pytest

from slurmft.train.guards import GuardConfig, StepGuard, Verdict


def test_finite_steady_steps_pass():
    guard = StepGuard()
    assert all(guard.check(2.0, 1.0 + 0.01 * i).ok for i in range(100))


@pytest.mark.parametrize("loss, norm, needle", [
    (math.nan, 1.0, "non-finite loss"),
    (math.inf, 1.0, "non-finite loss"),
    (1.0, math.nan, "non-finite gradient norm"),
])
def test_non_finite_trips_with_the_configured_action(loss, norm, needle):
    for action, verdict in (("skip", Verdict.SKIP), ("rollback", Verdict.ROLLBACK)):
        result = StepGuard(GuardConfig(action=action)).check(loss, norm)
        assert result.verdict is verdict and needle in result.reason


def test_spike_needs_history_and_uses_the_median():
    guard = StepGuard(GuardConfig(spike_factor=5, spike_window=10, spike_min_history=5))
    assert guard.check(1.0, 100.0).ok  # no history yet: cannot call it a spike
    for _ in range(5):
        assert guard.check(1.0, 1.0).ok
    result = guard.check(1.0, 6.0)  # median of [100, 1 x5] is 1
    assert result.verdict is Verdict.SKIP and "rolling median" in result.reason
    assert guard.check(1.0, 4.0).ok


def test_repeated_trouble_gives_up_only_within_the_window():
    guard = StepGuard(GuardConfig(max_trips=3, trip_window=10))
    assert guard.check(math.nan, 1).verdict is Verdict.SKIP
    for _ in range(10):
        guard.check(1.0, 1.0)
    assert guard.check(math.nan, 1).verdict is Verdict.SKIP  # first trip fell out of the window
    assert guard.check(math.nan, 1).verdict is Verdict.SKIP
    result = guard.check(math.nan, 1)
    assert result.verdict is Verdict.GIVE_UP and result.trips_in_window == 3


@pytest.mark.parametrize("kwargs", [dict(spike_factor=0.5), dict(max_trips=0),
                                    dict(spike_window=3, spike_min_history=4)])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        GuardConfig(**kwargs)


def test_config_loads_from_the_guards_section(tmp_path):
    from slurmft.config import ConfigError, load_section
    cfg = load_section(GuardConfig, "guards", environ={"SLURMFT_GUARDS_ACTION": "rollback"})
    assert cfg.action == "rollback"
    with pytest.raises(ConfigError, match="action"):
        load_section(GuardConfig, "guards", environ={"SLURMFT_GUARDS_ACTION": "panic"})
