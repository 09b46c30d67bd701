"""Warm pytest sessions (course/learner/warm.py): a session forked from a server that imported torch
must report what a cold ``python -m pytest`` reports, see the environment and folder it was given,
end with its whole process group at its time limit, and fall back to a cold start when it cannot
be forked faithfully (start-up variables that differ, a server that died)."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from course.learner.testrun import run_pytest
from course.learner.warm import WarmPool

SESSION = textwrap.dedent('''
    import json, os, subprocess, sys, time

    def test_passes():
        assert 1 + 1 == 2

    def test_fails_with_its_message():
        assert [1, 2] == [1, 3], "the second item differs"

    def test_records_where_it_ran():
        with open(os.environ["WARM_PROBE_OUT"], "w") as f:
            json.dump({"cwd": os.getcwd(), "ppid": os.getppid(), "probe": os.environ.get("WARM_PROBE"),
                       "path0": sys.path[0], "impl": os.environ.get("ENGINE_IMPL")}, f)

    def test_sleeps_when_asked():
        flag = os.environ.get("WARM_SLEEP_ONCE", "")
        if flag and os.path.exists(flag):  # once: the file is used up by the session that sleeps
            os.remove(flag)
            child = subprocess.Popen(["sleep", "300"])
            open(os.environ["WARM_PROBE_OUT"] + ".pid", "w").write(str(child.pid))
            time.sleep(300)
''')


@pytest.fixture()
def bed(tmp_path: Path) -> Path:
    (tmp_path / "test_session.py").write_text(SESSION)
    return tmp_path


def _outcomes(run) -> dict[str, tuple[str, str]]:
    return {t.name: (t.outcome, t.message.splitlines()[0] if t.message else "") for t in run.tests}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return stat[0] != "Z"


def test_a_warm_session_reports_what_a_cold_one_does_in_its_own_folder_and_environment(bed, tmp_path):
    probe = tmp_path / "probe.json"
    env = {"WARM_PROBE": "seen", "WARM_PROBE_OUT": str(probe)}
    cold = run_pytest(["-q", "test_session.py"], cwd=bed, env=env)
    cold_probe = json.loads(probe.read_text())
    with WarmPool() as pool:
        warm = run_pytest(["-q", "test_session.py"], cwd=bed, env=env, warm=pool)
        server_pid = pool.server().proc.pid
    warm_probe = json.loads(probe.read_text())
    assert _outcomes(warm) == _outcomes(cold) and len(warm.tests) == 4, (_outcomes(warm), _outcomes(cold))
    assert _outcomes(warm)["test_fails_with_its_message"][0] == "failed"
    assert warm.returncode == cold.returncode == 1 and not warm.timed_out
    assert warm_probe["ppid"] == server_pid != cold_probe["ppid"], "the warm session was not forked from the server"
    for key in ("cwd", "probe", "path0", "impl"):
        assert warm_probe[key] == cold_probe[key], (key, warm_probe[key], cold_probe[key])
    assert warm_probe["cwd"] == str(bed) and warm_probe["impl"] is None  # ENGINE_IMPL is never inherited
    assert "the second item differs" in warm.output


def test_a_warm_session_past_its_limit_is_killed_with_everything_it_started(bed, tmp_path):
    out = tmp_path / "probe.json"
    (tmp_path / "sleep").touch()
    env = {"WARM_SLEEP_ONCE": str(tmp_path / "sleep"), "WARM_PROBE_OUT": str(out)}
    with WarmPool() as pool:
        run = run_pytest(["-q", "test_session.py", "-k", "sleeps"], cwd=bed, env=env, timeout=8, warm=pool)
        assert run.timed_out and run.returncode == -1
        grandchild = int(Path(str(out) + ".pid").read_text())
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(grandchild), "the session's own child outlived its time limit"
        again = run_pytest(["-q", "test_session.py", "-k", "passes"], cwd=bed, warm=pool)  # the server goes on
        assert _outcomes(again) == {"test_passes": ("passed", "")}


def test_sessions_that_cannot_be_forked_faithfully_start_cold(bed, tmp_path):
    probe = tmp_path / "probe.json"
    env = {"WARM_PROBE_OUT": str(probe)}
    with WarmPool() as pool:
        # a variable OpenMP reads when torch loads: the server's value would silently win
        run_pytest(["-q", "test_session.py", "-k", "where"], cwd=bed, env={**env, "OMP_NUM_THREADS": "7"}, warm=pool)
        assert json.loads(probe.read_text())["ppid"] == os.getpid()
        # the server dies under a session: that session is killed and run again cold, same result
        (tmp_path / "sleep").touch()
        server = pool.server()
        killer = threading.Timer(4, os.kill, (server.proc.pid, signal.SIGKILL))
        killer.start()
        run = run_pytest(["-q", "test_session.py", "-k", "sleeps or passes"], cwd=bed, timeout=120, warm=pool,
                         env={**env, "WARM_SLEEP_ONCE": str(tmp_path / "sleep")})
        killer.join()
        assert _outcomes(run) == {"test_passes": ("passed", ""), "test_sleeps_when_asked": ("passed", "")}
        orphan = int(Path(str(probe) + ".pid").read_text())
        deadline = time.monotonic() + 10
        while _alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(orphan), "the session of a dead server lived on"
        run_pytest(["-q", "test_session.py", "-k", "where"], cwd=bed, env=env, warm=pool)  # a new server serves
        assert json.loads(probe.read_text())["ppid"] == pool.server().proc.pid != server.proc.pid
