"""The repository's house plan read from its code: import graph, first docstring lines, sizes.

``python -m course.quality.layout`` prints the tree (each file with the first line of its docstring), the
line counts per folder, the longest functions and the import graph's verdict: no arrow from the
engine into the course's tooling, and no import cycle. ``tests/test_layout.py`` asserts the same
facts. Everything is read with ``ast``; nothing is imported.

A chapter file's answers live in ``solutions/`` under the path it has in ``engine/`` and run in
that module's namespace, so the graph counts their imports as the module's
(``solutions/serve/blocks.py`` adds to ``engine.serve.blocks``).
"""
from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "course")  # the two import roots this graph is about
FOLDERS = ("engine", "solutions", "course", "tools", "tests", "scripts", "experiments")  # tools/: older layouts


@dataclass(frozen=True)
class SourceFile:
    path: Path  # relative to the root
    module: str  # dotted name it is imported under
    tree: ast.Module


def module_name(rel: Path) -> str:
    """``engine/serve/blocks.py`` and ``solutions/serve/blocks.py`` -> ``engine.serve.blocks``;
    a package's ``__init__.py`` -> the package's name."""
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "solutions":
        parts[0] = "engine"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(root: Path = ROOT) -> list[SourceFile]:
    """Every file of ``engine``, ``course`` and ``solutions`` (a chapter module's answers count as that module)."""
    return [SourceFile(path.relative_to(root), module_name(path.relative_to(root)),
                       ast.parse(path.read_text(), str(path.relative_to(root))))
            for top in ("engine", "course", "solutions") for path in sorted((root / top).rglob("*.py"))]


def imports_of(src: SourceFile, known: set[str]) -> set[str]:
    """The known modules ``src`` imports, anywhere in the file (a lazy import inside a function is
    an arrow too). Each import points at the deepest module it names: ``from engine.serve import
    blocks`` at ``engine.serve.blocks``, ``from engine.serve import EngineCore`` at ``engine.serve``
    (the package's ``__init__``). The parent packages Python initialises on the way are not
    counted, as import-graph tools such as pydeps do not count them."""
    found: set[str] = set()
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in targets:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != src.module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules it imports, among ``engine`` and ``course``."""
    files = package_files(root)
    known = {f.module for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:  # a chapter module and its answers file are one module
        graph.setdefault(f.module, set()).update(imports_of(f, known))
    return graph


def engine_to_course(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows from the engine package into the course's tooling (there must be none)."""
    return sorted((a, b) for a, targets in graph.items() if a.split(".")[0] == "engine"
                  for b in targets if b.split(".")[0] == "course")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), plus self-loops.

    A package's ``__init__`` importing its own submodules is not a cycle unless a submodule also
    imports the package back."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def first_docstring_line(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree)
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


def tracked_python(root: Path = ROOT) -> list[Path]:
    return sorted(p.relative_to(root) for top in FOLDERS + ("",)
                  for p in ((root / top).rglob("*.py") if top else root.glob("*.py"))
                  if ".venv" not in p.parts and "__pycache__" not in p.parts)


def line_counts(root: Path = ROOT) -> dict[str, int]:
    """Lines of Python per folder (``engine/serve``, ``course`` ...; the root's own files as '.')."""
    counts: dict[str, int] = defaultdict(int)
    for rel in tracked_python(root):
        folder = str(rel.parent) if rel.parent != Path(".") else "."
        counts[folder] += len((root / rel).read_text().splitlines())
    return dict(sorted(counts.items()))


def longest_functions(root: Path = ROOT, top: int = 10,
                      folders: tuple[str, ...] = ("engine", "solutions", "course")) -> list[tuple[int, str]]:
    """The ``top`` longest functions (lines, docstring included) as (lines, 'path:name')."""
    found = []
    for rel in tracked_python(root):
        if rel.parts[0] not in folders:
            continue
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(found, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout to read (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    print("# files (first docstring line)")
    for rel in tracked_python(root):
        if rel.parts[0] in ("engine", "solutions", "course", "tools"):
            print(f"{str(rel):44s} {first_docstring_line(ast.parse((root / rel).read_text())) or '(NO DOCSTRING)'}")
    print("\n# lines of Python per folder")
    for folder, n in line_counts(root).items():
        print(f"{n:6d}  {folder}")
    print("\n# longest functions")
    for n, where in longest_functions(root):
        print(f"{n:6d}  {where}")
    graph = import_graph(root)
    bad, loops = engine_to_course(graph), cycles(graph)
    print(f"\n# import graph: {len(graph)} modules, {sum(map(len, graph.values()))} arrows")
    print("engine -> course arrows:", bad or "none")
    print("cycles:", loops or "none")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    raise SystemExit(main())
