"""The machine a figure was measured on: CPU model, the SIMD and matrix-unit flags that matter to
the kernels (AMX, avx512_bf16, ...), cores, torch threads with their OpenMP runtime and spin
policy, and the load average (several jobs may share the machine). The one reader of
``/proc/cpuinfo`` in the repository: ``machine_line`` for a printed line, ``machine_info`` for the
same facts in a JSON report."""
from __future__ import annotations

import os
import platform

from engine.fast import huge_pages, openmp

# Flags named in the line when the CPU has them: vector width, and the units a bf16 GEMM can use
# (avx512_bf16: bf16 dot products in AVX-512; amx_*: Intel's tile matrix units, which oneDNN uses).
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
         "amx_fp16")


def cpu_model_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """(model name, the ``FLAGS`` this CPU has, in ``FLAGS``' order, any other ``amx*`` flag after them)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return model, have + sorted(f for f in flags if f.startswith("amx") and f not in have)


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(threads: int | None = None) -> dict:
    """The facts of ``machine_line`` as a dict (for a JSON report), the line itself included."""
    model, flags = cpu_model_and_flags()
    return {"cpu": model, "flags": flags, "bf16_units": any(f in flags for f in ("avx512_bf16", "amx_bf16")),
            "cores": os.cpu_count(), "load_average": load_average(), "torch_threads": threads,
            "openmp": openmp.describe(), "pages": huge_pages.describe(), "line": machine_line(threads)}


def machine_line(threads: int | None = None) -> str:
    model, flags = cpu_model_and_flags()
    load = load_average()
    load_s = "/".join(f"{x:.1f}" for x in load) if load else "?"
    line = f"{model}; {' '.join(flags) or '(flags unknown)'}; {os.cpu_count()} cores; load average {load_s}"
    # The OpenMP runtime(s) and spin policy: one runtime is one pool of threads (engine/fast/openmp.py).
    return line + (f"; {threads} torch thread(s), {openmp.describe()}; {huge_pages.describe()}"
                   if threads is not None else "")
