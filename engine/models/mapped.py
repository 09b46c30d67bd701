"""Weights that live in a memory-mapped checkpoint file, and handing their pages back.

``load_model`` reads each tensor through ``safetensors.safe_open``, which (safetensors >= 0.4 on a
CPU) returns tensors that ARE a private mapping of the file: no copy is made, and a page of the
file becomes part of the process's resident memory only when something reads it. A fast path that
re-lays the weights out once (merged, prepacked for oneDNN) reads every page once, and from then
on the model's own tensors are never read again on that path; their pages still count in the
process's resident set until the kernel reclaims them.

``release_pages(t)`` hands them back at once (``madvise(MADV_DONTNEED)``): the tensor stays valid
and equal, its pages are read again from the file (usually the page cache) if anyone uses it
later, e.g. ``generate()`` on the same model. It is done only where that is safe:

- the tensor lies inside a file mapping of this process (``/proc/self/maps``; Linux only), and
- it was never modified in place: a written page of a private mapping is the process's own
  copy, and dropping it would revert it to the file's bytes. ``t._version == 0`` is not proof
  (writes through ``.data`` or a NumPy view do not move it), so every page is also checked in
  ``/proc/self/pagemap``: only a tensor whose pages are all still the file's (resident file
  pages, or not resident and not swapped) is released; where the pagemap cannot be read, none is;
- only whole pages inside the tensor are dropped, never one it shares with a neighbour.

Anywhere else (another OS, a tensor built in memory, a cast copy) it does nothing and says so.

A tensor read now and then, a few rows at a time (an embedding beside a packed tied head), brings
back more than it reads: each page fault maps the file's cached pages around it too (64 KiB
around each row looked up; ``MADV_RANDOM`` does not stop that). ``releasable`` names its pages
once, and ``drop_pages`` hands them back after each read.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import numpy as np
import torch

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


def _file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file-backed mapping of this process (empty where unknown)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5]))
    return out


def mapped_file(t: torch.Tensor, maps: list[tuple[int, int, str]] | None = None) -> str | None:
    """The file whose mapping holds all of ``t``'s bytes, or None (not file-backed, or unknown)."""
    if t.device.type != "cpu" or t.numel() == 0 or t.is_mkldnn:
        return None
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    for start, stop, path in (maps if maps is not None else _file_mappings()):
        if start <= begin and end <= stop:
            return path
    return None


def releasable(t: torch.Tensor, maps: list[tuple[int, int, str]] | None = None) -> tuple[int, int] | None:
    """(address, length) of the whole pages inside ``t`` that ``release_pages`` may drop (see the
    module docstring), or None where it would do nothing."""
    if not sys.platform.startswith("linux") or t._version != 0 or not t.is_contiguous() or mapped_file(t, maps) is None:
        return None
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    first, last = -(-begin // PAGE) * PAGE, end // PAGE * PAGE  # whole pages inside the tensor
    if last <= first or not pages_clean(first, last - first):
        return None
    return first, last - first


PAGEMAP_PRESENT, PAGEMAP_SWAPPED, PAGEMAP_FILE = 1 << 63, 1 << 62, 1 << 61  # linux Documentation/admin-guide/mm/pagemap


def pages_clean(address: int, length: int) -> bool:
    """Whether every page of ``[address, address + length)`` (page-aligned) still holds the file's
    bytes: in ``/proc/self/pagemap`` each is either a resident file page or not resident and not
    swapped. A page written through a private file mapping became the process's anonymous copy
    (resident without the file bit, or swapped): dropping it would lose the write. False where the
    pagemap cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // PAGE * 8)
            raw = f.read(length // PAGE * 8)
    except OSError:
        return False
    if len(raw) != length // PAGE * 8:
        return False
    entries = np.frombuffer(raw, dtype=np.uint64)
    present = (entries & np.uint64(PAGEMAP_PRESENT)) != 0
    swapped = (entries & np.uint64(PAGEMAP_SWAPPED)) != 0
    file_page = (entries & np.uint64(PAGEMAP_FILE)) != 0
    return bool(np.all(np.where(present, file_page, ~swapped)))


def drop_pages(span: tuple[int, int]) -> bool:
    """``madvise(MADV_DONTNEED)`` one span from ``releasable``: whether the kernel took it."""
    return _libc().madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1]), MADV_DONTNEED) == 0


def release_pages(tensors: list[torch.Tensor]) -> int:
    """Drop the resident pages of each unmodified, file-backed, contiguous tensor of ``tensors``
    (see the module docstring); returns how many bytes were handed back."""
    if not sys.platform.startswith("linux"):
        return 0
    maps = _file_mappings()
    released = 0
    for t in tensors:
        span = releasable(t, maps)
        if span is not None and drop_pages(span):
            released += span[1]
    return released


def trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    Freed temporaries below glibc's mmap threshold (which rises after each large free) stay in the
    heap otherwise and count in the resident set: ~75 MB after laying out Qwen3-0.6B's weights."""
    trim = getattr(_libc(), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library's handle, opened once (``drop_pages`` runs in every step that embeds through
    the module: opening it there cost more than the ``madvise`` itself)."""
    return ctypes.CDLL(None, use_errno=True)
