"""Copy detection on the syntax tree: hole bodies equal to the reference, near-identical checkouts,
symlinks, and files changed outside the chapter files.

A hole body is normalised before comparing (``normalised``): its docstring dropped, then dumped as a
syntax tree (formatting and comments vanish) with every local name, argument and attribute-free
identifier renamed by first appearance (``v0``, ``v1``, ...), so renaming variables changes nothing.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import os
from pathlib import Path

from course.learner.holes import _defs, is_stub
from engine._impl import all_holes

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
NEAR = 0.95  # two checkouts whose filled holes are this similar (token sequence ratio) are flagged


class _Rename(ast.NodeTransformer):
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def _new(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(self._new(node.id), node.ctx), node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.copy_location(ast.arg(self._new(node.arg), None), node)


class _DropNoOps(ast.NodeTransformer):
    """Removes statements that do nothing: ``pass``, bare constants, and a constant assigned to a
    name the function never reads (``_ = None``), in every block."""

    def __init__(self, read: set[str]) -> None:
        self.read = read

    def _noop(self, s: ast.stmt) -> bool:
        if isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
            return True
        if isinstance(s, (ast.Assign, ast.AnnAssign)) and isinstance(s.value, (ast.Constant, type(None))):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            return all(isinstance(t, ast.Name) and t.id not in self.read for t in targets)
        return False

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                setattr(node, name, [s for s in value if not self._noop(s)])
        return super().generic_visit(node)


def normalised(fn: ast.FunctionDef) -> str:
    """A hole body's comparable form: no docstring, no no-op statements, names by first appearance."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    module = ast.Module(body=[ast.parse(ast.unparse(stmt)).body[0] for stmt in body], type_ignores=[])
    read = {n.id for n in ast.walk(module) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}
    module = _DropNoOps(read).visit(module)
    tree = _Rename().visit(module)
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def hole_bodies(text: str, rel: str) -> dict[str, str]:
    """COUPLING POINT (learner layer): hole name -> normalised body, for the filled holes of one
    chapter file's text. The holes are the chapter's (``engine._impl.all_holes``, read from the
    markers in the instructor's engine/), found in ``text`` by qualname; a stub is not a body."""
    try:
        defs = _defs(ast.parse(text))
        holes = [q for q, file in all_holes().items() if file == rel]
        return {q: normalised(defs[q]) for q in holes
                if isinstance(defs.get(q), ast.FunctionDef) and not is_stub(defs[q])}
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}  # a file too deep to read is graded as the course's copy (course/learner/holes.py)


def reference_bodies() -> dict[str, str]:
    """COUPLING POINT (learner layer): the reference's normalised hole bodies. ``solutions/<rel>``
    holds only the holes' bodies (module functions, and methods inside classes of the same name),
    found there by the same qualnames."""
    out = {}
    for rel in sorted(set(all_holes().values())):
        path = SOLUTIONS / rel
        if path.is_file():
            out.update(hole_bodies(path.read_text(), rel))
    return out


def copied_holes(files: dict[str, str]) -> list[str]:
    """The holes of a checkout whose body is the reference's after normalisation."""
    ref = reference_bodies()
    mine = {}
    for rel, text in files.items():
        mine.update(hole_bodies(text, rel))
    return sorted(q for q, body in mine.items() if ref.get(q) == body)


def fingerprint(files: dict[str, str]) -> str:
    """The filled holes that are NOT the reference's, normalised and joined: what pairs are compared on."""
    ref = reference_bodies()
    parts = []
    for rel, text in sorted(files.items()):
        parts += [f"{q}:{b}" for q, b in sorted(hole_bodies(text, rel).items()) if ref.get(q) != b]
    return "\n".join(parts)


def near_pairs(prints: dict[str, str], threshold: float = NEAR, min_len: int = 2000) -> list[tuple[str, str, float]]:
    """Pairs of checkouts whose own hole bodies are near-identical (ratio >= threshold)."""
    ids = sorted(k for k, v in prints.items() if len(v) >= min_len)
    pairs = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            m = difflib.SequenceMatcher(None, prints[a].split(), prints[b].split(), autojunk=False)
            if m.quick_ratio() >= threshold and (r := m.ratio()) >= threshold:
                pairs.append((a, b, round(r, 3)))
    return pairs


def symlinks(checkout: Path) -> list[str]:
    """Every symlink in the checkout (not followed), with whether it leaves the checkout."""
    found = []
    for dirpath, dirnames, filenames in os.walk(checkout):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", ".venv-peers", "__pycache__")]
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                target = Path(os.path.realpath(path))
                where = "inside" if target.is_relative_to(checkout.resolve()) else "OUTSIDE the checkout"
                found.append(f"{path.relative_to(checkout)} -> {os.readlink(path)} ({where})")
    return found


def changed_outside(checkout: Path, chapter: list[str], limit: int = 20) -> list[str]:
    """Files of the instructor's engine/, course/ and tests/ that differ in the checkout (or are new
    .py files there). The grader never uses them; they are listed for the instructor."""
    out = []
    skip = {f"engine/{rel}" for rel in chapter}
    for top in ("engine", "course", "tests"):
        base = checkout / top
        if not base.is_dir() or base.is_symlink():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(checkout).as_posix()
            if rel in skip or "__pycache__" in rel or path.is_symlink():
                continue
            mine = ROOT / rel
            if not mine.is_file():
                out.append(f"{rel} (a file the course does not have)")
            elif _digest(mine) != _digest(path):
                out.append(f"{rel} (differs from the course's)")
            if len(out) >= limit:
                return out
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
