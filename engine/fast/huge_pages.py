"""Huge pages on Linux: fewer TLB misses where a step streams the weights and walks the K/V pool.

A decode step reads every weight once and every running request's K/V blocks, which lie anywhere
in a pool of up to gigabytes; with 4 KiB pages a stream of 1 GB crosses 250,000 pages, each
translation a possible page walk. Transparent huge pages (2 MiB) cover the same bytes with 500.
Linux gives them to a range only when asked (``/sys/kernel/mm/transparent_hugepage/enabled`` =
``madvise``, the usual default) through ``madvise(MADV_HUGEPAGE)``, and only to pages not yet
touched. Two ways in:

- the K/V pools: ``zeros`` allocates a pool empty, advises it, then zeroes it (the cpu backend's
  ``allocate``); on the AMX Xeon of issue 40 (one thread, pools of 1 GiB, K/V out of cache:
  ``python -m course.tuning.levers pages --requests 64 --context 230 --dtype bfloat16``, and
  ``--preset qwen3-0.6b --requests 16``) the decode kernel's call ran 1.31x faster at the small
  preset's shape in bfloat16 (1.26x in float32), 1.17x at Qwen3-0.6B's;
- everything else torch allocates, oneDNN's packed weights among them (opaque tensors: nothing
  outside torch can move them): PyTorch's CPU allocator advises every allocation of 2 MiB or more
  itself when ``THP_MEM_ALLOC_ENABLE=1`` is in the environment before torch loads.
  ``prefer_huge_pages`` sets it, as ``run.py`` does first thing (so a benchmark's vLLM worker,
  which inherits the environment, gets it too); a program that imports torch itself sets it
  before that import. Measured there: the 0.6B shape's 112 bf16 layer weights (880 MB) streamed
  by one-row matmuls ~1.12x faster (``course.tuning.levers linear-pages``).

Nothing changes but speed: where the system says no (THP off, another OS, a range too small) the
memory is the same on ordinary pages. This module imports torch only when a function needs it, so
``prefer_huge_pages`` can run before torch is loaded.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

MADV_HUGEPAGE = 14  # Linux's advice number (asm-generic/mman-common.h)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB base pages
TORCH_VAR = "THP_MEM_ALLOC_ENABLE"  # read by PyTorch's CPU allocator once, at its first allocation


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's handle, opened once (Linux only: MADV_HUGEPAGE's number is Linux's)."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def advise(t) -> bool:
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


def zeros(shape: tuple[int, ...], dtype):
    """A CPU tensor of zeros on huge pages where the system grants them (see the module's text)."""
    import torch

    t = torch.empty(shape, dtype=dtype)  # large allocations come from fresh, untouched pages
    advise(t)
    return t.zero_()


def prefer_huge_pages(environ: dict | None = None) -> str:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` (``os.environ``) unless it is set there
    already; returns what is in effect and why. Call it before torch is imported: with
    ``os.environ`` and torch already loaded this changes nothing and says so."""
    env = os.environ if environ is None else environ
    if TORCH_VAR in env:
        why = "set in the environment"
    elif environ is None and "torch" in sys.modules:
        why = "not chosen: torch was loaded first"
    else:
        env[TORCH_VAR] = "1"
        why = "run.py's choice"
    return f"{TORCH_VAR}={env.get(TORCH_VAR, 'unset')} ({why})"


def describe() -> str:
    """One phrase for a benchmark's machine line: whether torch's allocator asks for huge pages."""
    value = os.environ.get(TORCH_VAR)
    return "torch allocations on huge pages" if value == "1" else f"{TORCH_VAR} {value or 'unset'}: 4 KiB pages"
