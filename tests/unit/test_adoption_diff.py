"""The README's promise: a plain DDP loop adopts slurmft in a handful of lines. Compares the plain
loop (tests/helpers/plain_ddp_loop.py) with its adopted form (examples/train_ddp_minimal.py), code
only (module docstrings left out, whitespace ignored, as `diff -w`)."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def code_lines(path: Path) -> list[str]:
    text = path.read_text()
    tree = ast.parse(text)
    doc_end = tree.body[0].end_lineno if isinstance(tree.body[0], ast.Expr) else 0
    return [line.strip() for line in text.splitlines()[doc_end:] if line.strip()]


def test_the_minimal_example_is_the_plain_loop_plus_seven_lines():
    plain = code_lines(REPO / "tests" / "helpers" / "plain_ddp_loop.py")
    adopted = code_lines(REPO / "examples" / "train_ddp_minimal.py")
    diff = [line for line in difflib.unified_diff(plain, adopted, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line[1:] for line in diff if line.startswith("+")]
    removed = [line[1:] for line in diff if line.startswith("-")]
    assert len(added) == 7 and len(removed) == 3, diff  # 4 new lines, 3 changed
    assert "from slurmft.train import Run" in added
    assert not any("slurmft" in line for line in plain)
