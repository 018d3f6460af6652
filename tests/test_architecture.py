"""Checks of the code's shape that a reader can repeat: ``pytest -q tests/test_architecture.py``.

* The core stays plain: no module under ``nitro/`` imports ``flows``, ``tasks``, ``cli`` or
  ``prefect``. Orchestration (``flows/``, ``tasks/``, Prefect) and the entry points (``cli/``) sit
  above the core; an import the other way round makes the core depend on them and closes an
  import circle with them.
* No import circle among the product modules (``nitro``, ``flows``, ``tasks``, ``cli``,
  ``actor_lambda``): a circle makes the import order matter and the modules inseparable.
* The layers of ``LAYERS`` (docs/ARCHITECTURE.md draws them): a module imports only from its own
  layer and the layers below it, never up.
* No private name crosses a module: ``from m import _name`` of a product module, or
  ``obj._name`` on anything but ``self``/``cls``, is an interface that was never declared.
* ``nitro/`` holds at most ``MAX_TOP_LEVEL`` entries, so its folders show the architecture.
* No file of product code over 450 lines, none in ``nitro/learners/`` over 300: a file that long
  has more than one reason to change.
* The engine runs every algorithm through the ``Learner`` contract: ``nitro/run/engine.py`` never
  branches on ``config.algo``.
* What the code and the README cite lives in the repository (docs/decisions.md), not in files
  outside it that a clone does not have (``../shared``, ``SPEC.md``, ``NOTES.md``).

Every import statement counts, also one inside a function or under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "nitro"
FORBIDDEN = ("flows", "tasks", "cli", "prefect")
PRODUCT = ("nitro", "flows", "tasks", "cli", "actor_lambda")
MAX_LINES = 450
MAX_LINES_UNDER = {"nitro/learners": 300}
OUTSIDE_REFERENCES = ("../shared", "SPEC.md", "NOTES.md")
MAX_TOP_LEVEL = 16  # modules and packages directly under nitro/, __init__.py included
# Bottom to top. A layer's modules import from their own layer and the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("nitro", "nitro.envs", "nitro.serialization", "nitro.processes"),  # no Nitro import at all
    ("nitro.models",),  # the networks
    ("nitro.config",),  # the run's typed config
    ("nitro.validation", "nitro.cache"),  # the learner's door; Redis: trajectories, leases
    ("nitro.actors", "nitro.learners"),  # what acts and what learns
    ("nitro.pricing",),  # the ledger and the clocks
    ("nitro.stellaris", "nitro.scaling"),  # serverless learners; how many actors a round gets
    ("nitro.tracking",),  # MLflow, the per-round metrics, plots, comparisons
    ("nitro.run",),  # one training run: its folder, its rounds, its update modes, its resources
    ("nitro.experiments",),  # studies over many runs
    ("tasks",), ("flows",), ("cli", "actor_lambda"),  # Prefect tasks, flows, the entry points
)
# Private names of other libraries that their own documentation offers for use.
FOREIGN_PRIVATE = {"_replace", "_asdict", "_fields", "_exit", "_SubParsersAction", "_elapsed_steps", "_open",
                   "_run_uvicorn_command"}


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


# -- import circles ---------------------------------------------------------------------------------
#
# A module imports what each of its import statements names, resolved to a module of the tree:
# ``import a.b`` and ``from a.b import c`` import ``a.b.c`` when that is a module, else ``a.b``;
# relative imports are resolved against the importing module's package. Importing ``a.b`` also runs
# ``a/__init__.py`` first, but that is not an edge to ``a``: a package's ``__init__`` that imports
# its submodules is in a circle with one of them only when that submodule imports the package
# itself (``from a import name`` of a name that is not a module, or ``import a``), which runs into
# the half-initialised ``__init__``.


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of ``packages`` (directories under ``root``)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of the tree."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _targets(node: ast.AST, module: str, is_package: bool, modules: Mapping[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := _known(alias.name, modules))]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = ".".join(p for p in (package, node.module) if p)
    else:
        base = node.module or ""
    out = []
    for alias in node.names:
        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known(base, modules)
        if target:
            out.append(target)
    return out


def import_graph(root: Path, packages: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """Module -> {module it imports: ["file:line", ...]}, over the modules of ``packages``."""
    modules = module_files(root, packages)
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        edges: dict[str, list[str]] = {}
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            for target in _targets(node, module, path.name == "__init__.py", modules):
                lines = edges.setdefault(target, []) if target != module else []
                if f"{where}:{node.lineno}" not in lines:
                    lines.append(f"{where}:{node.lineno}")
        graph[module] = edges
    return graph


def circles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe_circle(graph: Mapping[str, Mapping[str, list[str]]], component: Sequence[str]) -> str:
    """One circle through ``component``'s first module, with the import lines that close it."""
    inside = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to ``start``
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    cycle = paths[v] + [start]
                    lines = [f"    {a} -> {b}: {', '.join(graph[a][b])}" for a, b in itertools.pairwise(cycle)]
                    return " -> ".join(cycle) + "\n" + "\n".join(lines)
                if w in inside and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return ", ".join(component)


def test_no_import_circle_among_product_modules():
    graph = import_graph(ROOT, PRODUCT)
    assert len(graph) > 40 and sum(map(len, graph.values())) > 40  # the walk found the modules and edges
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(describe_circle(graph, c) for c in found)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_circle_check_resolves_imports_and_tells_a_package_from_its_submodules(tmp_path):
    _write(tmp_path, {
        # a package that imports its submodules, which import each other but not the package
        "pkg/__init__.py": "from pkg.a import A\nfrom . import b\nimport os\n",
        "pkg/a.py": "A = 1\n",
        "pkg/b.py": "from .a import A, A2\nimport pkg.a\n",
        # a circle closed by a nested import and one under TYPE_CHECKING
        "pkg/c.py": "def f():\n    from pkg.d import D\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nD = 1\nif TYPE_CHECKING:\n    from pkg import c\n",
        # a submodule that imports a name (not a module) from its own package: a circle with __init__
        "pkg/sub/__init__.py": "from .x import X\nhelper = 1\n",
        "pkg/sub/x.py": "from pkg.sub import helper\nX = 1\n",
        "pkg/sub/y.py": "from pkg.sub import x\nfrom .. import a, b\nfrom ..sub.x import X\n",
        "other/__init__.py": "",
        "other/z.py": "import pkg.sub.y as y\nfrom pkg.missing import thing\nfrom pkg import *\n",
    })
    graph = import_graph(tmp_path, ["pkg", "other"])
    assert graph["pkg"] == {"pkg.a": ["pkg/__init__.py:1"], "pkg.b": ["pkg/__init__.py:2"]}
    assert graph["pkg.b"] == {"pkg.a": ["pkg/b.py:1", "pkg/b.py:2"]}
    assert graph["pkg.c"] == {"pkg.d": ["pkg/c.py:2"]}
    assert graph["pkg.d"] == {"pkg.c": ["pkg/d.py:4"]}
    assert graph["pkg.sub.x"] == {"pkg.sub": ["pkg/sub/x.py:1"]}
    assert graph["pkg.sub.y"] == {"pkg.sub.x": ["pkg/sub/y.py:1", "pkg/sub/y.py:3"], "pkg.a": ["pkg/sub/y.py:2"],
                                  "pkg.b": ["pkg/sub/y.py:2"]}
    assert graph["other.z"] == {"pkg.sub.y": ["other/z.py:1"], "pkg": ["other/z.py:2", "other/z.py:3"]}
    found = circles(graph)
    assert found == [["pkg.c", "pkg.d"], ["pkg.sub", "pkg.sub.x"]]
    assert describe_circle(graph, found[1]) == (
        "pkg.sub -> pkg.sub.x -> pkg.sub\n"
        "    pkg.sub -> pkg.sub.x: pkg/sub/__init__.py:1\n"
        "    pkg.sub.x -> pkg.sub: pkg/sub/x.py:1")


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest entry that is ``module`` or one of its packages."""
    best, found = "", -1
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > len(best):
                best, found = entry, i
    if found < 0:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    return found


def arrows_up(graph: Mapping[str, Mapping[str, list[str]]]) -> list[str]:
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}): {', '.join(lines)}"
            for a, edges in sorted(graph.items()) for b, lines in sorted(edges.items()) if layer_of(b) > layer_of(a)]


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph(ROOT, PRODUCT)
    assert layer_of("nitro.run.engine") > layer_of("nitro.learners.ppo") > layer_of("nitro.config")
    found = arrows_up(graph)
    assert not found, "imports that run up the layers:\n" + "\n".join(found)


def test_the_layer_check_sees_an_arrow_up():
    graph = {"nitro.learners.ppo": {"nitro.run.engine": ["nitro/learners/ppo.py:3"]}, "nitro.run.engine": {}}
    assert arrows_up(graph) == [
        "nitro.learners.ppo (layer 4) imports nitro.run.engine (layer 8): nitro/learners/ppo.py:3"
    ]


def private_crossings(source: str, name: str) -> list[str]:
    """``name:line: what`` for each private name of a product module imported, and each private
    attribute read on anything but ``self``/``cls`` (other libraries' documented ones aside)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
            found += [f"{name}:{node.lineno}: imports {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and node.attr not in FOREIGN_PRIVATE
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{name}:{node.lineno}: reads {ast.unparse(node)}")
    return found


def test_no_private_name_crosses_a_module():
    files = sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)
    found = [hit for p in files for hit in private_crossings(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, "private names used outside their module (make them public, or give an interface):\n" + "\n".join(
        found
    )


def test_the_private_check_sees_imports_and_attributes():
    source = ("from nitro.a import _b, c\nfrom os import _exit\nx = learner._merge(1)\nself._ok = 1\n"
              "row = t._replace(a=1)\nfrom nitro.d import __version__\n")
    assert private_crossings(source, "f.py") == ["f.py:1: imports nitro.a._b", "f.py:3: reads learner._merge"]


def test_the_core_shows_its_layers_in_few_top_level_entries():
    entries = sorted(p.name for p in CORE.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    assert len(entries) <= MAX_TOP_LEVEL, f"{len(entries)} entries directly under nitro/: {entries}"


# -- file size, the engine, references --------------------------------------------------------------


def _product_files(dirs: Iterable[str]) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def line_limit(relative: str) -> int:
    """The most lines a product file may have: ``MAX_LINES``, less under ``MAX_LINES_UNDER``."""
    return min([MAX_LINES] + [n for d, n in MAX_LINES_UNDER.items() if relative.startswith(d + "/")])


def test_no_product_file_is_over_its_line_limit():
    files = _product_files(PRODUCT)
    assert len(files) > 40
    over = []
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        n = len(path.read_text(errors="replace").splitlines())
        if n > line_limit(relative):
            over.append(f"{relative}: {n} lines (limit {line_limit(relative)})")
    assert not over, "files over their line limit:\n" + "\n".join(over)


def test_line_limits():
    assert line_limit("nitro/run/engine.py") == 450
    assert line_limit("nitro/learners/ppo.py") == 300
    assert line_limit("nitro/learners_extra.py") == 450


def test_the_engine_does_not_branch_on_the_algorithm():
    text = (ROOT / "nitro" / "run" / "engine.py").read_text()
    lines = [
        f"nitro/run/engine.py:{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if "config.algo" in line
    ]
    assert not lines, "the engine must reach the learner through its contract, not config.algo:\n" + "\n".join(lines)


def outside_references(text: str, name: str) -> list[str]:
    """``name:line: text`` for every line of ``text`` that cites a file outside the repository."""
    return [f"{name}:{i}: {line.strip()[:120]}" for i, line in enumerate(text.splitlines(), 1)
            if any(ref in line for ref in OUTSIDE_REFERENCES)]


def test_product_code_and_readme_cite_only_what_the_repository_holds():
    files = [*_product_files((*PRODUCT, "deployments")), ROOT / "README.md"]
    found = [
        hit
        for path in files
        for hit in outside_references(path.read_text(errors="replace"), path.relative_to(ROOT).as_posix())
    ]
    assert not found, (
        "cite docs/decisions.md (or give the reason) instead of files outside the repository:\n" + "\n".join(found)
    )


def test_the_reference_check_sees_each_form():
    text = "ok\n(see ../shared/NOTES.md)\nSPEC.md step 3\ndocs/decisions.md\n# NOTES.md says\n"
    assert outside_references(text, "f.py") == [
        "f.py:2: (see ../shared/NOTES.md)", "f.py:3: SPEC.md step 3", "f.py:5: # NOTES.md says"]
