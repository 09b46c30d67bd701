"""The chapter files read on the syntax tree: which holes are filled, what changed outside them, and filling them.

``outside_hole_edits`` compares a learner's chapter file with the course's own copy of it (hole
bodies aside; formatting, comments and docstrings don't count) and lists, one line each: a given
def or class that differs or is missing, a hole whose signature differs, a given statement changed
or removed, and ADDED module- or class-level statements that reach beyond the file: reassigning a
name the course's file defines, patching (assigning into, or calling a method on) a name of
``engine``, ``torch`` or the course, any other bare call, and anything that imports ``course`` or
reads ``solutions/``. New helpers (functions, methods, constants, imports) are the learner's own.

The course's copy: ``ENGINE_COURSE_COPY`` (a checkout whose engine/ is the course's, which the
grader and the workspaces set), else git: the file as ``origin/HEAD``, ``origin/main`` or ``HEAD``
has it, the first that exists.

``fill(text, answers)`` writes the reference bodies of ``solutions/`` into a chapter file's text
(``make solutions-branch``, the mutants, the contract tests).
"""
from __future__ import annotations

import ast
import builtins
import importlib
import os
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from engine import _impl
from engine._impl import CHAPTER_FILES, ROOT, holes_of

COPY_VAR = "ENGINE_COURSE_COPY"
GIT_REFS = ("origin/HEAD", "origin/main", "HEAD")
REACH = {"engine", "torch", "course", "solutions", "sys", "builtins", "importlib"}  # names an added line may not patch


@dataclass(frozen=True)
class Hole:
    qualname: str  # "BlockManager.allocate_slots"
    file: str  # "engine/serve/blocks.py"


def all_holes() -> list[Hole]:
    """Every hole of the chapter, file by file in the chapter's order."""
    from engine._impl import all_holes as holes

    return [Hole(q, f"engine/{rel}") for q, rel in holes().items()]


def _defs(tree: ast.Module) -> dict[str, ast.AST]:
    """'Class.method' / 'function' / 'Class' -> its node, for every def and class (not inside functions)."""
    found: dict[str, ast.AST] = {}

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[prefix + node.name] = node
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return found


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    return fn.body[1:] if ast.get_docstring(fn) is not None else fn.body


def is_stub(fn: ast.AST) -> bool:
    body = _body(fn) if isinstance(fn, ast.FunctionDef) else []
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and isinstance(body[0].exc, ast.Call)
            and getattr(body[0].exc.func, "id", "") == "NotImplementedError")


def unfilled_holes(engine_dir: Path = ROOT / "engine") -> list[Hole]:
    """The holes whose body in ``engine_dir`` is still the chapter's ``raise NotImplementedError``."""
    left = []
    for hole in all_holes():
        try:
            defs = _defs(ast.parse((engine_dir / hole.file.removeprefix("engine/")).read_text()))
        except (OSError, SyntaxError):
            continue
        if is_stub(defs.get(hole.qualname)):
            left.append(hole)
    return left


def unfinished_message(reason: str, otherwise: str) -> str:
    """What a command says when the learner's engine raised NotImplementedError (``reason``, its
    text): how many holes are left, the first to fill and how to check it, then ``otherwise`` (how
    to run the reference instead)."""
    lines = [f"Your engine is not finished yet: {reason}."]
    left = unfilled_holes()
    if left:
        first = left[0]
        lines.append(f"{len(left)} hole(s) still raise NotImplementedError; the first to fill is "
                     f"{first.qualname} in {first.file} "
                     f"(check it with: .venv/bin/python -m pytest tests/test_ch31_engine_v2.py --hole {first.qualname}).")
    lines.append(otherwise)
    return "\n".join(lines)


def course_copy(rel: str) -> str | None:
    """The course's own text of ``engine/<rel>`` (None when neither source has it)."""
    if os.environ.get(COPY_VAR):
        path = Path(os.environ[COPY_VAR]) / "engine" / rel
        return path.read_text() if path.is_file() else None
    for ref in GIT_REFS:
        try:
            out = subprocess.run(["git", "show", f"{ref}:engine/{rel}"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0:
            return out.stdout
    return None


_COPIES: list[tempfile.TemporaryDirectory] = []  # made on first use, removed at exit


def _copies_dir() -> str:
    if not _COPIES:
        _COPIES.append(tempfile.TemporaryDirectory(prefix="ch31-course-copy-"))
    return _COPIES[0].name


def import_engine() -> dict[str, str]:
    """Import ``engine.serve``; a chapter file that fails to import is served from the course's
    copy instead (the test session and the grader's scenario child both start this way).
    Returns {"serve/blocks.py": why it did not import}."""
    files = {str((_impl.ROOT / "engine" / rel).resolve()): rel for rel in _impl.CHAPTER_FILES}
    broken: dict[str, str] = {}
    for _ in range(len(files) + 1):
        try:
            importlib.import_module("engine.serve")
            return broken
        except Exception as exc:  # a learner's syntax or import error
            frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
            if isinstance(exc, SyntaxError):
                frames.append((exc.filename, exc.lineno))
            culprit = next(((files[str(Path(f).resolve())], line) for f, line in reversed(frames)
                            if f and str(Path(f).resolve()) in files), None)
            copy = course_copy(culprit[0]) if culprit and culprit[0] not in broken else None
            if copy is None:
                raise
            rel, line = culprit
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            broken[rel] = f"your engine/{rel} does not import: {last} (line {line}); fix that file first"
            for name in [m for m in sys.modules if m == "engine.serve" or m.startswith("engine.serve.")]:
                del sys.modules[name]
            path = Path(_copies_dir()) / rel.replace("/", "_")
            path.write_text(copy)
            _impl.serve_from(rel, path)
    raise RuntimeError("could not import engine.serve")


def _shape(node: ast.AST, hole: bool) -> str:
    """A def's comparable form: without its docstring; a hole's is its signature only."""
    if isinstance(node, ast.ClassDef):
        return ast.dump(ast.ClassDef(node.name, node.bases, node.keywords, [], node.decorator_list))
    head = ast.dump(node.args) + "".join(map(ast.dump, node.decorator_list)) + ast.dump(node.returns or ast.Pass())
    return head if hole else head + "".join(map(ast.dump, _body(node)))


def _statements(tree: ast.Module, imports: bool = False) -> Counter:
    """Module- and class-level statements other than defs, docstrings and (unless ``imports``)
    imports: (scope, text)."""
    found: Counter = Counter()

    def visit(body, scope: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node.name if scope == "module" else f"{scope}.{node.name}")
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and (imports or not isinstance(node, (ast.Import, ast.ImportFrom))) and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
                found[(scope, ast.unparse(node))] += 1

    visit(tree.body, "module")
    return found


def _reaches_out(node: ast.stmt, given: set[str]) -> bool:
    """Whether an added statement does more than define something of the learner's own."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return any(n.split(".")[0] in ("course", "solutions") for n in names)
    if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "solutions" in n.value for n in ast.walk(node)):
        return True  # reads the answers
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store) and t.id in given:
                    return True  # reassigns a name the course's file defines
                if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, ast.Store):
                    return True  # patches something that is not new
        return any(isinstance(n, ast.Call) for n in ast.walk(node.value)) and \
            any(isinstance(n, ast.Name) and n.id in REACH | given for n in ast.walk(node.value))
    return not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) and not isinstance(node, ast.Pass)


def edits_in(mine_text: str, course_text: str, rel: str) -> list[str]:
    """The edits outside the holes of one chapter file (see the module docstring)."""
    course_tree, mine_tree = ast.parse(course_text), ast.parse(mine_text)
    holes = set(holes_of(course_text))
    course = _defs(course_tree)
    edits = _given_edits(mine_tree, course_tree, rel, holes, graded=False)
    given = {n.id for n in ast.walk(course_tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | \
        {q.split(".")[0] for q in course} | {(a.asname or a.name).split(".")[0] for n in ast.walk(course_tree)
                                             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    known = {(scope, text) for scope, text in _statements(course_tree, imports=True)}

    def added(body, scope: str) -> None:
        for node in body:
            name = getattr(node, "name", "")
            qual = name if scope == "module" else f"{scope}.{name}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and qual not in course \
                    and (why := _why_not_inert(node, set(), in_class=scope != "module")):
                edits.append(f"engine/{rel}: an added definition in {scope} runs code at import "
                             f"(line {node.lineno}): {why}: {_line(node)}")
            if isinstance(node, ast.ClassDef):
                added(node.body, qual)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and (scope, ast.unparse(node)) not in known and _reaches_out(node, given):
                edits.append(f"engine/{rel}: an added statement in {scope} reaches outside the file "
                             f"(line {node.lineno}): {ast.unparse(node).splitlines()[0][:60]}")

    added(mine_tree.body, "module")
    return edits


def outside_hole_edits(engine_dir: Path = ROOT / "engine", copy=course_copy) -> list[str] | None:
    """Every edit outside the holes in ``engine_dir``'s chapter files, one line each; None when
    the course's copy of the files can't be found (``copy(rel)`` gives it)."""
    edits = []
    for rel in CHAPTER_FILES:
        course = copy(rel)
        if course is None:
            return None
        try:
            edits += edits_in((engine_dir / rel).read_text(), course, rel)
        except (OSError, SyntaxError):
            continue  # reported where the file is imported
    return edits


# ----- filling holes with their reference bodies ----------------------------------------------
def answers(rel: str, solutions: Path = ROOT / "solutions", text: str | None = None) -> tuple[dict[str, str], list[str]]:
    """``solutions/<rel>``: (hole qualname -> its body's source, indented as in the chapter file;
    the file's import lines)."""
    source = (solutions / rel).read_text() if text is None else text
    lines, tree = source.splitlines(keepends=True), ast.parse(source)
    bodies, imports = {}, []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", "") != "__future__":
            imports.append(ast.unparse(node))
        for fn, prefix in ([(node, "")] if isinstance(node, ast.FunctionDef) else
                           [(f, node.name + ".") for f in node.body if isinstance(f, ast.FunctionDef)]
                           if isinstance(node, ast.ClassDef) else []):
            start = fn.body[0].lineno - 1
            while start > fn.lineno and lines[start - 1].strip().startswith("#"):
                start -= 1  # comments above the first statement belong to the body
            bodies[prefix + fn.name] = "".join(lines[start:fn.end_lineno])
    return bodies, imports


def fill(text: str, bodies: dict[str, str], imports: list[str] = ()) -> str:
    """``text`` (a chapter file) with each named hole's body after its docstring replaced by
    ``bodies[name]``, and the ``imports`` it lacks added after its last top-level import."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    for q, fn in _defs(tree).items():
        if q in bodies and isinstance(fn, ast.FunctionDef):
            first = fn.body[0]
            begin = first.end_lineno if ast.get_docstring(fn) is not None else fn.body[0].lineno - 1
            edits.append((begin, fn.end_lineno, bodies[q] if bodies[q].endswith("\n") else bodies[q] + "\n"))
    present = {ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    bound = {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    missing = [i for i in imports if i not in present
               and not {a.asname or a.name for a in ast.parse(i).body[0].names} <= bound]
    last_import = max((n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
    if missing:
        edits.append((last_import, last_import, "".join(m + "\n" for m in missing)))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines)


def filled_files(solutions: Path = ROOT / "solutions", engine_texts: dict[str, str] | None = None) -> dict[str, str]:
    """Every chapter file with every hole filled from ``solutions`` (the solutions branch's files)."""
    out = {}
    for rel in CHAPTER_FILES:
        text = engine_texts[rel] if engine_texts else course_copy(rel) or (ROOT / "engine" / rel).read_text()
        bodies, imports = answers(rel, solutions)
        out[rel] = fill(text, bodies, imports)
    return out


# ----- the graded module: the course's file with the learner's holes and own definitions put in -----
SAFE_DECORATORS = {"staticmethod", "classmethod", "property"}  # builtins that run nothing of the learner's
IMPORT_HOOKS = {"__init_subclass__", "__set_name__", "__class_getitem__", "__mro_entries__", "__prepare__"}


def _inert_value(node: ast.AST | None) -> bool:
    """A literal: a constant, a signed number, or a tuple / list / set / dict of literals (runs nothing)."""
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_inert_value(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _inert_value(k) for k in node.keys) and all(map(_inert_value, node.values))
    return False


def _dotted(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) or isinstance(node, ast.Attribute) and _dotted(node.value)


def _why_not_inert(node: ast.stmt, taken: set[str], in_class: bool) -> str | None:
    """None when defining ``node`` runs no code of the learner's (it only binds a new name); else why not.
    ``taken``: names the learner may not rebind (the course file's names; builtins at module level);
    the decorators allowed are never rebindable."""
    taken = taken | SAFE_DECORATORS
    if isinstance(node, (ast.Expr,)) and isinstance(node.value, ast.Constant) or isinstance(node, ast.Pass):
        return None
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if in_class:
            return "an import inside a class"
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if any(n.split(".")[0] in ("course", "solutions") for n in names) or getattr(node, "level", 0):
            return "an import of the course's or the answers' code"
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return "a star import"
        if {(a.asname or a.name).split(".")[0] for a in node.names} & taken:
            return "an import that rebinds a name of the chapter file"
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        if node.name in taken:
            return f"a definition that rebinds {node.name}"
        if node.name in IMPORT_HOOKS:
            return f"{node.name} runs when a class is made"
        if any(not (isinstance(d, ast.Name) and d.id in SAFE_DECORATORS and in_class) for d in node.decorator_list):
            return "a decorator runs at import"
        if isinstance(node, ast.ClassDef):
            if node.keywords or not all(_dotted(b) for b in node.bases):
                return "a class whose bases or keywords run code"
            return None  # its body is checked statement by statement
        if not all(_inert_value(d) for d in [*node.args.defaults, *node.args.kw_defaults]):
            return "a default value that is not a constant runs at import"
        return None
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not all(isinstance(t, ast.Name) and t.id not in taken for t in targets):
            return "an assignment to a name of the chapter file or into an object"
        return None if _inert_value(node.value) else "a statement that runs at import"
    return "a statement that runs at import"


def _given_names(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | \
        {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} | \
        {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
         for a in n.names}


def _kept_class(node: ast.ClassDef, where: str, left_out: list[str]) -> ast.ClassDef:
    """A new class with only its inert statements (the others listed in ``left_out``)."""
    body = []
    for stmt in node.body:
        why = _why_not_inert(stmt, set(), in_class=True)
        if why:
            left_out.append(f"{where}.{node.name} (line {stmt.lineno}): {why}: {_line(stmt)}")
        else:
            body.append(_kept_class(stmt, f"{where}.{node.name}", left_out) if isinstance(stmt, ast.ClassDef) else stmt)
    return ast.ClassDef(node.name, node.bases, node.keywords, body or [ast.Pass()], node.decorator_list,
                        **({"type_params": node.type_params} if hasattr(node, "type_params") else {}))


def _line(node: ast.AST) -> str:
    try:
        return ast.unparse(node).splitlines()[0][:60]
    except (RecursionError, ValueError, IndexError):
        return "(a statement too deep to show)"


def assemble(mine_text: str, course_text: str, rel: str) -> tuple[str, list[str]]:
    """The graded module of one chapter file, and what of the learner's file it leaves out.

    The course's copy of the file (``course_text``: given code, decorators, defaults and module
    statements, all as the course has them), with: each hole's body replaced by the learner's (the
    course's signature kept); the learner's new imports after the course's; the learner's new
    functions and classes (inside a course class: new methods and constants) and new constants. A
    new definition is put in only when defining it runs nothing of the learner's (no decorator but
    staticmethod / classmethod / property in a class, only literal default values and class
    constants, plain dotted bases, no class keywords, no class-creation hooks); anything else —
    a module- or class-level statement, a decorator, a computed default — is left out and listed,
    as are given code and hole signatures that differ (the course's are graded). A file that does
    not parse is graded as the course's copy."""
    try:
        return _assemble(ast.parse(mine_text), course_text, rel)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return course_text, [f"engine/{rel}: does not parse or is too deep to read ({type(exc).__name__}): "
                             "graded as the course's copy"]


def _assemble(mine_tree: ast.Module, course_text: str, rel: str) -> tuple[str, list[str]]:
    course_tree = ast.parse(course_text)
    holes = set(holes_of(course_text))
    edits = _given_edits(mine_tree, course_tree, rel, holes)
    course_defs, mine_defs = _defs(course_tree), _defs(mine_tree)
    taken = _given_names(course_tree) | set(dir(builtins))
    left_out: list[str] = []
    members: dict[str, list[ast.stmt]] = {}  # course class -> the learner's new members
    module_new: list[ast.stmt] = []
    imports: list[str] = []

    def consider(stmt: ast.stmt, scope: str, in_class: bool, own_taken: set[str]) -> ast.stmt | None:
        if isinstance(stmt, (ast.Expr,)) and isinstance(stmt.value, ast.Constant) or isinstance(stmt, ast.Pass):
            return None
        why = _why_not_inert(stmt, own_taken, in_class)
        if why:
            left_out.append(f"{scope} (line {stmt.lineno}): {why}: {_line(stmt)}")
            return None
        return _kept_class(stmt, scope, left_out) if isinstance(stmt, ast.ClassDef) else stmt

    course_module_text = {ast.unparse(n) for n in course_tree.body}
    for stmt in mine_tree.body:
        name = getattr(stmt, "name", None)
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            continue
        if name is not None and isinstance(course_defs.get(name), ast.ClassDef) and isinstance(stmt, ast.ClassDef):
            course_cls = course_defs[name]
            own = {getattr(n, "name", None) for n in course_cls.body} | {
                t.id for n in course_cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            known = {ast.unparse(n) for n in course_cls.body}
            for sub in stmt.body:
                if getattr(sub, "name", None) in own or _safe_unparse(sub) in known:
                    continue  # a hole or given code: the course's (holes get their bodies below)
                kept = consider(sub, f"class {name}", True, own - {None})
                if kept is not None:
                    members.setdefault(name, []).append(kept)
            continue
        if name is not None and name in course_defs:
            continue  # a hole or given code at module level
        if _safe_unparse(stmt) in course_module_text:
            continue  # a given statement
        kept = consider(stmt, "module", False, taken)
        if kept is None:
            continue
        if isinstance(kept, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(kept))
        else:
            module_new.append(kept)
    edits += [f"engine/{rel}: left out of the graded module, in {w}" for w in left_out]

    text = course_text
    if members:
        lines = text.splitlines(keepends=True)
        for cls in sorted(members, key=lambda c: -course_defs[c].end_lineno):
            node = course_defs[cls]
            indent = " " * node.body[0].col_offset
            block = "".join("\n" + _indented(ast.unparse(m), indent) for m in members[cls])
            lines[node.end_lineno:node.end_lineno] = [block]
        text = "".join(lines)
    bodies = {}
    for q in holes:
        fn = mine_defs.get(q)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body(fn) and not is_stub(fn):
            indent = " " * (course_defs[q].body[0].col_offset)
            bodies[q] = _indented("\n".join(ast.unparse(s) for s in _body(fn)), indent) + "\n"
    text = fill(text, bodies, imports)
    if module_new:
        text = text.rstrip("\n") + "\n\n\n# ----- the learner's own definitions -----\n" + \
            "".join(ast.unparse(n) + "\n\n\n" for n in module_new)
    return text, edits


def _safe_unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except (RecursionError, ValueError):
        return ""


def _indented(src: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in src.splitlines(keepends=True)).rstrip("\n")


def _given_edits(mine_tree: ast.Module, course_tree: ast.Module, rel: str, holes: set[str],
                 graded: bool = True) -> list[str]:
    """Given code that differs or is missing, hole signatures that differ, given statements changed;
    ``graded``: the messages say what the grader's module uses instead."""
    as_course, with_course = (" (graded as the course's)", " (graded with the course's)") if graded else ("", "")
    mine, course = _defs(mine_tree), _defs(course_tree)
    edits = []
    for q, node in course.items():
        if q not in mine:
            edits.append(f"engine/{rel}: {q} is missing{as_course}")
        elif _shape(mine[q], q in holes) != _shape(node, q in holes):
            edits.append(f"engine/{rel}: " + (f"the signature of hole {q} differs{with_course}" if q in holes
                                               else f"{q} (given code) differs from the chapter's{as_course}"))
    for (scope, text), _ in (_statements(course_tree) - _statements(mine_tree)).items():
        edits.append(f"engine/{rel}: a given statement in {scope} was changed or removed{as_course}: {text[:60]}")
    return edits


def assemble_files(files: dict[str, str], course: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Every chapter file's graded module (``assemble``) and all the edits, file by file."""
    out, edits = {}, []
    for rel, course_text in course.items():
        text, found = assemble(files.get(rel, course_text), course_text, rel)
        out[rel], edits = text, edits + found
    return out, edits


def stub_holes(files: dict[str, str]) -> set[str]:
    """The holes whose body in ``files`` (rel -> text) is still the stub, or missing, or unparsable."""
    left = set()
    for hole in all_holes():
        try:
            defs = _defs(ast.parse(files.get(hole.file.removeprefix("engine/"), "")))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            defs = {}
        fn = defs.get(hole.qualname)
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_stub(fn):
            left.add(hole.qualname)
    return left
