"""The elementwise work between a layer's matmuls in three C++ calls (``cpu_elementwise_kernel.cpp``), float32.

``FusedFlatModel``'s eager path (decode-sized steps) runs its residual adds, norms, RoPE and SiLU
as ~25 small PyTorch operations per layer, each a pass over memory and a few microseconds of
dispatch. On a float32 CPU model it calls these instead, one per seam:

- ``add_rms_norm(hidden, residual, weight, eps)``: ``residual += hidden``, then RMSNorm of it;
- ``qk_norm_rope(qkv, ...)``: the per-head q/k norm and RoPE, q to its own buffer, k in place;
- ``silu_mul(gate_up)``: SiLU(gate) * up.

Results equal the PyTorch expressions up to float32 summation order (tests check both, and the
engine against ``generate()``). Built with the host's C++ compiler like the attention kernel;
``library()`` is None where it cannot be built, and the model keeps its PyTorch code there.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.serve.backends.cpu_attention import OptionalKernels

SOURCE = Path(__file__).with_name("cpu_elementwise_kernel.cpp")
MIN_ELEMENTS_PER_THREAD = 32768  # less work than this per thread: one thread does it all
MAX_HEAD_DIM = 1024  # the kernel's per-head scratch buffer


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    lib.add_rms_norm_float32.argtypes = [ptr] * 4 + [i64] * 2 + [f64] + [i64] * 2
    lib.qk_norm_rope_float32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, f64, i64]
    lib.silu_mul_float32.argtypes = [ptr, ptr, i64, i64, i64]
    for fn in (lib.add_rms_norm_float32, lib.qk_norm_rope_float32, lib.silu_mul_float32):
        fn.restype = None


_kernels = OptionalKernels(SOURCE, _declare)


def library() -> ctypes.CDLL | None:
    """The built kernels, or None when they cannot be built here (no C++ compiler, a failed build)."""
    return _kernels.get()


def _threads(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // MIN_ELEMENTS_PER_THREAD))


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"the elementwise kernels take contiguous float32 CPU tensors, not {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden, residual [N, D] -> (normed [N, D], the new residual [N, D]).

    With a residual: ``residual += hidden`` in place, normed = RMSNorm(residual) * weight. Without
    (the first layer): the residual is ``hidden`` itself and only the norm is computed."""
    if residual is None:
        residual, add = hidden, 0
    else:
        add = 1
    _check(hidden, residual, weight)
    if residual.dim() != 2 or hidden.shape != residual.shape or weight.shape != residual.shape[1:]:
        raise ValueError(f"add_rms_norm takes hidden and residual [N, D] and weight [D], got {tuple(hidden.shape)}, "
                         f"{tuple(residual.shape)}, {tuple(weight.shape)}")
    n, d = residual.shape
    out = torch.empty_like(residual)
    library().add_rms_norm_float32(hidden.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                   n, d, eps, add, _threads(n * d))
    return out, residual


def qk_norm_rope(qkv: torch.Tensor, hq: int, hkv: int, dh: int, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) Dh] (q, k, v heads side by side); weight [Hq + Hkv, Dh] (each head's
    norm weight); cos, sin [N, Dh] -> q [N, Hq, Dh] normed and rotated. The k heads are normed
    and rotated in place in ``qkv``; the v heads are not touched."""
    if dh > MAX_HEAD_DIM or dh % 2:
        raise ValueError(f"qk_norm_rope takes an even head size of at most {MAX_HEAD_DIM}, not {dh}")
    _check(qkv, weight, cos, sin)
    n = qkv.shape[0]
    if (qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * dh or weight.shape != (hq + hkv, dh)
            or cos.shape != (n, dh) or sin.shape != (n, dh) or min(hq, hkv) < 1):
        raise ValueError(f"qk_norm_rope(hq={hq}, hkv={hkv}, dh={dh}) takes qkv [N, {(hq + 2 * hkv) * dh}], weight "
                         f"[{hq + hkv}, {dh}], cos and sin [N, {dh}]; got {tuple(qkv.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    q = qkv.new_empty((n, hq, dh))
    library().qk_norm_rope_float32(qkv.data_ptr(), qkv.shape[1], n, hq, hkv, dh, weight.data_ptr(), cos.data_ptr(),
                                   sin.data_ptr(), q.data_ptr(), eps, _threads(n * (hq + hkv) * dh))
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> SiLU(gate) * up [N, I]."""
    _check(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes gate_up [N, 2I], got {tuple(gate_up.shape)}")
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((n, width))
    library().silu_mul_float32(gate_up.data_ptr(), out.data_ptr(), n, width, _threads(n * width))
    return out
