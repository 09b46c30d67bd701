"""One thread pool for torch and the C++ kernels: one OpenMP runtime, one thread count, and idle
threads that spin only where the machine has cores to spare.

Whose threads run a CPU step's parallel work: torch's ops (ATen's loops, oneDNN's matmuls, MKL) run
it on the OpenMP runtime torch ships (``torch/lib/libgomp.so.1``) with ``torch.set_num_threads``
threads. The C++ kernels (``cpu_*_kernel.cpp``, built with ``-fopenmp``) need a ``libgomp.so.1``
too; loaded after torch, the dynamic loader binds them to the copy already in the process, so their
parallel regions run on torch's workers, in teams of torch's thread count (``cpu_kernel_share.h``).
``runtimes()`` lists the OpenMP runtimes mapped into the process, ``kernel_runtime(lib)`` names the
one a kernel library calls and ``problems(lib)`` says what breaks "one pool" (tested).

How long idle threads spin: after each parallel region libgomp's workers busy-wait for the next one,
``GOMP_SPINCOUNT`` iterations of a pause (libgomp's default, with ``OMP_WAIT_POLICY`` unset: 300,000,
~3.3 ms on the 2-core Xeon of issue 40), then sleep until woken. A step of the core is dozens of
parallel regions with Python's work between them, so at the default the workers spin through whole
steps. With cores to spare that is the fastest choice (a worker picks the next region up at once: a
bfloat16 linear of 64 rows took 49 us on two threads against 89 on one, the fastest of 400 calls;
at 10,000 spins 190-215, at 1,000 about 108) and costs only CPU time. On
a busy machine it is ruinous: a region ends when every thread of its team has run its part, and while
other jobs hold a core the thread left behind spins on its own core for milliseconds, time its
partner could have run in. Measured there (``run.py bench`` random workload, small preset, load
average 6-7, three interleaved rounds): two threads at the default ran 0.10x (bfloat16) and 0.23x
(float32) of one thread's tokens per second; at 1,000 spins 0.93x and 0.96x (10,000: 0.70x, 0.69x;
OMP_WAIT_POLICY=PASSIVE: 0.93x, 0.94x). No spin count makes two threads pay on a machine that has no
second core free, but a short one keeps them from costing ten times.

So the policy is chosen by a probe at a process's entry point (``prefer_short_spins()``; ``run.py``
calls it): how much CPU the machine's OTHER processes use now. The probe sleeps ``PROBE_SECONDS``
and reads the non-idle time of all cores from ``/proc/stat`` before and after (``others_busy``): what
ran meanwhile was not this process. Other processes holding more than ``BUSY_SHARE`` of the cores (on
2 cores: half a core): a busy machine, ``GOMP_SPINCOUNT=BUSY_SPIN_COUNT``; otherwise libgomp's default
stands. (The 1-minute load average the probe read before counted this process's own recent work: a
benchmark that starts a process per run, as ``course.tuning.threads`` does, saw its previous run as
load 1 and chose short spins on a quiet machine, where two threads then ran 1.04x one thread in
bfloat16 instead of ~1.5x. Where ``/proc/stat`` cannot be read, the load average still decides.)
The choice is printed in every benchmark's machine line (``describe()``). libgomp reads these
variables once, when it is loaded (by ``import torch``), so the probe must run before torch is
imported; a ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already in the environment wins (the way to
force either choice), and child processes inherit it, so ``bench-peers``' vLLM worker runs under the
core's policy.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys

BUSY_SPIN_COUNT = 1_000  # libgomp spin iterations before an idle worker sleeps, on a busy machine (~11 us here)
DEFAULT_SPIN_COUNT = 300_000  # libgomp's own, with OMP_WAIT_POLICY unset (~3.3 ms here)
BUSY_SHARE = 0.25  # other processes using more than this share of the cores: a busy machine
PROBE_SECONDS = 0.2  # how long the probe watches the other processes' CPU use (/proc/stat counts in 10 ms ticks)
SPIN_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one set by the user: their policy stands
# The OpenMP runtimes a process may map: GNU (libgomp, or a wheel's renamed libgomp-<hash>),
# Intel (libiomp5) and LLVM (libomp).
RUNTIME_NAME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.[0-9.]+)?$")

_why = ""  # what the probe saw, for describe()


def runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """The OpenMP runtime libraries mapped into this process, in the order first mapped (Linux;
    an empty list where ``maps`` cannot be read). One pool means one entry."""
    seen: list[str] = []
    try:
        with open(maps) as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/") and RUNTIME_NAME.match(os.path.basename(path)):
                    real = os.path.realpath(path)
                    if real not in seen:
                        seen.append(real)
    except OSError:
        pass
    return seen


def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, all) clock ticks of all cores since boot, from ``stat``'s ``cpu`` line (idle and
    iowait are not busy); None where it cannot be read (not Linux)."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def others_busy(seconds: float = PROBE_SECONDS, stat: str = "/proc/stat", cores: int | None = None) -> float | None:
    """The cores' worth of CPU time the machine's other processes used over the next ``seconds``
    (this one sleeps meanwhile, so all of it is theirs): 0.0 idle .. ``cores``. None where
    ``/proc/stat`` cannot be read."""
    import time

    before = cpu_ticks(stat)
    if before is None:
        return None
    time.sleep(seconds)
    after = cpu_ticks(stat)
    if after is None or after[1] <= before[1]:
        return None
    cores = cores or os.cpu_count() or 1
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def busy(load: float | None, cores: int | None) -> bool:
    """The probe's rule: a machine whose other processes use more than ``BUSY_SHARE`` of its cores
    (``load``: in cores, ``others_busy``'s figure, or the load average where that is unknown) is
    busy: they hold the cores two threads would need. Unknown load or cores: not busy."""
    return load is not None and bool(cores) and load > BUSY_SHARE * cores


def prefer_short_spins(environ: dict | None = None, load: float | None = None, cores: int | None = None) -> str:
    """On a busy machine (``busy``: the other processes' CPU use now, ``others_busy``, unless
    ``load`` is given; the load average where /proc/stat is unreadable) set
    ``GOMP_SPINCOUNT=BUSY_SPIN_COUNT`` in ``environ`` (``os.environ``), unless a spin policy is set
    there already; returns what is now in effect and why. Call it before torch is imported: libgomp
    reads the variable once, when it is loaded, so with ``os.environ`` and an OpenMP runtime already
    in the process this changes nothing and says so (and does not measure)."""
    global _why
    env = os.environ if environ is None else environ
    cores = cores if cores is not None else os.cpu_count()
    what = "other processes' CPU"
    if any(v in env for v in SPIN_VARS):
        why = "set in the environment"
    elif environ is None and runtimes():
        why = "not chosen: the OpenMP runtime was loaded before the probe"
    else:
        if load is None:
            load = others_busy(cores=cores)
        if load is None and hasattr(os, "getloadavg"):
            load, what = os.getloadavg()[0], "load average"
        if busy(load, cores):
            env["GOMP_SPINCOUNT"] = str(BUSY_SPIN_COUNT)
            why = f"busy machine: {what} {load:.1f} on {cores} cores"
        else:
            why = f"cores to spare: {what} {load:.1f} on {cores} cores" if load is not None else "load unknown"
    if environ is None:
        _why = why
    return f"{spin_policy(env)} ({why})"


def spin_policy(environ: dict | None = None) -> str:
    """How long this process's idle OpenMP threads spin before they sleep, in one phrase."""
    env = os.environ if environ is None else environ
    for var in SPIN_VARS:
        if var in env:
            return f"{var}={env[var]}"
    return f"libgomp's default spin ({DEFAULT_SPIN_COUNT})"


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def library_at(address: int | None) -> str | None:
    """The file of the shared library that holds ``address`` (``dladdr``), None when unknown."""
    if not address:
        return None
    for name in (None, ctypes.util.find_library("dl")):  # glibc >= 2.34 has dladdr in libc itself
        try:
            dladdr = ctypes.CDLL(name).dladdr
        except (OSError, AttributeError):
            continue
        dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
        info = _DlInfo()
        if dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    return None


def torch_runtime() -> str | None:
    """The OpenMP runtime torch's own ops call (where ``libtorch_cpu``'s ``omp_get_max_threads`` resolves)."""
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(lib).omp_get_max_threads  # dlsym from libtorch_cpu: the runtime it was bound to
    except (OSError, AttributeError):
        return None
    return library_at(ctypes.cast(fn, ctypes.c_void_p).value)


def _declare(lib: ctypes.CDLL) -> None:
    lib.share_max_threads.restype = ctypes.c_int64
    lib.share_max_threads.argtypes = []
    lib.share_team_size.restype = ctypes.c_int64
    lib.share_team_size.argtypes = [ctypes.c_int64]
    lib.share_runtime_address.restype = ctypes.c_void_p
    lib.share_runtime_address.argtypes = []


def kernel_runtime(lib: ctypes.CDLL) -> str | None:
    """The OpenMP runtime a kernel library (built with ``cpu_kernel_share.h``) calls; None when it
    was built without OpenMP."""
    _declare(lib)
    return library_at(lib.share_runtime_address())


def kernel_threads(lib: ctypes.CDLL, threads: int) -> tuple[int, int]:
    """(the runtime's thread count as the kernel sees it, the team a ``share()`` of ``threads`` runs on)."""
    _declare(lib)
    return int(lib.share_max_threads()), int(lib.share_team_size(threads))


def problems(lib: ctypes.CDLL) -> list[str]:
    """What keeps the kernel library ``lib`` and torch from sharing one pool of threads (empty: nothing)."""
    import torch

    found = []
    mapped = runtimes()
    if len(mapped) > 1:
        found.append(f"{len(mapped)} OpenMP runtimes in the process ({', '.join(mapped)}): two pools of threads")
    mine, torch_s = kernel_runtime(lib), torch_runtime()
    if mine is not None and torch_s is not None and mine != torch_s:
        found.append(f"the kernels call {mine}, torch calls {torch_s}")
    want = torch.get_num_threads()
    seen, team = kernel_threads(lib, want)
    if mine is not None and (seen, team) != (want, want):
        found.append(f"torch runs {want} thread(s); the kernels' runtime says {seen} and shares over {team}")
    return found


def describe() -> str:
    """One phrase for a benchmark's machine line: the runtime(s), the spin policy and why."""
    mapped = runtimes()
    names = ", ".join(os.path.basename(p) for p in mapped) or "not loaded"
    pools = "" if len(mapped) <= 1 else f" ({len(mapped)} runtimes: {len(mapped)} pools)"
    return f"OpenMP {names}{pools}, {spin_policy()}" + (f" ({_why})" if _why else "")


if __name__ == "__main__":  # python -m engine.fast.openmp: what this process gets
    print(prefer_short_spins())
    import torch  # noqa: E402  (after the spin policy, as an entry point does)

    from engine.fast import cpu_attention

    print(describe(), "|", torch.__config__.parallel_info().splitlines()[1].strip())
    print(problems(cpu_attention.load_kernel()) or "one runtime, one thread count", file=sys.stdout)
