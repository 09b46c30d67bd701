"""Greedy token selection in one pass over the logits (``cpu_greedy_kernel.cpp``), float32 or bfloat16 rows.

``sampler.greedy_tokens`` takes ``max(dim=-1).indices`` of the float32 logits: on one core, 16
rows of Qwen3's vocabulary (151,936) take ~1.2 ms that way, ~0.4 ms here (``python -m
course.tuning.levers argmax``). ``argmax_rows(logits)``: [M, V] float32 or bfloat16 -> int64 [M],
each row's argmax, the first index on a tie (a row with NaN: its first NaN, as torch's ``max``
answers). The fused CPU model offers it to the sampler (``FusedFlatModel.greedy_tokens``).

Exact: a bfloat16 value widens to float32 exactly and order-preservingly, so the argmax of
bfloat16 rows IS the argmax of their float32 widening, ties and their first index included (tests
check both against float64 argmax). ``library()`` is None where the kernel cannot be built.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.fast.cpu_build import OptionalKernels

SOURCE = Path(__file__).with_name("cpu_greedy_kernel.cpp")
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
MIN_ELEMENTS_PER_THREAD = 1 << 20  # less work than this per thread: one thread does it all


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in DTYPES.values():
        fn = getattr(lib, f"argmax_rows_{name}")
        fn.argtypes, fn.restype = [ptr, i64, i64, ptr, i64], None


_kernels = OptionalKernels(SOURCE, _declare)


def library() -> ctypes.CDLL | None:
    """The built kernel, or None when it cannot be built here (no C++ compiler, a failed build)."""
    return _kernels.get()


def _checked(logits: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[int, int]:
    if (logits.dim() != 2 or logits.dtype not in dtypes or logits.device.type != "cpu"
            or not logits.is_contiguous() or logits.shape[1] == 0):
        raise ValueError(f"greedy rows are contiguous CPU [M, V] tensors (V > 0) of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    return logits.shape[0], logits.shape[1]


def _threads(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // MIN_ELEMENTS_PER_THREAD))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, V] (float32 or bfloat16) -> int64 [M]: each row's argmax, the first on a tie."""
    m, v = _checked(logits, tuple(DTYPES))
    out = torch.empty(m, dtype=torch.int64)
    getattr(library(), f"argmax_rows_{DTYPES[logits.dtype]}")(logits.data_ptr(), m, v, out.data_ptr(),
                                                               _threads(m * v))
    return out

