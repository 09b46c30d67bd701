"""Test-session set-up: the ``--impl`` switch, ``--hole`` selection, per-hole isolation, and the header.

``--hole NAME`` (repeatable) runs exactly the tests marked ``hole(NAME)`` — NAME as the hole is
named (``BlockManager.free``) or the part after the dot where that is unique (``free``) — and
``--hole milestone`` the milestone; an unknown or ambiguous name is a usage error listing the holes.

``--impl solution`` runs the tests against the reference in ``solutions/``. The default,
``--impl engine``, tests YOUR engine: the session imports your ``engine/`` as it is, and for each
test swaps in the reference for the holes that test is not about (see ``tests/learner_holes.py``
and docs/learner-layer.md):
- a test marked ``hole("X")``: your X, the reference for every other hole;
- a test marked ``given`` (code the chapter hands you complete): the reference for every hole;
- the ``milestone`` and tests without a marker: your engine alone, exactly as run.py runs it.
The session header says how many holes you filled and lists any edit outside the holes.

The switch must take effect before anything imports a chapter module, so this file imports
``engine`` only inside hooks.
"""
from __future__ import annotations

import os
import sys

import pytest

_ISOLATION_KEY = pytest.StashKey()
_HOLES_KEY = pytest.StashKey()  # --hole's names, resolved to full hole names


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("engine", "solution"), default=None,
                     help="which implementation of chapter 31's holes to test (default: engine, yours)")
    parser.addoption("--hole", action="append", default=[], metavar="NAME",
                     help="run only the tests of this hole (its name, e.g. BlockManager.allocate_slots, or the part "
                          "after the dot where that is unique; 'milestone' for the milestone); repeat for several, "
                          "run in the order given")
    parser.addoption("--triton-full", action="store_true", default=False,
                     help="Triton backend: every case and the engine end to end under the interpreter (slow)")


def pytest_configure(config):
    impl = config.getoption("--impl") or os.environ.get("ENGINE_IMPL") or "engine"
    os.environ["ENGINE_IMPL"] = impl
    config.addinivalue_line("markers", "hole(name): tests of one hole, e.g. hole('BlockManager.allocate_slots')")
    config.addinivalue_line("markers", "milestone: the chapter's end-to-end milestone (all your holes together)")
    config.addinivalue_line("markers", "given: tests of code the chapter gives complete (none of your holes)")
    config.addinivalue_line("markers", "slow: longer tests")
    if config.getoption("--hole"):
        from learner_holes import all_holes  # tests/ is on sys.path

        holes = [h.qualname for h in all_holes()]
        config.stash[_HOLES_KEY] = [resolve_hole(name, holes) for name in config.getoption("--hole")]
    if impl == "engine":
        from learner_holes import Isolation, import_learner_engine

        config.stash[_ISOLATION_KEY] = Isolation(import_learner_engine())


def resolve_hole(name: str, holes: list[str]) -> str:
    """``--hole`` NAME -> the hole's full name (or "milestone"); a usage error names the choices."""
    if name in holes or name == "milestone":
        return name
    matches = [h for h in holes if h.rsplit(".", 1)[-1] == name]
    if len(matches) == 1:
        return matches[0]
    why = f"is ambiguous ({' or '.join(matches)})" if matches else "is not a hole of chapter 31"
    raise pytest.UsageError(f"--hole {name!r} {why}; choose one of: {', '.join(holes)}, milestone")


def pytest_collection_modifyitems(config, items):
    """``--hole NAME ...``: keep the tests marked ``hole(NAME)`` (or ``milestone``), in the order the
    names were given, and deselect the rest."""
    wanted = config.stash.get(_HOLES_KEY, [])
    if not wanted:
        return

    def rank(item) -> int | None:
        marked = {m.args[0] for m in item.iter_markers("hole") if m.args}
        if item.get_closest_marker("milestone") is not None:
            marked.add("milestone")
        return next((i for i, name in enumerate(wanted) if name in marked), None)

    ranked = [(rank(item), i, item) for i, item in enumerate(items)]
    config.hook.pytest_deselected(items=[item for r, _, item in ranked if r is None])
    items[:] = [item for r, _, item in sorted((r, i, item) for r, i, item in ranked if r is not None)]


def _warnings(isolation) -> list[str]:
    from learner_holes import skeleton_tool

    lines = [f"NOT IMPORTED: {why}" for why in isolation.broken.values()]
    edits = skeleton_tool().outside_hole_edits()
    if edits:
        lines.append(f"{len(edits)} edit(s) OUTSIDE the holes (your engine runs them, and so does every "
                     "test; no hole's contract asks for them):")
        lines += [f"  {e}" for e in edits]
    return lines


def pytest_report_header(config):
    isolation = config.stash.get(_ISOLATION_KEY, None)
    if isolation is None:
        return [f"chapter 31: testing the reference (--impl {os.environ.get('ENGINE_IMPL')})"]
    from learner_holes import skeleton_tool

    left = len(skeleton_tool().unfilled_holes())
    return [f"chapter 31: testing YOUR engine (engine/): {len(isolation.holes) - left} of "
            f"{len(isolation.holes)} holes filled; a hole's tests use the reference for the other holes",
            *("  " + line for line in _warnings(isolation))]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    isolation = config.stash.get(_ISOLATION_KEY, None)
    lines = _warnings(isolation) if isolation is not None else []
    if lines:
        terminalreporter.section("chapter 31: your engine/")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs torch on one thread: the test models are tiny, and two threads on a 2-core
    machine (with pytest itself) mostly wait on each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _reference_holes(item, isolation) -> list[str]:
    """The holes this test runs with the reference version of (raises on a bad marker)."""
    names = isolation.check_names(m.args[0] for m in item.iter_markers("hole"))
    given = item.get_closest_marker("given") is not None
    if given and names:
        raise pytest.UsageError(f"{item.nodeid}: a test is either given or of a hole, not both")
    if given:
        return list(isolation.holes)
    return [h for h in isolation.holes if h not in names] if names else []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    isolation = item.config.stash.get(_ISOLATION_KEY, None)
    if isolation is None:
        return
    swap = _reference_holes(item, isolation)
    mine = {isolation.file_of(h) for h in isolation.holes if h not in swap}
    broken = [isolation.broken[f] for f in sorted(mine) if f in isolation.broken]
    if broken:
        pytest.fail("; ".join(broken), pytrace=False)
    try:
        isolation.use_reference_for(swap)
    except RuntimeError as exc:  # a chapter class renamed or removed
        pytest.fail(str(exc), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    isolation = item.config.stash.get(_ISOLATION_KEY, None)
    if isolation is not None:
        isolation.restore()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A hole's test that crashes (not an assert, not the skeleton's NotImplementedError) fails with
    what the test checks and where in engine/ it crashed, instead of a bare traceback line."""
    try:
        return (yield)
    except (AssertionError, NotImplementedError):
        raise
    except Exception as exc:
        holes = [m.args[0] for m in item.iter_markers("hole")]
        if not holes and item.get_closest_marker("milestone") is None:
            raise
        import traceback

        where = [f"{f.filename.split(os.sep + 'engine' + os.sep, 1)[-1]}:{f.lineno} in {f.name}"
                 for f in traceback.extract_tb(exc.__traceback__)
                 if os.sep + "engine" + os.sep in f.filename and os.sep + "tests" + os.sep not in f.filename]
        purpose = (item.function.__doc__ or "").strip().splitlines()[:1] or \
            [item.originalname.removeprefix("test_").replace("_", " ")]
        raise AssertionError(
            f"{holes[0] if holes else 'your engine'} crashed with {type(exc).__name__}: {exc}"
            + (f" (at engine/{where[-1]})" if where else "") + f". This test checks: {purpose[0]}") from exc
