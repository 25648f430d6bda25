"""What the running Slurm release can do: every per-release difference the CLI backend obeys.

Measured on Debian's 22.05.8, 24.11.5 and 26.05.5 (see DESIGN.md, "Measured Slurm facts") and
read from published 23.02-25.11 output. Adding a release means editing this file only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION_RE = re.compile(r"(\d+)\.(\d+)\.(\d+)")
_PARSER_RE = re.compile(r"v0\.0\.(\d+)")


@dataclass(frozen=True)
class Capabilities:
    version: tuple[int, int, int]

    @property
    def data_parser_pins(self) -> bool:
        """``--json=<data_parser>`` exists (23.02+); 22.05 only has a bare ``--json``."""
        return self.version >= (23, 2, 0)

    @property
    def json_filters(self) -> bool:
        """``squeue --json -j`` / ``sinfo --json -n`` honour their filters (22.05 ignores them)."""
        return self.version >= (23, 2, 0)

    @property
    def scontrol_json(self) -> bool:
        """``scontrol --json show nodes`` exists; before it, per-node detail is ``sinfo --json``."""
        return self.version >= (23, 2, 0)

    @property
    def sacct_json_exit_codes(self) -> bool:
        """sacct JSON reports exit codes right (22.05 says SUCCESS/0 for exit 3; use ``sacct -P``)."""
        return self.version >= (23, 2, 0)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``slurm-wlm 22.05.8`` / ``slurm 24.11.5`` -> (22, 5, 8)."""
    match = _VERSION_RE.search(text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def listed_parsers(text: str) -> list[str]:
    """data_parser names in ``scontrol --json=list`` output, oldest first. 24.11 prints
    "Possible data_parser plugins:" then ``data_parser/v0.0.42``, ``.../v0.0.40``... unsorted."""
    return [f"v0.0.{n}" for n in sorted({int(m) for m in _PARSER_RE.findall(text)})]
