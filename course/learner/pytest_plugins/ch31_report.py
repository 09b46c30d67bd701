"""A pytest plugin that writes one JSON record per test: outcome, hole markers, failure line.

The grader, the mutant runner and the contract tests run the chapter's tests in a subprocess with
``-p ch31_report --report-json PATH`` (this folder on PYTHONPATH; see ``course/learner/testrun.py``) and
read the file back. It imports nothing from the repository, so it works against any checkout.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--report-json", default=None, help="write per-test outcomes and markers to this JSON file")


def pytest_configure(config):
    path = config.getoption("--report-json")
    if path:
        config.pluginmanager.register(_Recorder(path), "ch31_report_recorder")


def _record(nodeid: str) -> dict:
    return {"nodeid": nodeid, "holes": [], "milestone": False, "given": False,
            "outcome": "not run", "message": "", "duration": 0.0}


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}
        self.collect_errors: list[dict] = []
        self.start = time.monotonic()
        self.current, self.current_since = None, None

    def pytest_collection_finish(self, session):
        for item in session.items:
            rec = self.tests.setdefault(item.nodeid, _record(item.nodeid))
            rec["holes"] = [m.args[0] for m in item.iter_markers("hole") if m.args]
            rec["milestone"] = item.get_closest_marker("milestone") is not None
            rec["given"] = item.get_closest_marker("given") is not None
        self.write(None)

    def pytest_runtest_logstart(self, nodeid, location):
        self.current, self.current_since = nodeid, time.time()  # the grader's watchdog reads these
        self.write(None)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid, "message": str(report.longrepr)[-2000:]})

    def pytest_runtest_logreport(self, report):
        rec = self.tests.setdefault(report.nodeid, _record(report.nodeid))
        rec["duration"] = round(rec["duration"] + report.duration, 3)
        if report.failed:
            if rec["outcome"] not in ("failed", "error"):  # the first failure is the one to show
                rec["outcome"] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                rec["message"] = (crash.message if crash is not None else str(report.longrepr))[:1000]
        elif report.skipped and rec["outcome"] == "not run":
            rec["outcome"] = "skipped"
            rec["message"] = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        elif report.passed and report.when == "call" and rec["outcome"] == "not run":
            rec["outcome"] = "passed"
        if report.when == "teardown":
            self.current, self.current_since = None, None
            self.write(None)  # after every test, so a run killed for time still says how far it got

    def pytest_sessionfinish(self, session, exitstatus):
        self.write(int(exitstatus))

    def write(self, exitstatus: int | None) -> None:
        engine = sys.modules.get("engine")
        data = {"exitstatus": exitstatus, "seconds": round(time.monotonic() - self.start, 2),
                "engine_file": getattr(engine, "__file__", None),
                "current": self.current, "current_since": self.current_since, "collect_errors": self.collect_errors,
                "tests": list(self.tests.values())}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)
