"""A bfloat16 linear on the CPU's matrix units (``cpu_linear_amx.cpp``): ``AmxLinear``.

On a CPU with AMX a decode step's linears are the weights' trip from memory: a few rows meet each
weight once. oneDNN's prepacked matmul is laid out for many rows; at 16 rows it streamed its
blocked weights at ~15.5 GB/s (the small preset's 25 MB) and ~11.4 GB/s (Qwen3-0.6B's 881 MB) on
the bench's Sapphire Rapids (one thread), where this kernel, which reads its own packing of the
weight front to back in one pass (tile products of 16 rows x 32 x 16 columns, float accumulators),
reached ~21 and ~13.4 GB/s (``python -m course.tuning.levers linear-amx``, and with ``--preset
qwen3-0.6b``). Results are oneDNN's arithmetic on the same bfloat16 values (exact products, float
sums, one rounding to bfloat16 at the output) in another summation order.

Which layout a weight shape keeps is measured at load time (``linear_layout.choose``: this one
competes as ``amx`` where ``available()``); ``ENGINE_LINEAR_LAYOUT=amx`` forces it where it is
available. Shapes it takes: out features a multiple of 16, in features a multiple of 32
(``takes``), as every Qwen3 linear's are.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.fast.cpu_build import OptionalKernels

SOURCE = Path(__file__).with_name("cpu_linear_amx.cpp")
COLS, DEPTH = 16, 32  # the packing's column block and slice depth (out features, in features)
MIN_GROUPS_PER_THREAD = 4  # fewer 64-column groups than this per thread: one thread does them all
# A new output this large has its pages touched before the kernel writes it. Fresh memory faults
# each page in on its first write, and a fault taken inside the kernel's tile work cost far more
# than one outside it: a Qwen3-0.6B-shaped LM head on 64 rows (39 MB of float32 logits) with the
# greedy kernel after it, on 4 KiB pages, 61.8-63.3 ms with its pages faulting inside against
# 52.1-53.0 ms touched first (the AMX Xeon of issue 40, `python -m course.tuning.levers lm-head`;
# on 2 MiB pages the faults are few and the two are level).
TOUCH_BYTES = 1 << 20
PAGE_BYTES = 4096


def _declare(lib: ctypes.CDLL) -> None:
    lib.linear_amx_available.restype = ctypes.c_int64
    lib.linear_amx_available.argtypes = []
    lib.linear_amx_pack.restype = None
    lib.linear_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.linear_amx_rows.restype = None
    lib.linear_amx_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p]
    lib.linear_amx_set_prefetch.restype = None  # on by default; off only to measure it (levers.py) or test
    lib.linear_amx_set_prefetch.argtypes = [ctypes.c_int64]
    lib.linear_amx_bfloat16.restype = ctypes.c_int64  # 0; -1 no AMX in this build; -2 tiles refused
    lib.linear_amx_bfloat16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]


_kernels = OptionalKernels(SOURCE, _declare)
_usable: list[bool] = []  # [whether a first call ran], once per process


def library() -> ctypes.CDLL | None:
    """The kernel where it runs here: built for a CPU with AMX-BF16 and granted the tile state by
    the OS (tried once, on one row); else None."""
    lib = _kernels.get()
    if lib is None or not lib.linear_amx_available():
        return None
    if not _usable:
        w = torch.zeros(COLS, DEPTH, dtype=torch.bfloat16)
        x, out = torch.zeros(1, DEPTH, dtype=torch.bfloat16), torch.empty(1, COLS, dtype=torch.bfloat16)
        _usable.append(lib.linear_amx_bfloat16(x.data_ptr(), 1, DEPTH, w.data_ptr(), COLS, out.data_ptr(), 0, 1) == 0)
    return lib if _usable[0] else None


def available() -> bool:
    """Whether ``AmxLinear`` runs here (the CPU has AMX-BF16, the OS grants the tiles, it builds)."""
    return library() is not None


def takes(n: int, k: int, gated: bool = False) -> bool:
    """Whether a weight [n, k] can be packed: n a multiple of 16, k of 32; ``gated`` (a gate/up
    weight [2I, K]): n a multiple of 64, so that I is one of 32."""
    return n > 0 and k > 0 and n % (4 * COLS if gated else COLS) == 0 and k % DEPTH == 0


def _refused(status: int) -> ValueError:
    """The kernel's refusal (a nonzero status) as the error a call raises."""
    return ValueError(f"the AMX linear kernel refused to run (status {status}: the tile state was refused)")


class AmxLinear:
    """A bfloat16 weight [N, K] packed once into the kernel's tile order (``packed``, [N * K]
    bfloat16: the weight's own bytes, no padding); ``__call__`` x [M, K] bfloat16 -> [M, N]
    bfloat16 (or float32 with ``out_dtype``).

    ``gated``: the weight is a SwiGLU MLP's merged gate/up [2I, K] (gate rows, then up rows; I a
    multiple of 32) and a call returns SiLU(gate) * up [M, I] bfloat16, computed as the separate
    steps would (the linear's bf16 outputs, then ``cpu_elementwise.silu_mul``'s arithmetic on them)
    as the tiles are written out, without the [M, 2I] intermediate: packed with each 16 gate columns
    beside their 16 up columns, so that a pass over a column pair holds both."""

    def __init__(self, weight: torch.Tensor, gated: bool = False) -> None:
        lib = library()
        if lib is None:
            raise ValueError("AmxLinear needs a CPU with AMX-BF16 (and the OS's tile permission); "
                             "cpu_linear_amx.available() is False here")
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"AmxLinear packs a 2-D bfloat16 CPU weight, not {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.n, self.k = weight.shape
        if not takes(self.n, self.k):
            raise ValueError(f"AmxLinear takes out features a multiple of {COLS} and in features a multiple of "
                             f"{DEPTH}, not [{self.n}, {self.k}]")
        self.gated = gated
        if gated:
            if not takes(self.n, self.k, gated=True):
                raise ValueError(f"a gated AmxLinear takes a gate/up weight [2I, K] with I a multiple of {2 * COLS}, "
                                 f"not [{self.n}, {self.k}]")
            # rows: gate block 0, up block 0, gate block 1, up block 1, ... (blocks of 16)
            weight = weight.view(2, self.n // (2 * COLS), COLS, self.k).transpose(0, 1).reshape(self.n, self.k)
        w = weight.contiguous()
        self.packed = torch.empty(self.n * self.k, dtype=torch.bfloat16)
        lib.linear_amx_pack(w.data_ptr(), self.n, self.k, self.packed.data_ptr())
        self._call = lib.linear_amx_bfloat16
        self._packed_ptr = self.packed.data_ptr()  # ``run``'s: ``packed`` is made here only
        self._groups = -(-self.n // (4 * COLS))  # 64-column groups, what ``threads`` shares out

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, widened: bool = False) -> torch.Tensor:
        """x [M, K] bfloat16 -> [M, N] in ``out_dtype``: bfloat16 (each float sum rounded once, to
        nearest even) or float32 (the float sums themselves); ``widened`` (float32 only, not gated):
        the bfloat16 outputs written as float32, exactly ``self(x).float()`` in one pass (a bfloat16
        LM head's logits as the sampler takes them)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k or not x.is_cpu:
            raise ValueError(f"AmxLinear [{self.n}, {self.k}] takes a bfloat16 CPU input [M, {self.k}], "
                             f"not {x.dtype} {tuple(x.shape)}")
        if out_dtype not in (torch.bfloat16, torch.float32) or (self.gated and out_dtype != torch.bfloat16):
            raise ValueError(f"out_dtype must be bfloat16 or float32 (bfloat16 for a gated one), not {out_dtype}")
        if widened and (out_dtype != torch.float32 or self.gated):
            raise ValueError("widened outputs are float32 ones, of a linear that is not gated")
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.n // 2 if self.gated else self.n, dtype=out_dtype)
        if out.numel() * out.element_size() >= TOUCH_BYTES:  # one element a page: its faults taken here
            out.view(-1)[::PAGE_BYTES // out.element_size()].zero_()
        if m:
            self.run(x.data_ptr(), m, out.data_ptr(), self.threads(), out_dtype, widened)
        return out

    def threads(self, num_threads: int | None = None) -> int:
        """The threads a call shares its 64-column groups over, of ``num_threads`` (default: torch's
        thread count now)."""
        if num_threads is None:
            num_threads = torch.get_num_threads()
        return max(1, min(num_threads, self._groups // MIN_GROUPS_PER_THREAD))

    def run(self, x_ptr: int, m: int, out_ptr: int, threads: int, out_dtype: torch.dtype = torch.bfloat16,
            widened: bool = False) -> None:
        """``self(x, out_dtype, widened)`` for a caller that checked its buffers itself and calls many
        times a step (``FusedFlatModel``'s layer loop: no checks, no new output tensor): x a contiguous
        bfloat16 [m, K] at ``x_ptr``, m >= 1; the output, a contiguous [m, N] of ``out_dtype``
        (bfloat16 [m, N / 2] gated; float32 with ``widened``), written at ``out_ptr``; ``threads`` from
        ``threads()``. ``__call__`` checks its tensors and calls this."""
        mode = 2 if self.gated else 3 if widened else int(out_dtype == torch.float32)
        status = self._call(x_ptr, m, self.k, self._packed_ptr, self.n, out_ptr, mode, threads)
        if status:
            raise _refused(status)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [M] (int64) of the weight, [M, K] bfloat16: an embedding lookup in a tied
        head's layout (not a gated one's)."""
        if self.gated:
            raise ValueError("a gated AmxLinear (a gate/up weight) has no rows to look up")
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise ValueError(f"row ids must lie in [0, {self.n}), got {int(ids.min())}..{int(ids.max())}")
        out = torch.empty(ids.numel(), self.k, dtype=torch.bfloat16)
        library().linear_amx_rows(self.packed.data_ptr(), self.n, self.k, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out.view(*ids.shape, self.k)
