"""The one switch: which code fills chapter 31's holes — yours, the reference, or the reference for all but some.

The chapter's files in ``engine/serve/`` are the only copy of the chapter's code: given code, and
each hole as a stub that raises NotImplementedError. ``solutions/<same path>`` holds only the
reference body of each hole. ``--impl`` chooses between them:

- ``engine``: your ``engine/`` as it is;
- ``solution``: every hole's reference function is put into your modules, in place of your hole
  (your given code and helpers stay: it is the same package, with the reference answers).

One rule for which code runs, defined here: the tests check YOUR engine (``TEST_DEFAULT``;
``tests/conftest.py`` applies it), while every other entry point — ``run.py``, the scripts, the
server, the notebook, a plain ``import engine.serve`` with ``ENGINE_IMPL`` unset — runs the
reference (``COMMAND_DEFAULT``) where ``solutions/`` is present, so that a fresh clone shows the
finished engine and you opt in to yours with ``--impl engine`` / ``ENGINE_IMPL=engine``. A handout
(no ``solutions/``) has only yours. A plain import that took the default says once, on stderr,
which ran.

Every command reads it the same way: ``pytest --impl``, ``run.py ... --impl``, scripts through
``apply_impl(sys.argv)``, and the notebook and anything else through ``ENGINE_IMPL``, the variable
``apply_impl`` sets and this module reads when ``engine.serve`` is imported. Per-hole isolation
(the test session) uses the same ``Switch``: the reference for every hole but the one under test.

A reference function is re-created with the learner module's globals (so it sees the same
classes as everything else; a name the learner's module lacks, e.g. an import it dropped, is
taken from the solutions file), keeps the stub's signature defaults and docstring, and is set on
the learner's class or module — a module function also on every module that bound it by name.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from pathlib import Path

ENV_VAR = "ENGINE_IMPL"
IMPLS = ("engine", "solution")
TEST_DEFAULT = "engine"  # the test session's: your engine
COMMAND_DEFAULT = "solution"  # everything else's (run.py, scripts, server, notebook, ENGINE_IMPL unset): the reference
HELP = ("which code fills chapter 31's holes: 'engine' (yours) or 'solution' "
        "(the reference answers in solutions/, in your modules)")
HOLE_MARKER = "(Your engine: Chapter 31)"
ROOT = Path(__file__).resolve().parent.parent
# The chapter's files, in the order the chapter builds them (a request's path).
CHAPTER_FILES = ("serve/batch.py", "serve/attention.py", "serve/flat.py", "serve/blocks.py",
                 "serve/scheduler.py", "serve/engine.py")
_MISSING = object()


def default_impl() -> str:
    """What runs with ``ENGINE_IMPL`` unset outside the tests: the reference, unless there is none
    (a handout has no ``solutions/``)."""
    return COMMAND_DEFAULT if (ROOT / "solutions").is_dir() else "engine"


def current_impl() -> str:
    impl = os.environ.get(ENV_VAR) or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"{ENV_VAR}={impl!r}: choose one of {IMPLS}")
    return impl


def add_impl_argument(parser: argparse.ArgumentParser, default: str = COMMAND_DEFAULT) -> None:
    """``--impl {engine,solution}`` on a command's own parser (for its --help)."""
    parser.add_argument("--impl", choices=IMPLS, default=default, help=f"{HELP}; default {default}")


def apply_impl(argv: list[str], prog: str | None = None, default: str = COMMAND_DEFAULT) -> str:
    """The one ``--impl`` parser: read it from ``argv`` (the rest is left to the command), set
    ``ENGINE_IMPL`` and return it; a bad value exits with status 2 and a usage line. Call it
    before anything imports ``engine.serve``."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_impl_argument(pre, default)
    impl = pre.parse_known_args(argv)[0].impl
    os.environ[ENV_VAR] = impl
    return impl


def module_name(rel: str) -> str:
    return "engine." + rel.removesuffix(".py").replace("/", ".")  # "serve/blocks.py" -> engine.serve.blocks


def holes_of(source: str) -> list[str]:
    """The qualnames of the holes defined in a chapter file's text (module functions and methods)."""
    found = []
    for node in ast.parse(source).body:
        defs = [(node, "")] if isinstance(node, ast.FunctionDef) else \
            [(f, node.name + ".") for f in node.body if isinstance(f, ast.FunctionDef)] \
            if isinstance(node, ast.ClassDef) else []
        found += [prefix + f.name for f, prefix in defs if HOLE_MARKER in (ast.get_docstring(f) or "")]
    return found


def all_holes() -> dict[str, str]:
    """Every hole -> its chapter file (``"serve/blocks.py"``), in the chapter's order, read from
    the hole markers in ``engine/`` (for a file that does not parse: the answers in solutions/)."""
    found = {}
    for rel in CHAPTER_FILES:
        try:
            names = holes_of((ROOT / "engine" / rel).read_text())
        except SyntaxError:  # a file being edited
            tree = ast.parse((ROOT / "solutions" / rel).read_text())
            names = [f"{n.name}.{m.name}" if isinstance(n, ast.ClassDef) else n.name for n in tree.body
                     for m in (n.body if isinstance(n, ast.ClassDef) else [n]) if isinstance(m, ast.FunctionDef)]
        found.update(dict.fromkeys(names, rel))
    return found


def reference_module(rel: str) -> types.ModuleType:
    """``solutions/<rel>`` loaded under a private name (ValueError when there is none: a handout)."""
    name = "_reference_" + rel.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        path = ROOT / "solutions" / rel
        if not path.is_file():
            raise ValueError(f"solutions/{rel} is not here (a handout has no answers): only --impl engine works")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _global_names(fn: types.FunctionType) -> set[str]:
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _binding_sites() -> list[types.ModuleType]:
    """Modules that may hold a chapter function by name: ``engine.*`` and this repository's
    files (tests, tools, scripts), never the private reference copies."""
    root = str(ROOT) + os.sep
    return [m for n, m in list(sys.modules.items()) if m is not None and not n.startswith("_reference_")
            and (n == "engine" or n.startswith("engine.")
                 or ((getattr(m, "__file__", None) or "").startswith(root) and ".venv" not in m.__file__))]


class Switch:
    """Puts reference holes into the learner's modules, and takes them out again (``restore``)."""

    def __init__(self) -> None:
        self.holes = all_holes()
        self._made: dict[str, types.FunctionType] = {}
        self._undo: list[tuple[object, str, object]] = []

    def _set(self, owner: object, name: str, value: object) -> None:
        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                           else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def reference(self, qualname: str) -> types.FunctionType:
        """The reference of one hole, re-created in the learner's module (made once)."""
        if qualname not in self._made:
            rel = self.holes[qualname]
            mine, ref = importlib.import_module(module_name(rel)), reference_module(rel)
            owner_name, _, attr = qualname.rpartition(".")
            ref_fn = vars(getattr(ref, owner_name))[attr] if owner_name else getattr(ref, attr)
            my_owner = getattr(mine, owner_name, None) if owner_name else mine
            if owner_name and not isinstance(my_owner, type):
                raise RuntimeError(f"your engine/{rel} has no class {owner_name}: keep the chapter's names")
            stub = vars(my_owner).get(attr)
            fn = types.FunctionType(ref_fn.__code__, vars(mine), attr, ref_fn.__defaults__, ref_fn.__closure__)
            if isinstance(stub, types.FunctionType):  # the chapter's signature: its defaults and docstring
                if stub.__code__.co_varnames[:stub.__code__.co_argcount] != ref_fn.__code__.co_varnames[
                        :ref_fn.__code__.co_argcount]:
                    raise RuntimeError(f"your {qualname} in engine/{rel} takes other arguments than the chapter's")
                fn.__defaults__, fn.__kwdefaults__ = stub.__defaults__, stub.__kwdefaults__
                fn.__doc__, fn.__annotations__ = stub.__doc__, stub.__annotations__
            fn.__qualname__, fn.__module__ = qualname, mine.__name__
            self._made[qualname] = fn
        return self._made[qualname]

    def use_reference(self, names: Iterable[str]) -> None:
        """The reference version of each named hole in the learner's modules (after ``restore``)."""
        self.restore()
        try:
            for qualname in names:
                fn = self.reference(qualname)
                rel = self.holes[qualname]
                mine, ref = importlib.import_module(module_name(rel)), reference_module(rel)
                for name in _global_names(fn):  # e.g. an import the learner's file does not have
                    if name in vars(ref) and name not in vars(mine):
                        self._set(mine, name, vars(ref)[name])
                owner_name, _, attr = qualname.rpartition(".")
                if owner_name:
                    self._set(getattr(mine, owner_name), attr, fn)
                    continue
                old = getattr(mine, attr, None)
                self._set(mine, attr, fn)
                if old is not None:  # e.g. engine.serve, runner.py and the tests import build_batch by name
                    for module in _binding_sites():
                        for key, value in list(vars(module).items()):
                            if value is old:
                                self._set(module, key, fn)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        for owner, name, old in reversed(self._undo):
            if old is _MISSING:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo.clear()


def apply_at_import() -> None:
    """``ENGINE_IMPL=solution``: the reference for every hole, for the life of the process
    (``engine/serve/__init__.py`` calls this once its modules are imported)."""
    if not os.environ.get(ENV_VAR):  # a plain script: say once which code runs, and how to choose
        print("engine: ENGINE_IMPL is not set: chapter 31 runs " + (
            "the reference answers (solutions/); set ENGINE_IMPL=engine to run your holes"
            if default_impl() == "solution" else "your engine/ (no solutions/ here)"), file=sys.stderr)
    if current_impl() == "solution":
        switch = Switch()
        switch.use_reference(switch.holes)


class _CourseCopyFinder(importlib.abc.MetaPathFinder):
    """Serves one chapter module from another file (the course's copy of a learner file that does
    not import; the test session installs it, see tests/conftest.py)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_file_location(fullname, self.path) if fullname == self.name else None


def serve_from(rel: str, path: Path) -> None:
    sys.meta_path.insert(0, _CourseCopyFinder(module_name(rel), path))
