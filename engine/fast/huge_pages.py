"""Huge pages for the K/V pools on Linux: fewer TLB misses when attention walks scattered blocks.

A decode step reads every running request's K/V blocks, which lie anywhere in a pool of up to
gigabytes; with 4 KiB pages nearly every block read starts with a page walk. Transparent huge
pages (2 MiB) cover such a pool with a few hundred translations instead. Linux gives them to a
range only when asked (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, the usual
default) through ``madvise(MADV_HUGEPAGE)``, and only to pages not yet touched: so a pool is
allocated empty, advised, then zeroed (``zeros``).

Measured on the AMX Xeon of issue 40 (one thread, pools of 1 GiB, K/V out of cache; ``python -m
course.tuning.levers pages --requests 64 --context 230 --dtype bfloat16``, and ``--preset
qwen3-0.6b --requests 16``): the decode kernel's call 1.31x faster at the small preset's shape in
bfloat16 (1.26x in float32), 1.17x at Qwen3-0.6B's.

Nothing changes but speed: where the system says no (THP off, another OS, a range too small)
the pool is the same zeros on ordinary pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14  # Linux's advice number (asm-generic/mman-common.h)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB base pages
_libc_handle: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _libc_handle:
        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        _libc_handle.append(ctypes.CDLL(name, use_errno=True) if name else None)
    return _libc_handle[0]


def advise(t: torch.Tensor) -> bool:
    """Ask Linux for huge pages under the 2 MiB-aligned part of CPU tensor ``t``'s memory;
    whether it accepted the advice (False elsewhere, or for a tensor under 2 MiB)."""
    libc = _libc()
    if libc is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on huge pages where the system grants them (see the module's text)."""
    t = torch.empty(shape, dtype=dtype)  # large allocations come from fresh, untouched pages
    advise(t)
    return t.zero_()
