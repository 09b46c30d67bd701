"""Test-session set-up: the ``--impl`` switch.

``--impl solution`` runs the tests against the reference in ``solutions/``; the default,
``--impl engine``, against the learner's engine. The switch must take effect before anything
imports ``engine``, so this file imports it only inside hooks.
"""
from __future__ import annotations

import os


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("engine", "solution"), default=None,
                     help="which implementation of chapter 31's holes to test (default: engine, yours)")


def pytest_configure(config):
    impl = config.getoption("--impl") or os.environ.get("ENGINE_IMPL") or "engine"
    os.environ["ENGINE_IMPL"] = impl
    config.addinivalue_line("markers", "hole(name): tests of one hole, e.g. hole('BlockManager.allocate_slots')")
    config.addinivalue_line("markers", "milestone: the chapter's end-to-end milestone (all your holes together)")
    config.addinivalue_line("markers", "slow: longer tests")
