"""Per-hole isolation: test ONE of your holes with the reference for every other hole.

Under ``--impl engine`` (the default) the session imports YOUR ``engine`` package as it is — the
same code ``run.py --impl engine``, the notebook and the grader run. For each test it then swaps
the REFERENCE version of some holes into your modules, and puts yours back afterwards:

- a test marked ``hole("X")`` keeps your X and gets the reference for every other hole, so one bug
  does not turn every later hole's tests red;
- a test marked ``given`` (code the chapter hands you complete) gets the reference for every hole;
- a ``milestone`` test, and any test without a marker (other test files), swaps nothing: that is
  your engine alone.

A reference hole is taken from ``solutions/`` (loaded under a private module name) and re-created
with YOUR module's globals, so it sees the same classes and functions as every other module. Your
helpers and any edit outside the holes stay in force throughout (the session header lists such
edits). A chapter file of yours that does not import is served from ``solutions/`` instead, and
the tests of its holes (and the milestone) fail saying why.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
import types
from collections.abc import Iterable
from pathlib import Path

from pathload import load_by_path

ROOT = Path(__file__).resolve().parent.parent
_MISSING = object()


def skeleton_tool() -> types.ModuleType:
    """course/skeleton.py defines what a hole is; loaded by path (tests/ may run without the repo root
    on sys.path)."""
    return load_by_path("_ch31_skeleton_tool", "course/skeleton.py")


def all_holes() -> list:
    """Every hole of the chapter (``course.skeleton.Hole``: qualname, file, lineno)."""
    return skeleton_tool().all_holes()


def _module_name(rel: str) -> str:
    return "engine." + rel.removesuffix(".py").replace("/", ".")  # "serve/blocks.py" -> engine.serve.blocks


def import_learner_engine() -> dict[str, str]:
    """Import ``engine.serve`` from engine/; each chapter file that fails to import is served from
    solutions/ instead. Returns {"serve/blocks.py": why it did not import}."""
    import engine._impl

    files = {str((ROOT / "engine" / h.file.removeprefix("engine/")).resolve()): h.file.removeprefix("engine/")
             for h in all_holes()}
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
            if culprit is None or culprit[0] in broken:
                raise
            rel, line = culprit
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            broken[rel] = f"your engine/{rel} does not import: {last} (line {line}); fix that file first"
            for name in [m for m in sys.modules if m == "engine.serve" or m.startswith("engine.serve.")]:
                del sys.modules[name]
            engine._impl.install_reference_finder(only=[_module_name(rel)])
    raise RuntimeError("could not import engine.serve")


class Isolation:
    """Swaps reference holes into the learner's modules for one test, and back."""

    def __init__(self, broken: dict[str, str] | None = None) -> None:
        self.holes = {h.qualname: h for h in all_holes()}
        self.broken = broken or {}
        self._reference: dict[str, types.ModuleType] = {}
        self._rebound: dict[str, object] = {}
        self._undo: list[tuple[object, str, object]] = []

    def file_of(self, qualname: str) -> str:
        return self.holes[qualname].file.removeprefix("engine/")

    def check_names(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        unknown = [n for n in names if n not in self.holes]
        if unknown:
            raise ValueError(f"hole marker(s) {unknown} name no hole; holes are: {', '.join(self.holes)}")
        return names

    def reference_module(self, rel: str) -> types.ModuleType:
        if rel not in self._reference:
            name = "_reference_" + rel.removesuffix(".py").replace("/", "_")
            spec = importlib.util.spec_from_file_location(name, ROOT / "solutions" / rel)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while the file runs
            spec.loader.exec_module(module)
            self._reference[rel] = module
        return self._reference[rel]

    def _set(self, owner: object, name: str, value: object) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        self._undo.append((owner, name, old))
        setattr(owner, name, value)

    def use_reference_for(self, names: Iterable[str]) -> None:
        """Put the reference version of each named hole into the learner's modules."""
        self.restore()
        try:
            for qualname in names:
                rel = self.file_of(qualname)
                mine, ref = importlib.import_module(_module_name(rel)), self.reference_module(rel)
                ref_value = getattr(ref, qualname) if "." not in qualname else \
                    getattr(ref, qualname.split(".")[0]).__dict__[qualname.split(".", 1)[1]]
                for name in _global_names(ref_value):  # e.g. an import the learner's file no longer has
                    if name in vars(ref) and name not in vars(mine):
                        self._set(mine, name, vars(ref)[name])
                if "." in qualname:
                    cls_name, attr = qualname.split(".", 1)
                    my_cls, ref_cls = getattr(mine, cls_name, None), getattr(ref, cls_name)
                    if not isinstance(my_cls, type):
                        raise RuntimeError(f"your engine/{rel} has no class {cls_name}: keep the chapter's names")
                    if qualname not in self._rebound:
                        self._rebound[qualname] = _rebind(ref_value, ref, mine, ref_cls, my_cls)
                    self._set(my_cls, attr, self._rebound[qualname])
                    continue
                if qualname not in self._rebound:
                    self._rebound[qualname] = _rebind(ref_value, ref, mine)
                new, old = self._rebound[qualname], getattr(mine, qualname, None)
                self._set(mine, qualname, new)
                if old is not None:  # e.g. engine.serve, runner.py and the tests import build_batch by name
                    for module in _binding_sites():
                        for attr, value in list(vars(module).items()):
                            if value is old:
                                self._set(module, attr, new)
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


def _binding_sites() -> list[types.ModuleType]:
    """Modules that may hold a chapter function by name: ``engine.*`` and this repository's files
    (tests, tools, scripts), never the private reference copies."""
    root = str(ROOT) + os.sep
    sites = []
    for name, module in list(sys.modules.items()):
        if module is None or name.startswith("_reference_"):
            continue
        file = getattr(module, "__file__", None) or ""
        if name == "engine" or name.startswith("engine.") or (file.startswith(root) and ".venv" not in file):
            sites.append(module)
    return sites


def _global_names(value) -> set[str]:
    """Every name a function (or property / static / class method) may look up in its globals."""
    funcs = [getattr(value, a) for a in ("fget", "fset", "fdel", "__func__") if getattr(value, a, None)] or [value]
    codes = [f.__code__ for f in funcs if isinstance(f, types.FunctionType)]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _rebind(value, src: types.ModuleType, dst: types.ModuleType, src_cls: type | None = None,
            dst_cls: type | None = None):
    """``src``'s function re-created with ``dst``'s globals (zero-argument super() pointed at
    ``dst_cls``); descriptors are unwrapped and rewrapped."""
    if isinstance(value, (staticmethod, classmethod)):
        return type(value)(_rebind(value.__func__, src, dst, src_cls, dst_cls))
    if isinstance(value, property):
        return property(*(None if f is None else _rebind(f, src, dst, src_cls, dst_cls)
                          for f in (value.fget, value.fset, value.fdel)), value.__doc__)
    if not isinstance(value, types.FunctionType) or value.__globals__ is not vars(src):
        return value
    closure = value.__closure__
    if closure and dst_cls is not None and "__class__" in value.__code__.co_freevars:
        cells = list(closure)
        i = value.__code__.co_freevars.index("__class__")
        if cells[i].cell_contents is src_cls:
            cells[i] = types.CellType(dst_cls)
        closure = tuple(cells)
    fn = types.FunctionType(value.__code__, vars(dst), value.__name__, value.__defaults__, closure)
    fn.__kwdefaults__ = value.__kwdefaults__
    fn.__dict__.update(value.__dict__)
    fn.__qualname__, fn.__doc__, fn.__module__ = value.__qualname__, value.__doc__, dst.__name__
    fn.__annotations__ = value.__annotations__
    return fn
