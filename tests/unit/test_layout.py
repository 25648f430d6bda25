"""The rules of the package layout (issue 29), read from the source: torch is imported only by
``slurmft/train/`` (the training loop) and ``slurmft/checkpoint/`` (the checkpoint engine), and
not by their torch-free modules, which ``slurmft ckpt`` and the cluster side import where torch may
not be installed; the engine imports nothing of the loop. The torch-free half is also imported for
real, in a process where importing torch raises."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "slurmft"
TORCH_PACKAGES = ("slurmft.train", "slurmft.checkpoint")
# The modules of those two packages that must import without torch (docs/architecture.md says so).
TORCH_FREE = {
    "slurmft.checkpoint.manifest", "slurmft.checkpoint.verify", "slurmft.checkpoint.checksum", "slurmft.checkpoint.pickle_scan",
    "slurmft.checkpoint.listing", "slurmft.checkpoint.retention", "slurmft.checkpoint.tiers",
    "slurmft.checkpoint.config", "slurmft.checkpoint.save_thread",
    "slurmft.train.run_config", "slurmft.train.resume_check", "slurmft.train.redo_check",
    "slurmft.train.guards", "slurmft.train.heartbeat", "slurmft.train.watchdog", "slurmft.train.runtime",
    "slurmft.train.hard_exit", "slurmft.train.alloc_watch", "slurmft.train.phases",
    "slurmft.train.rdzv_leave", "slurmft.train.rdzv_poll",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement loads (a package's parents are loaded with it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert not node.level, f"{module}: a relative import (this rule reads absolute ones: slurmft uses only those)"
        base = node.module or ""
        names = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    loaded = []
    for name in names:
        parts = name.split(".")
        loaded += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return loaded


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or \
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"


def _imports(module: str, at_import_only: bool) -> set[str]:
    """Every module ``module`` imports; with ``at_import_only``, only the statements that run when
    it is imported (not those inside functions or under ``if TYPE_CHECKING``)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if at_import_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if at_import_only and isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update(_imported(module, child))
            visit(child)

    visit(tree)
    return found


def _loads_torch() -> dict[str, list[str]]:
    """Each slurmft module whose import loads torch -> the chain of imports that does it."""
    direct = {m: _imports(m, at_import_only=True) for m in MODULES}
    chains: dict[str, list[str]] = {}
    for module in MODULES:
        seen, queue = {module: [module]}, [module]
        while queue:
            current = queue.pop(0)
            for name in sorted(direct.get(current, ())):
                if _in(name, "torch"):
                    chains[module] = seen[current] + [name]
                    queue = []
                    break
                if name in MODULES and name not in seen:
                    seen[name] = seen[current] + [name]
                    queue.append(name)
    return chains


def test_the_rule_sees_torch_where_it_is():
    """The reader finds the imports it judges: the loop's Run and the engine's manager load torch,
    through a chain of real modules; the modules it is told are torch-free exist."""
    chains = _loads_torch()
    assert chains["slurmft.train.run"][-1].startswith("torch"), chains.get("slurmft.train.run")
    assert chains["slurmft.checkpoint.manager"][-1].startswith("torch")
    assert TORCH_FREE <= set(MODULES), sorted(TORCH_FREE - set(MODULES))


def test_torch_is_imported_only_by_the_loop_and_the_engine():
    chains = _loads_torch()
    outside = {m: c for m, c in chains.items() if not any(_in(m, p) for p in TORCH_PACKAGES)}
    assert not outside, "torch imported outside slurmft.train/slurmft.checkpoint: " + \
        "; ".join(" -> ".join(c) for c in outside.values())
    # outside the two packages, no statement imports torch even lazily (commands ask the engine)
    for module in MODULES:
        if not any(_in(module, p) for p in TORCH_PACKAGES):
            lazy = sorted(n for n in _imports(module, at_import_only=False) if _in(n, "torch"))
            assert not lazy, f"{module} imports {lazy} (inside a function): only slurmft.train/slurmft.checkpoint may"


def test_the_torch_free_modules_are_torch_free():
    chains = _loads_torch()
    loaded = {m: chains[m] for m in sorted(TORCH_FREE | set(TORCH_PACKAGES)) if m in chains}
    assert not loaded, "; ".join(" -> ".join(c) for c in loaded.values())


def test_the_engine_imports_nothing_of_the_loop():
    for module in MODULES:
        if _in(module, "slurmft.checkpoint"):
            upward = sorted(n for n in _imports(module, at_import_only=False) if _in(n, "slurmft.train"))
            assert not upward, f"{module} imports {upward}"


def test_the_torch_free_half_imports_where_torch_would_fail():
    code = (
        "import sys, importlib, importlib.abc\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is not installed here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"for name in {sorted(TORCH_FREE | set(TORCH_PACKAGES))!r}:\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
