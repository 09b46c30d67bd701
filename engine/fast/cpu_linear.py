"""Linear layers for the few rows of a CPU decode step (``cpu_linear_kernel.cpp``), in float32.

At up to a few hundred rows oneDNN's and MKL's matmuls leave part of the CPU's FMA throughput unused (they are
blocked for many rows); a decode step of the bench's small model at 16 requests spends ~70% of
its time in them. ``SmallLinear`` packs a weight once into 16-column panels that a small C++
kernel streams once per call, every row of the input meeting each panel while it is in cache.
Results equal ``F.linear``'s up to summation order (float32). The panels hold float32, or a
bfloat16 weight's own 16-bit values (``PANEL_DTYPES``): the kernel widens them exactly on the way
into the same float32 arithmetic, so a bfloat16 model on a CPU without bf16 matmul units keeps
one 16-bit copy of its weights and streams half the bytes a float32 copy would. Built with the
host's C++ compiler like the attention kernel; ``library()`` is None where it cannot be built here.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from engine.fast import cpu_elementwise
from engine.fast.cpu_build import OptionalKernels

SOURCE = Path(__file__).with_name("cpu_linear_kernel.cpp")
PANEL = 16  # output columns per packed panel (two 8-float vectors)
MIN_PANELS_PER_THREAD = 8  # fewer panels than this per thread: one thread does them all
ROW_CHUNK = 256  # longer inputs go through in chunks of this many rows, each small enough to stay in cache


PANEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the panels' dtypes (the kernels' suffixes)
# The widths the kernel is built in (cpu_linear_kernel.cpp): 8-float vectors everywhere, 16-float
# ones where the compiler targets AVX-512F (the same outputs bit for bit, about twice the FMA
# throughput). ``$ENGINE_KERNEL_ISA`` picks one for these kernels and the elementwise ones alike.
ISAS = cpu_elementwise.ISAS
# Where a bfloat16 panel row keeps column c: columns 4-7 and 8-11 swapped, so that the kernel's
# in-lane unpacks widen one 32-byte load into columns 0-7 and 8-15 (the order is its own inverse).
BF16_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def _declare(lib: ctypes.CDLL) -> None:
    lib.linear_isas.restype, lib.linear_isas.argtypes = ctypes.c_char_p, []
    lib.isas = tuple(lib.linear_isas().decode().split(","))
    for isa in lib.isas:
        for kind in ("linear", "gated") if isa == "avx512" else ("linear",):
            for name in PANEL_DTYPES.values():
                fn = getattr(lib, f"{kind}_{name}_{isa}")
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5


_kernels = OptionalKernels(SOURCE, _declare)


def library() -> ctypes.CDLL | None:
    """The built kernel, or None when it cannot be built here (no C++ compiler, a failed build)."""
    return _kernels.get()


def isa() -> str:
    """The width a SmallLinear made now runs at: ``$ENGINE_KERNEL_ISA`` when set (ValueError when
    this build lacks it), else the widest built here ("avx2" where the kernel does not build)."""
    lib = library()
    return cpu_elementwise.choose_isa(os.environ.get(cpu_elementwise.ISA_ENV), lib.isas if lib else (),
                                      "small-batch linear kernel")


def describe() -> str:
    """One line for start-up reports: the width the small layout's kernel runs at, and why."""
    lib = library()
    if lib is None:
        return f"small-batch linear kernel: not built here ({_kernels.why})"
    return cpu_elementwise.describe_isa("small-batch linear kernel", isa(), lib.isas)


def takes_gated(n: int) -> bool:
    """Whether a SwiGLU gate/up weight [n = 2 I, K] can be packed gated (``SmallLinear(gated=True)``):
    I a multiple of 16, at the 16-float width (the 8-float kernel has no gated mode)."""
    return n > 0 and n % (2 * PANEL) == 0 and library() is not None and isa() == "avx512"


class SmallLinear:
    """A weight [N, K] packed into ceil(N / 16) panels [P, K, 16] (zero rows past N), in the
    weight's dtype (float32 or bfloat16, ``PANEL_DTYPES``); inputs and outputs are float32. The
    kernel's width is ``isa()``'s when the linear is made.
    ``prefetch``: the kernel prefetches each next panel while it reads one (off: to measure it).

    ``gated`` (``takes_gated``): the weight is a SwiGLU MLP's merged gate/up [2I, K] (gate rows,
    then up rows) and a call returns SiLU(gate) * up [M, I], bit for bit what the linear followed by
    ``cpu_elementwise``'s float32 silu_mul at the same width returns, without the [M, 2I]
    intermediate: panels packed gate 0, up 0, gate 1, up 1, ... so that a row block's pass over two
    side-by-side panels holds both halves of 16 outputs."""

    prefetch = True

    def __init__(self, weight: torch.Tensor, gated: bool = False) -> None:
        if weight.dtype not in PANEL_DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"SmallLinear packs 2-D float32 or bfloat16 CPU weights, not {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        if gated and not takes_gated(weight.shape[0]):
            raise ValueError(f"SmallLinear(gated=True) needs the 16-float kernel (this width: {isa()}) "
                             f"and out features a multiple of 32, not {weight.shape[0]}")
        self.n, self.k = weight.shape
        self.gated = gated
        self.width = isa()
        panels = -(-self.n // PANEL)
        padded = weight.new_zeros((panels * PANEL, self.k))
        padded[:self.n] = weight.detach()
        self.order = torch.tensor(BF16_ORDER if weight.dtype == torch.bfloat16 else range(PANEL))
        by_panel = padded.view(panels, PANEL, self.k)  # [P, 16, K]
        if weight.dtype == torch.bfloat16:  # the kernel's column order: swap columns 4-7 and 8-11 in place
            by_panel[:, 4:12] = by_panel[:, self.order[4:12]]
        if gated:  # gate panel i, then up panel i: [2, P / 2, 16, K] -> [P / 2, 2, 16, K]
            by_panel = by_panel.view(2, panels // 2, PANEL, self.k).transpose(0, 1).reshape(panels, PANEL, self.k)
        self.panels = by_panel.transpose(1, 2).contiguous()  # [P, K, 16]
        self.out = self.n // 2 if gated else self.n
        self.fn = getattr(library(), f"{'gated' if gated else 'linear'}_{PANEL_DTYPES[weight.dtype]}_{self.width}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 (any M: the panels are this weight's only copy)."""
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"SmallLinear of K={self.k} takes float32 CPU rows [M, {self.k}], not {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        m = x.shape[0]
        y = x.new_empty((m, self.out))
        if m:
            self.run(x.data_ptr(), m, y.data_ptr(), self.threads())
        return y

    def threads(self, num_threads: int | None = None) -> int:
        """The threads a call shares its panels over, of ``num_threads`` (default: torch's thread
        count now): one unless each gets ``MIN_PANELS_PER_THREAD`` panels."""
        if num_threads is None:
            num_threads = torch.get_num_threads()
        return max(1, min(num_threads, self.panels.shape[0] // MIN_PANELS_PER_THREAD))

    def run(self, x_ptr: int, m: int, out_ptr: int, threads: int) -> None:
        """``self(x)`` for a caller that checked its buffers itself and calls many times a step (no
        checks, no new output tensor): x a contiguous float32 [m, K] at ``x_ptr``, m >= 1; the
        output, a contiguous float32 [m, N] ([m, N / 2] gated), written at ``out_ptr``; ``threads``
        from ``threads()``. Rows go ``ROW_CHUNK`` at a time (each chunk's rows stay in cache)."""
        panels, k, n, prefetch = self.panels.data_ptr(), self.k, self.n, int(self.prefetch)
        for at in range(0, m, ROW_CHUNK):
            self.fn(x_ptr + at * k * 4, panels, out_ptr + at * self.out * 4, min(ROW_CHUNK, m - at), k, n, threads,
                    prefetch)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [N] of the weight, [N, K] in the panels' dtype (a tied head's embedding
        lookup): row r is column r % 16 of panel r // 16, at its place in the panel's order."""
        if self.gated:
            raise ValueError("a gated linear's panels are interleaved gate / up: it cannot look up rows")
        return self.panels[ids // PANEL, :, self.order[ids % PANEL]]
