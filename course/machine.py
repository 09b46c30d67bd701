"""One line naming the machine a figure was measured on: CPU model, the SIMD flags that matter to
the kernels, cores, torch threads and the load average (several jobs may share the machine)."""
from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def machine_line(threads: int | None = None) -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags] or ["(flags unknown)"]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    line = f"{model}; {' '.join(have)}; {os.cpu_count()} cores; load average {load}"
    return line + (f"; {threads} torch thread(s)" if threads is not None else "")
