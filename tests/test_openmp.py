"""One thread pool (engine/fast/openmp.py, cpu_kernel_share.h): the C++ kernels and torch run on one
OpenMP runtime with one thread count, and run.py chooses the spin policy (a probe of the load)
before torch loads it.

The oracle for "one runtime" is behaviour, not a file name: ``torch.set_num_threads(n)`` sets the
thread count of torch's runtime only, so a kernel whose OpenMP calls reach another runtime reports
that runtime's own count (the number of cores) whatever n is. The negative control builds such a
kernel on purpose (a copy of the compiler's libgomp under another soname, bound with
RTLD_DEEPBIND) and checks that every check catches it. No timing is asserted anywhere."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.fast import cpu_attention, cpu_build, cpu_elementwise, cpu_linear, openmp

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")


def kernel_libraries() -> dict[str, ctypes.CDLL]:
    """Every C++ kernel library, built here (the tests need a C++ compiler with OpenMP)."""
    libs = {"attention": cpu_attention.load_kernel(), "linear": cpu_linear.library(),
            "elementwise": cpu_elementwise._kernels.get()}
    missing = [k for k, v in libs.items() if v is None]
    assert not missing, f"kernel libraries that did not build: {missing}"
    return libs


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/maps and dladdr: Linux only")
def test_the_kernels_call_torchs_own_openmp_runtime():
    """One runtime mapped, and it is the one both torch's ops and every kernel call."""
    libs = kernel_libraries()
    mine = openmp.torch_runtime()
    assert mine is not None and os.path.basename(mine).startswith("libgomp"), mine
    assert openmp.runtimes() == [mine], f"OpenMP runtimes in the process: {openmp.runtimes()} (one pool: one runtime)"
    for name, lib in libs.items():
        assert openmp.kernel_runtime(lib) == mine, f"the {name} kernel calls {openmp.kernel_runtime(lib)}, torch {mine}"
        assert openmp.problems(lib) == [], openmp.problems(lib)


@pytest.mark.skipif(not LINUX, reason="the kernels' OpenMP build is checked on Linux")
def test_the_kernels_follow_torchs_thread_count(restore_threads):
    """torch.set_num_threads(n) is the kernels' count too: their runtime says n, and a kernel
    sharing its work over n threads runs a team of n (torch's pool, never a smaller team: libgomp
    ends the workers a smaller team leaves out). n = cores + 1 is a count no other runtime would
    report by default."""
    libs = kernel_libraries()
    for n in (1, 2, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(n)
        for name, lib in libs.items():
            assert openmp.kernel_threads(lib, n) == (n, n), f"{name} kernel at torch threads {n}"
            if n > 2:  # a call that asks for 2 threads still runs on torch's whole team
                assert openmp.kernel_threads(lib, 2)[1] == n, f"{name} kernel: a team smaller than torch's"


def _second_runtime_kernel(tmp_path: Path) -> Path:
    """cpu_kernel_share.h built against a copy of the compiler's libgomp renamed libgomp.so.9 (its
    soname patched in place): loaded with RTLD_DEEPBIND, a kernel on a runtime of its own."""
    compiler = cpu_build.find_compiler()
    found = subprocess.run([*compiler, "-print-file-name=libgomp.so.1"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(found):
        pytest.skip(f"the compiler ({' '.join(compiler)}) names no libgomp.so.1 to copy for the negative control")
    data = Path(found).resolve().read_bytes()
    assert data.count(b"libgomp.so.1\0") == 1, "expected the soname once in the runtime's dynamic strings"
    (tmp_path / "libgomp.so.9").write_bytes(data.replace(b"libgomp.so.1\0", b"libgomp.so.9\0"))
    src = tmp_path / "share.cpp"
    src.write_text(f'#include "{cpu_attention.SOURCE.with_name("cpu_kernel_share.h")}"\n')
    obj, lib = tmp_path / "share.o", tmp_path / "share.so"
    subprocess.run([*compiler, "-O1", "-fPIC", "-fopenmp", "-c", str(src), "-o", str(obj)], check=True)
    subprocess.run([*compiler, "-shared", str(obj), "-o", str(lib), "-nodefaultlibs", "-lstdc++", "-lc",
                    f"-L{tmp_path}", "-l:libgomp.so.9", f"-Wl,-rpath,{tmp_path}"], check=True)
    return lib


SECOND_RUNTIME = """
import ctypes, json, os, sys
sys.path.insert(0, {root!r})
import torch
from engine.fast import openmp
lib = ctypes.CDLL({lib!r}, mode=os.RTLD_DEEPBIND | os.RTLD_LOCAL)
torch.set_num_threads((os.cpu_count() or 1) + 1)
print(json.dumps(openmp.problems(lib)))
"""


@pytest.mark.skipif(not LINUX, reason="RTLD_DEEPBIND and /proc/self/maps: Linux only")
def test_a_kernel_on_a_second_runtime_is_caught(tmp_path):
    """The negative control, in a process of its own (a second pool stays out of this one): a
    kernel bound to its own copy of libgomp fails every check above (two runtimes mapped, another
    runtime named, a thread count that ignores torch's)."""
    lib = _second_runtime_kernel(tmp_path)
    out = subprocess.run([sys.executable, "-c", SECOND_RUNTIME.format(root=str(ROOT), lib=str(lib))],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(found) == 3, found
    assert found[0].startswith("2 OpenMP runtimes") and "libgomp.so.9" in found[1], found
    assert "the kernels' runtime says" in found[2], found


def test_runtimes_reads_every_openmp_runtime_once(tmp_path):
    maps = tmp_path / "maps"
    lines = ["7f00-7f10 r-xp 00000000 08:01 11 /opt/torch/lib/libgomp.so.1",
             "7f10-7f20 r--p 00010000 08:01 11 /opt/torch/lib/libgomp.so.1",
             "7f20-7f30 r-xp 00000000 08:01 12 /usr/lib/libiomp5.so",
             "7f30-7f40 r-xp 00000000 08:01 13 /usr/lib/libgompish.so",  # not a runtime name
             "7f40-7f50 r-xp 00000000 08:01 14 /wheel.libs/libgomp-a34b3233.so.1.0.0",
             "7f50-7f60 rw-p 00000000 00:00 0 [heap]"]
    maps.write_text("\n".join(lines) + "\n")
    assert openmp.runtimes(str(maps)) == ["/opt/torch/lib/libgomp.so.1", "/usr/lib/libiomp5.so",
                                          "/wheel.libs/libgomp-a34b3233.so.1.0.0"]
    assert openmp.runtimes(str(tmp_path / "absent")) == []


def test_the_spin_probe_shortens_spins_on_a_busy_machine_only():
    """Other processes using more than BUSY_SHARE of the cores: GOMP_SPINCOUNT=BUSY_SPIN_COUNT;
    cores to spare: libgomp's default; a policy already in the environment stands either way."""
    env: dict[str, str] = {}
    assert openmp.prefer_short_spins(env, load=1.5, cores=2).startswith(f"GOMP_SPINCOUNT={openmp.BUSY_SPIN_COUNT}")
    assert env == {"GOMP_SPINCOUNT": str(openmp.BUSY_SPIN_COUNT)}
    env = {}
    assert openmp.prefer_short_spins(env, load=0.6, cores=2).startswith("GOMP_SPINCOUNT="), "0.6 of 2 cores: busy"
    env = {}
    assert "libgomp's default spin" in openmp.prefer_short_spins(env, load=0.3, cores=2) and env == {}
    assert "libgomp's default spin" in openmp.prefer_short_spins(env, load=3.0, cores=16) and env == {}
    assert not openmp.busy(None, 2) and not openmp.busy(3.0, None)
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(given)
        assert openmp.prefer_short_spins(env, load=9.0, cores=2).startswith("{}={}".format(*next(iter(given.items()))))
        assert env == given, "a policy the user set was changed"


def test_the_probe_reads_the_other_processes_cpu_time(tmp_path):
    """cpu_ticks reads /proc/stat's first line (busy = all but idle and iowait); others_busy is the
    cores' worth of non-idle time over its window, within [0, cores] on this machine (Linux), and
    None where the file cannot be read (then the load average decides)."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 400 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert openmp.cpu_ticks(str(stat)) == (100 + 20 + 30 + 6 + 7 + 8, 621)
    assert openmp.others_busy(0.01, str(stat), cores=2) is None, "no tick passed: unknown, not idle"
    assert openmp.cpu_ticks(str(tmp_path / "absent")) is None
    assert openmp.others_busy(0.01, str(tmp_path / "absent")) is None
    if LINUX:
        seen = openmp.others_busy(0.05, cores=os.cpu_count())
        assert seen is not None and 0.0 <= seen <= (os.cpu_count() or 1) + 1e-9, seen


PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
if {via_run}:
    import run
    assert "torch" not in sys.modules, "run.py imported torch before choosing the spin policy"
    run.main(["--help"])
else:
    import torch
    from engine.fast import openmp
    openmp.prefer_short_spins(load=99.0)  # busy: it would set the policy, but torch has loaded libgomp
import torch
from engine.fast import openmp
torch.ones(1 << 16).sum()  # the runtime is loaded and in use
print(json.dumps([os.environ.get("GOMP_SPINCOUNT"), openmp.spin_policy(), openmp.describe()]))
"""


def _probe(via_run: bool, **env: str) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in openmp.SPIN_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), via_run=via_run)],
                         env={**clean, **env}, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_run_py_chooses_the_spin_policy_before_torch_loads():
    """run.py's main runs the probe before any import of torch (libgomp reads the variable once,
    when loaded), and says what it saw; a user's OMP_WAIT_POLICY stands; called after torch loaded,
    the probe changes nothing (not even the environment) and says so."""
    spin, policy, line = _probe(True)
    if "busy machine" in line:  # whichever the machine is now, the child acted on what it saw
        assert (spin, policy) == (str(openmp.BUSY_SPIN_COUNT), f"GOMP_SPINCOUNT={openmp.BUSY_SPIN_COUNT}"), line
    else:
        assert "cores to spare" in line and spin is None and "libgomp's default" in policy, line
    assert _probe(True, OMP_WAIT_POLICY="PASSIVE")[:2] == [None, "OMP_WAIT_POLICY=PASSIVE"]
    late = _probe(False)
    assert late[0] is None and "libgomp's default" in late[1] and "loaded before the probe" in late[2], late


SMALL_TEAM = """
import json, sys, torch
sys.path.insert(0, {root!r})
from engine.fast import cpu_linear, cpu_linear_amx
gen = torch.Generator().manual_seed(7)
torch.set_num_threads(1)
wrong = []
kernels = [("small", torch.float32, cpu_linear.SmallLinear)]
if cpu_linear_amx.available():
    kernels.append(("amx", torch.bfloat16, cpu_linear_amx.AmxLinear))
for name, dtype, make in kernels:
    lin = make(torch.randn(1024, 256, generator=gen).to(dtype))
    for m in (1, 17, 40, 600):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        outs = [torch.full((m, 1024), float("nan"), dtype=dtype) for _ in range(2)]
        for threads, out in zip((1, 4), outs):
            lin.run(x.data_ptr(), m, out.data_ptr(), threads)
        if not torch.equal(outs[0], outs[1]):
            wrong.append(f"{{name}} at {{m}} rows: {{int(outs[1].isnan().any(1).sum())}} row(s) with unwritten values")
print(json.dumps({{"kernels": [k[0] for k in kernels], "wrong": wrong}}))
"""


def test_a_team_smaller_than_asked_still_computes_every_value():
    """A linear call cut into one run of work per thread (``share_runs``, ``share_after``: each
    thread its own run first) whose OpenMP team comes out smaller than that (here OMP_THREAD_LIMIT=1:
    four runs, one thread) still has every run done, by the threads there are: every output value
    written, the same as one thread's, for the float32 small-batch kernel and, where it runs, the
    AMX one (few rows, one row block's copy; many rows split by rows)."""
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    out = subprocess.run([sys.executable, "-c", SMALL_TEAM.format(root=str(ROOT))], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert "small" in found["kernels"] and not found["wrong"], found
