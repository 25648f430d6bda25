"""The alert rules in deploy/prometheus/ checked by Prometheus's own tool: ``promtool check
rules`` (syntax, PromQL, templates) and ``promtool test rules`` (deploy/prometheus/tests/: each
alert fires, and stays quiet, on given series); and those series are the ones the watcher and the
sweeper really export (names and label names taken from a real exposition of each)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slurmft.sweep.run import SweepRequest, sweep
from slurmft.watch.metrics import WatchMetrics

pytestmark = pytest.mark.timeout(120)

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = sorted(PROM.glob("*.yml"))
TESTS = sorted((PROM / "tests").glob("*.test.yml"))


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: it comes with Debian's prometheus package (make install)"
    return path


def test_promtool_checks_the_rules():
    assert len(RULES) == 2
    proc = subprocess.run([promtool(), "check", "rules", *map(str, RULES)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_runs_the_rule_tests():
    proc = subprocess.run([promtool(), "test", "rules", *map(str, TESTS)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TESTS)


def test_every_rule_file_is_tested_and_every_alert_fires_and_stays_quiet_somewhere():
    tested = {}
    for test in TESTS:
        doc = yaml.safe_load(test.read_text())
        for name in doc["rule_files"]:
            cases = tested.setdefault((test.parent / name).resolve(), {})
            for group in doc["tests"]:
                for case in group.get("alert_rule_test", []):
                    cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert set(tested) == {r.resolve() for r in RULES}
    for rules in RULES:
        alerts = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
        cases = tested[rules.resolve()]
        assert alerts == set(cases), (rules.name, alerts ^ set(cases))
        for alert, outcomes in cases.items():
            assert outcomes == {True, False}, f"{alert}: needs a case where it fires and one where it does not"


_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")


def series_of(path: Path) -> set[tuple[str, frozenset]]:
    """(metric name, label names) of every input series of a promtool test file."""
    out = set()
    for group in yaml.safe_load(path.read_text())["tests"]:
        for series in group["input_series"]:
            m = _SERIES.match(series["series"])
            assert m, series["series"]
            labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
            out.add((m.group(1), labels))
    return out




def exposed(text: str) -> set[tuple[str, frozenset]]:
    return {(s.name, frozenset(s.labels)) for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def watch_exposition() -> set[tuple[str, frozenset]]:
    """What a watcher that saw a fault, a recovery, a checkpoint, an in-allocation run's spares
    and a give-up exports."""
    m = WatchMetrics(clock=lambda: 1_800_000_000.0)
    m.watching("42")
    m.record_fault("42", "crash", 20.0)
    m.record_recovery("42", "crash", 30.0)
    m.set_checkpoint("42", 1200, 90.0)
    m.set_spares("42", 0)
    m.cycle(0.04, observed=True)
    m.record_gave_up("7", "crash")
    return exposed(m.text().decode())


def sweep_exposition(tmp_path: Path) -> set[tuple[str, frozenset]]:
    """What two real sweeps write: one drains its node, the next is refused by the guard."""
    from test_sweep_run import MemorySlurm, configs

    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg, hc, _ = configs(tmp_path, exit_code=1)
    slurm = MemorySlurm(names=("n1", "n2"))
    text = ""
    for node in ("n1", "n2"):
        sweep(SweepRequest(node), cfg, hc, slurm)
        text += (tmp_path / "textfile" / f"slurmft_sweep_{node}.prom").read_text()
    return exposed(text)


def test_the_watch_rule_tests_use_the_series_the_watcher_exports():
    missing = series_of(PROM / "tests" / "slurmft-watch-alerts.test.yml") - watch_exposition()
    assert not missing, missing


def test_the_sweep_rule_tests_use_the_series_the_sweeper_writes(tmp_path):
    missing = series_of(PROM / "tests" / "slurmft-alerts.test.yml") - sweep_exposition(tmp_path)
    assert not missing, missing


def test_the_example_rules_in_the_guide_pass_promtool(tmp_path):
    """The extra rules docs/metrics.md shows are valid rules over exported metrics."""
    text = (PROM.parents[1] / "docs" / "metrics.md").read_text()
    examples = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert examples
    for i, body in enumerate(examples):
        path = tmp_path / f"example{i}.yml"
        path.write_text(body)
        proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        exported = {name for name, _ in watch_exposition() | sweep_exposition(tmp_path / str(i))}
        used = set(re.findall(r"\bslurmft_\w+", body))
        assert used and used <= exported, used - exported
