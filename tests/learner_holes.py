"""Per-hole isolation: test ONE of your holes against the reference for every other hole.

Under ``--impl engine`` (the default) the test session imports the reference as the ``engine``
package and, for each test, patches the learner's hole functions into it:

- a test marked ``hole("X")`` gets only your X; every other hole is the reference's, so one bug
  does not turn every later hole's tests red;
- a test marked ``given`` (code the chapter hands you complete) gets none of your holes;
- a ``milestone`` test, and any test without a marker (other test files), gets ALL your holes:
  that is exactly your engine alone, because outside the holes the skeleton and the reference
  are the same text (``make check`` keeps it so).

Your files (``engine/serve/*.py`` that have a ``solutions/`` twin) are loaded under private module
names; a hole function is then re-created with the REFERENCE module's globals, so the names it
uses (``Request``, ``Batch``, ``hash_block`` ...) are the objects every other module uses. The
rule this gives you: write code only inside hole bodies. Helpers are welcome — extra methods in a
class that has a hole, extra module-level functions or imports — and are added alongside your
holes; edits elsewhere (``__init__``, constants, non-hole methods) are not seen by the tests.

``ENGINE_LEARNER_DIR`` (tools and contract tests only) loads "your" files from another directory
laid out like ``engine/`` — pointing it at ``solutions/`` fills every hole with the reference. It
acts in this process only: a subprocess a test starts imports ``engine/`` as it is.
"""
from __future__ import annotations

from pathload import load_by_path

import importlib
import importlib.util
import os
import sys
import traceback
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEARNER_DIR_VAR = "ENGINE_LEARNER_DIR"
PRIVATE_PREFIX = "_learner_"
_MISSING = object()
# Class attributes that every class has: never "extra helpers".
_CLASS_BOOKKEEPING = {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                      "__annotations__", "__dataclass_fields__", "__dataclass_params__",
                      "__match_args__", "__static_attributes__", "__firstlineno__", "__hash__",
                      "__orig_bases__", "__parameters__"}


def _load_skeleton_tool() -> types.ModuleType:
    """tools/skeleton.py defines what a hole is; load it by path (tests/ may run without the repo root
    on sys.path)."""
    return load_by_path("_ch31_skeleton_tool", "tools/skeleton.py")


def all_holes() -> list:
    """Every hole of the chapter (``tools.skeleton.Hole``: qualname, file, lineno)."""
    return _load_skeleton_tool().all_holes()


def learner_dir() -> Path:
    return Path(os.environ.get(LEARNER_DIR_VAR) or ROOT / "engine").resolve()


@dataclass
class _Undo:
    """What one patch changed, so it can be put back exactly."""

    entries: list[tuple[object, str, object]] = field(default_factory=list)

    def set(self, owner: object, name: str, value: object) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        self.entries.append((owner, name, old))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old in reversed(self.entries):
            if old is _MISSING:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.entries.clear()


class LearnerHoles:
    """Loads the learner's chapter files privately and patches chosen holes into the reference."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or learner_dir()
        self.holes = {h.qualname: h for h in all_holes()}
        self._modules: dict[str, types.ModuleType | str] = {}  # "serve/blocks.py" -> module or error text
        self._undo = _Undo()
        self._replaced: dict[int, tuple[object, object]] = {}  # id(patched fn) -> (patched, original)

    # ----- loading --------------------------------------------------------------------------
    @staticmethod
    def _rel(hole) -> str:
        return hole.file.removeprefix("engine/")  # "serve/blocks.py"

    def learner_module(self, rel: str) -> types.ModuleType:
        """The learner's ``engine/<rel>`` loaded under a private name (once per session)."""
        if rel not in self._modules:
            path = self.directory / rel
            name = PRIVATE_PREFIX + rel.removesuffix(".py").replace("/", "_")
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or not path.is_file():
                    raise FileNotFoundError(f"{path} does not exist")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module  # dataclasses look their module up while the file runs
                spec.loader.exec_module(module)
                self._modules[rel] = module
            except Exception as exc:  # a learner's syntax or import error: report it per test
                sys.modules.pop(name, None)
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                if isinstance(exc, SyntaxError):
                    last += f" (line {exc.lineno})"
                else:
                    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
                    last += f" (line {lines[-1]})" if lines else ""
                self._modules[rel] = f"could not load your engine/{rel}: {last}"
        loaded = self._modules[rel]
        if isinstance(loaded, str):
            raise RuntimeError(loaded + " — fix that file first (tests of holes in other files still run)")
        return loaded

    @staticmethod
    def reference_module(rel: str) -> types.ModuleType:
        return importlib.import_module("engine." + rel.removesuffix(".py").replace("/", "."))

    # ----- patching -------------------------------------------------------------------------
    def names_for(self, markers: Iterable[str] | None) -> list[str]:
        """Hole names to patch: the given ones (checked), or all when ``markers`` is None."""
        if markers is None:
            return list(self.holes)
        names = list(markers)
        unknown = [n for n in names if n not in self.holes]
        if unknown:
            raise ValueError(f"hole marker(s) {unknown} name no hole; holes are: {', '.join(self.holes)}")
        return names

    def patch(self, names: Iterable[str]) -> None:
        """Put the learner's version of each named hole (plus its helpers) into the reference."""
        self.restore()
        try:
            done_classes: set[tuple[str, str]] = set()
            done_modules: set[str] = set()
            for qualname in names:
                hole = self.holes[qualname]
                rel = self._rel(hole)
                mine, ref = self.learner_module(rel), self.reference_module(rel)
                if rel not in done_modules:
                    self._add_module_helpers(mine, ref)
                    done_modules.add(rel)
                if "." in qualname:
                    cls_name, attr = qualname.split(".", 1)
                    self._patch_method(mine, ref, cls_name, attr, hole)
                    if (rel, cls_name) not in done_classes:
                        self._add_class_helpers(mine, ref, cls_name)
                        done_classes.add((rel, cls_name))
                else:
                    self._patch_function(mine, ref, qualname, hole)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        self._undo.restore()
        if self._replaced:  # a module imported during the test may have bound a patched function
            for module in _binding_sites():
                for attr, value in list(vars(module).items()):
                    original = self._replaced.get(id(value))
                    if original is not None and value is original[0]:
                        setattr(module, attr, original[1])
            self._replaced.clear()

    def _patch_method(self, mine, ref, cls_name: str, attr: str, hole) -> None:
        my_cls, ref_cls = getattr(mine, cls_name, None), getattr(ref, cls_name)
        if not isinstance(my_cls, type) or attr not in my_cls.__dict__:
            raise RuntimeError(f"your {hole.file} has no {hole.qualname}: keep the hole's name and signature")
        self._undo.set(ref_cls, attr, _rebind(my_cls.__dict__[attr], mine, ref, my_cls, ref_cls))

    def _patch_function(self, mine, ref, name: str, hole) -> None:
        my_fn, ref_fn = getattr(mine, name, None), getattr(ref, name)
        if not callable(my_fn):
            raise RuntimeError(f"your {hole.file} has no function {name}: keep the hole's name and signature")
        new = _rebind(my_fn, mine, ref)
        self._replaced[id(new)] = (new, ref_fn)
        for module in _binding_sites():  # e.g. runner.py and the tests import build_batch by name
            for attr, value in list(vars(module).items()):
                if value is ref_fn:
                    self._undo.set(module, attr, new)

    def _add_class_helpers(self, mine, ref, cls_name: str) -> None:
        my_cls, ref_cls = getattr(mine, cls_name), getattr(ref, cls_name)
        for attr, value in my_cls.__dict__.items():
            if attr not in ref_cls.__dict__ and attr not in _CLASS_BOOKKEEPING:
                self._undo.set(ref_cls, attr, _rebind(value, mine, ref, my_cls, ref_cls))

    def _add_module_helpers(self, mine, ref) -> None:
        for attr, value in vars(mine).items():
            if attr not in vars(ref) and not attr.startswith("__"):
                self._undo.set(ref, attr, _rebind(value, mine, ref))


def _binding_sites() -> list[types.ModuleType]:
    """Modules that may hold a chapter function by name: ``engine.*`` and this repository's files
    (tests, tools, scripts), never the learner's private copies."""
    root = str(ROOT) + os.sep
    sites = []
    for name, module in list(sys.modules.items()):
        if module is None or name.startswith(PRIVATE_PREFIX):
            continue
        file = getattr(module, "__file__", None) or ""
        if name == "engine" or name.startswith("engine.") or (file.startswith(root) and ".venv" not in file):
            sites.append(module)
    return sites


def _rebind(value, mine: types.ModuleType, ref: types.ModuleType, my_cls: type | None = None,
            ref_cls: type | None = None):
    """The learner's function with the reference module's globals (so it sees the same classes and
    functions as every other module); descriptors are unwrapped and rewrapped. Anything not
    defined in the learner's file is returned as it is."""
    if isinstance(value, staticmethod):
        return staticmethod(_rebind(value.__func__, mine, ref, my_cls, ref_cls))
    if isinstance(value, classmethod):
        return classmethod(_rebind(value.__func__, mine, ref, my_cls, ref_cls))
    if isinstance(value, property):
        return property(*(None if f is None else _rebind(f, mine, ref, my_cls, ref_cls)
                          for f in (value.fget, value.fset, value.fdel)), value.__doc__)
    if not isinstance(value, types.FunctionType) or value.__globals__ is not vars(mine):
        return value
    closure = value.__closure__
    if closure and my_cls is not None and "__class__" in value.__code__.co_freevars:
        # zero-argument super() reads the __class__ cell: point it at the reference class
        cells = list(closure)
        i = value.__code__.co_freevars.index("__class__")
        if cells[i].cell_contents is my_cls:
            cells[i] = types.CellType(ref_cls)
        closure = tuple(cells)
    fn = types.FunctionType(value.__code__, vars(ref), value.__name__, value.__defaults__, closure)
    fn.__kwdefaults__ = value.__kwdefaults__
    fn.__dict__.update(value.__dict__)
    fn.__qualname__, fn.__doc__, fn.__module__ = value.__qualname__, value.__doc__, ref.__name__
    fn.__annotations__ = value.__annotations__
    return fn
