"""Building the CPU kernels: compile a C++ source with the host's compiler into a private cache, load it with ctypes.

Every kernel of ``engine/fast`` (paged attention, prefill, elementwise, small-batch linears, greedy
rows) is one C++ file built on first use with ``$CXX`` (else ``c++``/``g++``), ``-O3 -march=native``
and OpenMP (``cpu_kernel_share.h``), without torch headers, and loaded with ctypes: about a second,
once per source, compiler, flags and CPU (``kernel_path``'s key), then reused from ``cache_dir()``.
A compiler without OpenMP builds the same source single-threaded; one that hangs is given
``COMPILE_TIMEOUT_S`` once per process. The cache must be private (``check_private``): a kernel
another user could swap is never loaded. ``OptionalKernels`` wraps a library the code around it
can do without (None where it cannot be built, with the reason).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")  # -fopenmp: cpu_kernel_share.h
SERIAL_FLAGS = tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in FLAGS)  # a compiler without OpenMP

COMPILE_TIMEOUT_S = 300  # a compiler that hangs (or a CXX that waits on input) fails the build after this
TIMED_OUT = "the compiler took longer than"
_hung_compilers: dict[str, str] = {}  # compiler command line -> why: timed out once, never started again here


def cache_dir() -> Path:
    """Where built kernels are kept: ``$ENGINE_KERNEL_CACHE``, else a per-user temp directory."""
    root = os.environ.get("ENGINE_KERNEL_CACHE")
    return Path(root) if root else Path(tempfile.gettempdir()) / f"engine-kernels-{os.getuid()}"


def cpu_signature() -> str:
    """What ``-march=native`` compiles for: the machine, and on Linux the CPU's model name and
    feature flags (a cache shared by several machines must not hand one a kernel built for another)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            seen = set()
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU part") and name not in seen:
                    seen.add(name)
                    parts.append(f"{name}={value.strip()}")
    except OSError:
        pass
    return "|".join(parts)


def kernel_path(compiler: str, source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The cached library for this source, compiler, flags and CPU."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("cpu_*.h")))  # what the sources include
    key = hashlib.sha256(source.read_bytes() + headers + "\0".join((compiler, *flags, cpu_signature())).encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def find_compiler() -> list[str]:
    """The C++ compiler's command line: ``$CXX`` split as a shell would ("ccache g++" is a launcher
    and its compiler), else ``c++`` or ``g++`` on the PATH; ValueError when none is an executable file."""
    cxx = os.environ.get("CXX")
    if cxx:
        try:
            command = shlex.split(cxx)
        except ValueError as e:
            raise ValueError(f"CXX={cxx!r} is not a command line ({e})") from None
        found = shutil.which(command[0]) if command else None
        if found is None or not os.path.isfile(found):
            raise ValueError(f"CXX={cxx!r}: {command[0] if command else cxx!r} is not an executable file "
                             "(set CXX to a C++ compiler, or unset it); attention_backend='torch' needs none")
        return [found, *command[1:]]
    found = shutil.which("c++") or shutil.which("g++")
    if not found:
        raise ValueError("the 'cpu' attention backend compiles a small C++ kernel and found no C++ compiler "
                         "(set CXX, or install g++); attention_backend='torch' needs none")
    return [found]


def check_private(directory: Path) -> None:
    """ValueError unless nobody but you (and root) can change what ``directory`` holds: it must be
    yours and writable by you alone, and each folder above it yours or root's and not writable by
    others, unless sticky (as /tmp is: others may add entries there but not rename or remove yours).
    Otherwise another user could swap the folder, or a kernel in it, before the library is loaded."""
    why = None
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        why = f"{directory} is not a directory only you can write to"
    for parent in directory.parents:
        if why:
            break
        info = parent.stat()
        if info.st_uid not in (0, os.getuid()):
            why = f"{parent}, a folder above {directory}, belongs to another user"
        elif info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            why = f"{parent}, a folder above {directory}, can be written by others and is not sticky"
    if why:
        raise ValueError(f"{why}: the 'cpu' backend will not load a kernel from it (set ENGINE_KERNEL_CACHE "
                         "to a private directory)")


def build_library(source: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``source`` compiled with the host's C++ compiler (once per source, compiler, flags and CPU;
    then reused from ``cache_dir()``) and loaded; ValueError when there is no compiler, it fails or
    takes longer than ``COMPILE_TIMEOUT_S``, or the cache is not private."""
    compiler = find_compiler()
    try:
        directory = cache_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = directory.resolve(strict=True)  # a symlink's target is what gets checked and used
        check_private(directory)
    except OSError as e:
        raise ValueError(f"the kernel cache {str(cache_dir())!r} is not usable ({e.strerror or e}); set "
                         "ENGINE_KERNEL_CACHE to a private directory") from None
    name = " ".join(compiler)
    if name in _hung_compilers:  # one wait of COMPILE_TIMEOUT_S per compiler and process, not one per kernel
        raise ValueError(f"building {source.name} failed ({name}):\n{_hung_compilers[name]} (earlier in this "
                         "process; it is not started again)")
    failed = None
    for flags in (FLAGS + extra, SERIAL_FLAGS + extra):  # a compiler without OpenMP: the same kernel on one thread
        lib = directory / kernel_path(name, source, flags).name
        cached = lib.exists()
        if cached:
            try:
                return ctypes.CDLL(str(lib))
            except OSError:  # a corrupt entry (the cache is private: nobody else's file): build it again
                lib.unlink(missing_ok=True)
        failed = _compile(compiler, source, flags, lib)
        if failed is not None:
            if failed.startswith(TIMED_OUT):
                _hung_compilers[name] = failed
                break  # the other flag set would wait as long again
            continue
        try:
            return ctypes.CDLL(str(lib))
        except OSError as e:  # the compiler said it succeeded and wrote junk: keep none of it in the cache
            lib.unlink(missing_ok=True)
            raise ValueError(f"{name} built {lib.name}, which is not a loadable library ({e}); "
                             "check the compiler (CXX)") from None
    raise ValueError(f"building {source.name} failed ({name}):\n{failed[-2000:]}")


class OptionalKernels:
    """A kernel library that the code around it can do without: built and declared on the first
    ``get()`` (``declare(lib)`` sets its functions' ctypes signatures), None from then on where it
    cannot be built here (``why`` says what failed).

    Invariant: a failure is remembered per cause, ``(cache_dir(), $CXX)``: asking again with the
    same cache and compiler does not run the compiler again; after either changes (as the errors
    advise) the next ``get()`` tries once more."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], extra: tuple[str, ...] = ()) -> None:
        self.source, self.declare, self.extra = source, declare, extra  # extra: compiler flags after FLAGS
        self.lib: ctypes.CDLL | None = None
        self.failed: dict[tuple[str, str | None], str] = {}  # (cache dir, $CXX) -> why the build failed

    @staticmethod
    def cause() -> tuple[str, str | None]:
        return str(cache_dir()), os.environ.get("CXX")

    @property
    def why(self) -> str | None:
        """Why the library cannot be built with the current cache and compiler (None: not known to fail)."""
        return self.failed.get(self.cause())

    def get(self) -> ctypes.CDLL | None:
        if self.lib is None and self.cause() not in self.failed:
            cause = self.cause()
            try:
                lib = build_library(self.source, self.extra) if self.extra else build_library(self.source)
            except (ValueError, OSError) as exc:  # build_library says why in a ValueError; OSError: belt and braces
                self.failed[cause] = str(exc)
                return None
            self.declare(lib)
            self.lib = lib
        return self.lib


def _compile(compiler: list[str], source: Path, flags: tuple[str, ...], lib: Path) -> str | None:
    """Build ``lib``; None on success, else what went wrong (the compiler's error output). The
    compiler writes a temporary file of a name no other build (thread or process) uses, renamed
    onto ``lib`` when complete."""
    fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=f".{lib.stem}-", suffix=".tmp")
    os.close(fd)
    try:
        try:  # its own process group, so a timeout ends the compiler's children too
            proc = subprocess.Popen([*compiler, *flags, str(source), "-o", tmp], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        except OSError as e:
            return f"the compiler could not be run: {e}"
        try:
            _, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"{TIMED_OUT} {COMPILE_TIMEOUT_S} s"
        if proc.returncode != 0:
            return err or f"exit status {proc.returncode}"
        os.replace(tmp, lib)  # atomic: a concurrent build never loads a half-written file
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
