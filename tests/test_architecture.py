"""The core stays plain: no module under ``nitro/`` imports ``flows``, ``tasks``, ``cli`` or ``prefect``.

Orchestration (``flows/``, ``tasks/``, Prefect) and the entry points (``cli/``) sit above the core;
an import the other way round would make the core depend on them (and once made an import circle,
``nitro/experiment.py`` <-> ``flows/experiment.py``). Every import statement counts, also one
inside a function or under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "nitro"
FORBIDDEN = ("flows", "tasks", "cli", "prefect")


def _imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def forbidden_imports(source: str, name: str) -> list[str]:
    """``name:line: imports module`` for every import in ``source`` of a forbidden top-level package."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        for module in _imported_modules(node):
            if module.split(".")[0] in FORBIDDEN:
                found.append(f"{name}:{node.lineno}: imports {module}")
    return found


def test_the_core_imports_no_flows_tasks_cli_or_prefect():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    found = [hit for path in files for hit in forbidden_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "nitro/ must not import " + "/".join(FORBIDDEN) + ":\n" + "\n".join(found)


def test_the_check_sees_absolute_from_and_nested_imports():
    source = ("import flows.round\nfrom tasks import actors\n"
              "def f():\n    from prefect import flow\n    import cli.main as m\n"
              "from nitro.config import NitroConfig\nfrom . import cache\nimport prefecture\n")
    assert forbidden_imports(source, "probe.py") == [
        "probe.py:1: imports flows.round", "probe.py:2: imports tasks",
        "probe.py:4: imports prefect", "probe.py:5: imports cli.main",
    ]
