"""Test-session set-up: the ``--impl`` switch, ``--hole`` selection, per-hole isolation, and the header.

``--hole NAME`` (repeatable) runs exactly the tests marked ``hole(NAME)`` — NAME as the hole is
named (``BlockManager.free``) or the part after the dot where that is unique (``free``) — and
``--hole milestone`` the milestone; an unknown or ambiguous name is a usage error listing the holes.

``--impl`` is the one switch of ``engine/_impl.py`` (its choices, default and help are declared
there). ``--impl solution``: the reference answers in every hole. The default, ``--impl engine``,
tests YOUR engine as it is, and for each test puts the reference into the holes that test is not
about (``engine._impl.Switch``; docs/learner-layer.md):
- a test marked ``hole("X")``: your X, the reference for every other hole;
- a test marked ``given`` (code the chapter hands you complete): the reference for every hole;
- the ``milestone`` and tests without a marker: your engine alone, exactly as run.py runs it.
Without ``solutions/`` (a handout) there is no reference: every test runs your engine alone, and
the header says so. The header also says how many holes you filled and lists any edit outside
the holes. A chapter file of yours that does not import is replaced by the course's copy of it
(the tests of its holes, and the milestone, fail saying why).

The switch must take effect before anything imports a chapter module, so this file imports
``engine.serve`` only inside hooks.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest

from course.learner.holes import import_engine
from engine import _impl

_ISOLATION_KEY = pytest.StashKey()
_HOLES_KEY = pytest.StashKey()  # --hole's names, resolved to full hole names
_BROKEN_KEY = pytest.StashKey()  # chapter file -> why it does not import


def pytest_addoption(parser):
    parser.addoption("--impl", choices=_impl.IMPLS, default=None, help=_impl.HELP)
    parser.addoption("--hole", action="append", default=[], metavar="NAME",
                     help="run only the tests of this hole (its name, e.g. BlockManager.allocate_slots, or the part "
                          "after the dot where that is unique; 'milestone' for the milestone); repeat for several, "
                          "run in the order given")
    parser.addoption("--triton-full", action="store_true", default=False,
                     help="Triton backend: every case and the engine end to end under the interpreter (slow)")


def pytest_configure(config):
    impl = _impl.apply_impl(["--impl", config.getoption("--impl") or os.environ.get(_impl.ENV_VAR) or _impl.TEST_DEFAULT])
    config.addinivalue_line("markers", "hole(name): tests of one hole, e.g. hole('BlockManager.allocate_slots')")
    config.addinivalue_line("markers", "milestone: the chapter's end-to-end milestone (all your holes together)")
    config.addinivalue_line("markers", "given: tests of code the chapter gives complete (none of your holes)")
    config.addinivalue_line("markers", "slow: longer tests")
    if config.getoption("--hole"):
        holes = list(_impl.all_holes())
        config.stash[_HOLES_KEY] = [resolve_hole(name, holes) for name in config.getoption("--hole")]
    config.stash[_BROKEN_KEY] = import_engine()
    if impl == "engine" and (_impl.ROOT / "solutions").is_dir():
        config.stash[_ISOLATION_KEY] = _impl.Switch()


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


def _warnings(config) -> list[str]:
    from course.learner.holes import outside_hole_edits

    lines = [f"NOT IMPORTED: {why}" for why in config.stash.get(_BROKEN_KEY, {}).values()]
    edits = outside_hole_edits()
    if edits is None:
        lines.append("edits outside the holes: not checked (no course copy of the chapter files: no git "
                     f"history here; set {'ENGINE_COURSE_COPY'} to a checkout of the course)")
    elif edits:
        lines.append(f"{len(edits)} edit(s) OUTSIDE the holes (your engine runs them, and so does every "
                     "test; no hole's contract asks for them):")
        lines += [f"  {e}" for e in edits]
    return lines


def pytest_report_header(config):
    if _impl.current_impl() == "solution":
        return ["chapter 31: the reference answers in every hole (--impl solution)"]
    from course.learner.holes import unfilled_holes

    total, left = len(_impl.all_holes()), len(unfilled_holes())
    how = ("a hole's tests use the reference for the other holes" if _ISOLATION_KEY in config.stash else
           "no solutions/ here (a handout): every test runs your own holes, so a bug in one hole can fail "
           "the tests of later ones")
    return [f"chapter 31: testing YOUR engine (engine/): {total - left} of {total} holes filled; {how}",
            *("  " + line for line in _warnings(config))]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = _warnings(config) if _impl.current_impl() == "engine" else []
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


def _reference_holes(item, holes: list[str]) -> list[str]:
    """The holes this test runs with the reference version of (raises on a bad marker)."""
    names = [m.args[0] for m in item.iter_markers("hole")]
    unknown = [n for n in names if n not in holes]
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: hole marker(s) {unknown} name no hole; holes are: {', '.join(holes)}")
    given = item.get_closest_marker("given") is not None
    if given and names:
        raise pytest.UsageError(f"{item.nodeid}: a test is either given or of a hole, not both")
    if given:
        return list(holes)
    return [h for h in holes if h not in names] if names else []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    switch = item.config.stash.get(_ISOLATION_KEY, None)
    if switch is None:
        return
    swap = _reference_holes(item, list(switch.holes))
    mine = {switch.holes[h] for h in switch.holes if h not in swap}
    broken = item.config.stash.get(_BROKEN_KEY, {})
    why = [broken[f] for f in sorted(mine) if f in broken]
    if why:
        pytest.fail("; ".join(why), pytrace=False)
    try:
        switch.use_reference(swap)
    except RuntimeError as exc:  # a chapter class renamed or removed
        pytest.fail(str(exc), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    switch = item.config.stash.get(_ISOLATION_KEY, None)
    if switch is not None:
        switch.restore()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A hole's test that crashes (not an assert, not a stub's NotImplementedError) fails with
    what the test checks and where in engine/ it crashed, instead of a bare traceback line."""
    try:
        return (yield)
    except (AssertionError, NotImplementedError):
        raise
    except Exception as exc:
        holes = [m.args[0] for m in item.iter_markers("hole")]
        if not holes and item.get_closest_marker("milestone") is None:
            raise
        from ch31_helpers import where_raised

        whose, where = where_raised(exc)
        purpose = (item.function.__doc__ or "").strip().splitlines()[:1] or \
            [item.originalname.removeprefix("test_").replace("_", " ")]
        mine = holes[0] if holes else "your engine"
        if whose == "engine":
            raise AssertionError(
                f"{mine} crashed with {type(exc).__name__}: {exc} (at engine/{where})"
                f". This test checks: {purpose[0]}") from exc
        if whose == "reference":  # another hole's reference code, fed what this hole returned or left
            raise AssertionError(
                f"the reference code of another hole raised {type(exc).__name__}: {exc} (at {where}) on what your "
                f"{mine} returned or left behind: it is your {mine} that differs from its docstring, not that "
                f"code. This test checks: {purpose[0]}") from exc
        # The engine returned; the test's own code then failed on what it found (a missing entry, a
        # value of the wrong type): not a crash of the hole, but state its docstring did not promise.
        raise AssertionError(
            f"the test's own code raised {type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
            + f", reading what {holes[0] if holes else 'your engine'} left behind: it returned, but the state it left "
            f"(an entry, a list, a count) is not what its docstring promises. This test checks: {purpose[0]}") from exc
