"""The user guide (docs/, built by MkDocs): the strict build passes; every fenced code block is
either run by a test or marked as not runnable here (docs/about-these-docs.md, "Examples that
cannot rot"); the TOML examples load through ``slurmft.config``; and the configuration reference
has a row for every field of every section's config dataclass, and no other."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.config import SECTIONS, load_section

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))

# Each table of slurmft.toml and the dataclass load_section reads it into.
CONFIG_CLASSES = {
    "checkpoint": "slurmft.checkpoint.config:CheckpointConfig",
    "guards": "slurmft.train.guards:GuardConfig",
    "health_dcgm": "slurmft.health.dcgm:DcgmConfig",
    "health_external": "slurmft.health.external:ExternalConfig",
    "health_gpu": "slurmft.health.gpu_checks:GpuConfig",
    "health_node": "slurmft.health.node:NodeConfig",
    "health_xid": "slurmft.health.xid:XidConfig",
    "journal": "slurmft.journal:JournalConfig",
    "loop": "slurmft.train.run_config:RunConfig",
    "preemption": "slurmft.train.preemption:PreemptionConfig",
    "slurm": "slurmft.slurm.config:SlurmConfig",
    "sweep": "slurmft.sweep.config:SweepConfig",
    "watch": "slurmft.watch.config:WatchConfig",
}

_MARKER = re.compile(r"^<!-- (run|not-run): (\S.*?) -->$")
_FENCE = re.compile(r"^\s*(```+)\s*([\w+-]*)")


def blocks(page: Path):
    """(line number, language, marker kind, marker text, body) of every fenced block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, lang = i, m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = _MARKER.match(prev)
        yield (start + 1, lang, marker.group(1) if marker else None, marker.group(2) if marker else "",
               "\n".join(lines[start + 1:j]))
        i = j + 1


def config_class(section: str):
    module, name = CONFIG_CLASSES[section].split(":")
    return getattr(importlib.import_module(module), name)


# make docs's build (the Makefile's recipe is checked to be this). Not -q: mkdocs 1.6 drops its
# warnings under -q before --strict counts them, so a broken link passed (2026-11-29).
BUILD = ("build", "--strict")


def _mkdocs() -> str:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs not found: make install installs the docs extra"
    return mkdocs


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_mkdocs(), *BUILD, "-f", str(config), "-d", str(site)], capture_output=True,
                          text=True, timeout=110, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strictly(tmp_path):
    proc = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def test_make_docs_builds_as_this_test_does_and_a_broken_link_fails_it(tmp_path):
    recipe = (REPO / "Makefile").read_text().split("\ndocs: venv\n", 1)[1].split("\n", 1)[0]
    assert recipe.split("mkdocs ", 1)[1].split() == list(BUILD), recipe
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](no-such-page.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nnav:\n  - index.md\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_every_code_block_is_run_by_a_test_or_marked_not_runnable():
    seen = 0
    for page in PAGES:
        for line, lang, kind, what, _ in blocks(page):
            seen += 1
            where = f"{page.name}:{line}"
            assert kind, f"{where}: a code block without <!-- run: ... --> or <!-- not-run: WHY -->"
            if kind == "run" and lang != "toml":
                test = re.search(r"(tests/\S+\.py)::(\w+)", what)
                assert test, f"{where}: 'run:' names no test (tests/FILE.py::test_name)"
                source = REPO / test.group(1)
                assert source.is_file() and f"def {test.group(2)}(" in source.read_text(), \
                    f"{where}: {test.group(0)} does not exist"
    assert seen >= 14


def test_the_toml_examples_load(tmp_path):
    import tomllib

    loaded = 0
    for page in PAGES:
        for line, lang, kind, _, body in blocks(page):
            if lang != "toml":
                continue
            assert kind == "run", f"{page.name}:{line}: a TOML example is loaded by this test: mark it <!-- run: ... -->"
            path = tmp_path / f"{page.stem}-{line}.toml"
            # A site command's argv[0] must exist on this machine: the example's program
            # (/usr/sbin/nhc) stands for one that exists here.
            body = re.sub(r'argv = \["/[^"]+"', 'argv = ["/bin/true"', body)
            path.write_text(body + "\n")
            for section in tomllib.loads(body):
                load_section(config_class(section), section, config_file=path, environ={})
                loaded += 1
    assert loaded >= 3


def reference_rows(text: str) -> dict[str, set[str]]:
    """Section -> the keys in the first column of its table in the configuration reference."""
    rows: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        head = re.match(r"^#+ `\[(\w+)\]`", line)
        if head:
            section = head.group(1)
            rows[section] = set()
        elif line.startswith("#"):
            section = None
        elif section and (cell := re.match(r"^\| `(\w+)` \|", line)):
            rows[section].add(cell.group(1))
    return rows


def keys(cls) -> set[str]:
    """A config dataclass's fields, and those of a dataclass one of them holds a list of
    (``[[health_external.commands]]``'s keys)."""
    import typing

    out = set()
    for f in dataclasses.fields(cls):
        out.add(f.name)
        for arg in typing.get_args(typing.get_type_hints(cls)[f.name]):
            if dataclasses.is_dataclass(arg):
                out |= {g.name for g in dataclasses.fields(arg)}
    return out


def test_the_configuration_reference_has_every_key_of_every_section_and_no_other():
    assert set(CONFIG_CLASSES) == set(SECTIONS), "a new [section]: add it here and to docs/configuration.md"
    rows = reference_rows((DOCS / "configuration.md").read_text())
    assert set(rows) == set(SECTIONS), set(rows) ^ set(SECTIONS)
    for section in SECTIONS:
        fields = keys(config_class(section))
        assert rows[section] == fields, (section, "missing in the docs:", fields - rows[section],
                                         "in the docs but not in code:", rows[section] - fields)


def test_a_key_missing_from_the_reference_is_found():
    text = (DOCS / "configuration.md").read_text()
    cut = re.sub(r"^\| `keep_last` \|.*\n", "", text, count=1, flags=re.M)
    assert "keep_last" in {f.name for f in dataclasses.fields(config_class("checkpoint"))}
    assert "keep_last" not in reference_rows(cut)["checkpoint"]


def test_the_ddp_diff_in_the_guide_is_the_examples_diff():
    """The adoption diff in docs/adopting.md: each removed line is the plain loop's
    (tests/helpers/plain_ddp_loop.py), each added or kept line the adopted script's
    (examples/train_ddp_minimal.py; test_adoption_diff.py pins how many lines changed)."""
    def code(path: str) -> set[str]:
        return {line.split("#")[0].strip() for line in (REPO / path).read_text().splitlines()}

    plain, adopted = code("tests/helpers/plain_ddp_loop.py"), code("examples/train_ddp_minimal.py")
    diff = next(body for _, lang, kind, what, body in blocks(DOCS / "adopting.md")
                if lang == "diff" and kind == "run" and "test_the_ddp_diff" in what)
    checked = 0
    for line in diff.splitlines():
        text = line[1:].split("#")[0].strip()
        if not text or text == "...":
            continue
        assert text in (plain if line.startswith("-") else adopted), line
        checked += 1
    assert checked >= 7
