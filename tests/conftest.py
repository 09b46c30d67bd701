"""Test-session set-up: the ``--impl`` switch and per-hole isolation.

``--impl solution`` runs the tests against the reference in ``solutions/``. The default,
``--impl engine``, tests YOUR engine hole by hole (see ``tests/learner_holes.py``): the session
loads the reference as ``engine`` and, for each test, patches in your version of
- only hole X, for a test marked ``hole("X")`` (so one bug doesn't fail every later hole);
- none of your holes, for a test marked ``given`` (code the chapter hands you complete);
- all of your holes, for the ``milestone`` and for tests without a marker: your engine alone.
Write code only inside hole bodies (helpers are fine); that is all the tests see.
Subprocesses a test starts still see ``ENGINE_IMPL=engine``: your own files, unpatched.

The switch must take effect before anything imports a chapter module, so this file imports
``engine`` only inside hooks.
"""
from __future__ import annotations

import os
import sys

import pytest

_ISOLATION_KEY = pytest.StashKey()


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("engine", "solution"), default=None,
                     help="which implementation of chapter 31's holes to test (default: engine, yours)")
    parser.addoption("--triton-full", action="store_true", default=False,
                     help="Triton backend: every case and the engine end to end under the interpreter (slow)")


def pytest_configure(config):
    impl = config.getoption("--impl") or os.environ.get("ENGINE_IMPL") or "engine"
    os.environ["ENGINE_IMPL"] = impl
    config.addinivalue_line("markers", "hole(name): tests of one hole, e.g. hole('BlockManager.allocate_slots')")
    config.addinivalue_line("markers", "milestone: the chapter's end-to-end milestone (all your holes together)")
    config.addinivalue_line("markers", "given: tests of code the chapter gives complete (none of your holes)")
    config.addinivalue_line("markers", "slow: longer tests")
    if impl == "engine":
        from learner_holes import LearnerHoles  # tests/ is on sys.path next to this conftest

        import engine._impl

        early = sorted(m for m in sys.modules if m.startswith("engine.") and engine._impl.solution_path(m))
        if early:
            raise pytest.UsageError(f"{early} were imported before the test session set up --impl engine; "
                                    "a plugin must not import chapter 31's modules")
        engine._impl.install_reference_finder()
        config.stash[_ISOLATION_KEY] = LearnerHoles()


@pytest.fixture(autouse=True)
def one_thread():
    """Every test runs torch on one thread: the test models are tiny, and two threads on a 2-core
    machine (with pytest itself) mostly wait on each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _holes_for(item) -> list[str] | None:
    """The holes whose learner version this test runs with; None means all of them."""
    names = [m.args[0] for m in item.iter_markers("hole")]
    given = item.get_closest_marker("given") is not None
    if given and names:
        raise pytest.UsageError(f"{item.nodeid}: a test is either given or of a hole, not both")
    if given:
        return []
    return names or None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    isolation = item.config.stash.get(_ISOLATION_KEY, None)
    if isolation is not None:
        problem = None
        try:
            isolation.patch(isolation.names_for(_holes_for(item)))
        except (RuntimeError, ValueError) as exc:  # your file doesn't load, or a hole is missing
            problem = str(exc)
        if problem:
            pytest.fail(problem, pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    isolation = item.config.stash.get(_ISOLATION_KEY, None)
    if isolation is not None:
        isolation.restore()
