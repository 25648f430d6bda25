"""matrix/helper.py: the Python half of the Slurm test matrix (matrix/run.sh is the other).

Two jobs, both pure file reading:
  deps PYPROJECT            print the requirements a matrix venv needs (core + ``dev`` extra),
                            one per line, as pyproject.toml declares them;
  report RESULTS SUITE...   print, from the run's junit XML and measurement journals, one table
                            of test outcomes per suite and one table of measured release behaviour,
                            then one ``matrix: FAILED <suite> ...`` line per failed, errored or
                            skipped test and per suite without results; exit 1 if there is any.

A measurement journal (``RESULTS/<suite>.jsonl``) holds one JSON object per line,
``{"feature": ..., "value": ...}``, appended by the integration tests through ``$SLURMFT_MATRIX_REPORT``.
Runs with the interpreter of the host (3.11+: tomllib); imports nothing from slurmft.
"""

from __future__ import annotations

import json
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path


def dev_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project.get("dependencies", [])) + list(
        project.get("optional-dependencies", {}).get("dev", [])
    )


def junit_counts(xml_path: Path) -> dict[str, int]:
    """Totals over every <testsuite> of a pytest junit file."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["time"] = round(sum(float(s.get("time", 0)) for s in suites))
    return counts


def problems(xml_path: Path) -> list[str]:
    """``path::test: what`` for every test that did not pass (failure, error, skip), and a line
    when nothing ran. The matrix exists to run these tests on a release: a skip tested nothing."""
    root = ET.parse(xml_path).getroot()
    found = []
    for case in root.iter("testcase"):
        test = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "?")
        for outcome in case:
            if outcome.tag in ("failure", "error", "skipped"):
                message = (outcome.get("message") or "").strip().splitlines()[:1]
                found.append(f"{test}: {outcome.tag}" + (f": {message[0][:200]}" if message else ""))
    if junit_counts(xml_path)["tests"] == 0:
        found.append("no test ran")
    return found


def verdict_lines(results: Path, suites: list[str]) -> list[str]:
    lines = []
    for suite in suites:
        xml_path = results / f"{suite}.xml"
        release = read_journal(results / f"{suite}.jsonl").get("slurm release", "?")
        if not xml_path.exists():
            lines.append(f"matrix: FAILED {suite}: no test results (rootfs, venv or pytest start failed)")
            continue
        lines += [f"matrix: FAILED {suite} (Slurm {release}): {p}" for p in problems(xml_path)]
    return lines


def read_journal(path: Path) -> dict[str, str]:
    """feature -> value; a later line for the same feature wins; a torn last line is skipped."""
    values: dict[str, str] = {}
    if not path.exists():
        return values
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        values[str(item["feature"])] = str(item["value"])
    return values


def outcome_table(results: Path, suites: list[str]) -> list[str]:
    rows = ["| suite | Slurm | tests | passed | failed | errors | skipped | seconds |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for suite in suites:
        xml_path = results / f"{suite}.xml"
        release = read_journal(results / f"{suite}.jsonl").get("slurm release", "?")
        if not xml_path.exists():
            rows.append(f"| {suite} | {release} | no result (rootfs, venv or pytest start failed) | | | | | |")
            continue
        c = junit_counts(xml_path)
        passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
        rows.append(f"| {suite} | {release} | {c['tests']} | {passed} | {c['failures']} "
                    f"| {c['errors']} | {c['skipped']} | {c['time']} |")
    return rows


def feature_table(results: Path, suites: list[str]) -> list[str]:
    journals = {s: read_journal(results / f"{s}.jsonl") for s in suites}
    features: list[str] = []
    for journal in journals.values():
        features += [f for f in journal if f not in features and f != "slurm release"]
    if not features:
        return []
    head = [journals[s].get("slurm release", s) for s in suites]
    rows = ["| feature | " + " | ".join(head) + " |", "| --- |" + " --- |" * len(suites)]
    for feature in features:
        cells = [feature] + [journals[s].get(feature, "not measured") for s in suites]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "deps":
        print("\n".join(dev_requirements(Path(argv[1]))))
        return 0
    if len(argv) >= 3 and argv[0] == "report":
        results, suites = Path(argv[1]), argv[2:]
        print("\n".join(outcome_table(results, suites)))
        features = feature_table(results, suites)
        if features:
            print()
            print("\n".join(features))
        failed = verdict_lines(results, suites)
        if failed:
            print()
            print("\n".join(failed))
        return 1 if failed else 0
    print("usage: helper.py deps PYPROJECT | report RESULTS_DIR SUITE...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
