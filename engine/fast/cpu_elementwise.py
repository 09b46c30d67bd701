"""The elementwise work between a layer's matmuls in three C++ calls (``cpu_elementwise_kernel.cpp``), float32 or bfloat16.

``FusedFlatModel``'s eager path (decode-sized steps) runs its residual adds, norms, RoPE and SiLU
as ~25 small PyTorch operations per layer, each a pass over memory and a few microseconds of
dispatch. On a float32 or bfloat16 CPU model it calls these instead, one per seam:

- ``add_rms_norm(hidden, residual, weight, eps)``: ``residual += hidden``, then RMSNorm of it;
- ``qk_norm_rope(qkv, ...)``: the per-head q/k norm and RoPE, q to its own buffer, k in place;
- ``silu_mul(gate_up)``: SiLU(gate) * up.

Results equal the PyTorch expressions up to float32 summation order (tests check both, and the
engine against ``generate()``); in bfloat16 each value is computed in float32 and rounded to
bfloat16 where the PyTorch ops (and so ``generate()``) round, so a bfloat16 engine still gives
``generate()``'s greedy tokens. Built with the host's C++ compiler like the attention kernel;
``library()`` is None where it cannot be built, and the model keeps its PyTorch code there.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from engine.fast.cpu_build import OptionalKernels

SOURCE = Path(__file__).with_name("cpu_elementwise_kernel.cpp")
# Less work than this per thread (elements of the call's output, per kernel and dtype): one thread
# does it all. A second thread pays once a call takes ~8 us on one (waking it and joining it cost
# ~2-4 us), and the kernels' costs per element differ ~4x: at 64 rows, ctypes calls on the AMX
# Xeon of issue 40 (median us, one thread / two): bfloat16 add_rms_norm [64, 512] 11.5 / 9.8,
# qk_norm_rope [64, 12 heads of 64] 41 / 25, silu_mul [64, 1536] 46 / 26; float32 6.6 / 9.9,
# 15 / 13, 29 / 19. Two threads first paid at (rows) bfloat16 64 / 16 / 8, float32 256 / 32 / 16.
MIN_ELEMENTS_PER_THREAD = {
    ("add_rms_norm", torch.bfloat16): 16384, ("add_rms_norm", torch.float32): 65536,
    ("qk_norm_rope", torch.bfloat16): 6144, ("qk_norm_rope", torch.float32): 12288,
    ("silu_mul", torch.bfloat16): 6144, ("silu_mul", torch.float32): 12288,
}
MAX_HEAD_DIM = 1024  # the kernel's per-head scratch buffer


DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # each kernel's variants
ISAS = ("avx2", "avx512")  # the vector widths the kernel is built in: 8 floats, and 16 where AVX-512F compiles
ISA_ENV = "ENGINE_KERNEL_ISA"  # forces one of ISAS (tests exercise both); unset: the widest built here
KERNELS = ("add_rms_norm", "qk_norm_rope", "silu_mul")


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    lib.elementwise_isas.restype, lib.elementwise_isas.argtypes = ctypes.c_char_p, []
    for isa in lib.elementwise_isas().decode().split(","):
        for name in DTYPES.values():
            getattr(lib, f"add_rms_norm_{name}_{isa}").argtypes = [ptr] * 4 + [i64] * 2 + [f64] + [i64] * 2
            getattr(lib, f"qk_norm_rope_{name}_{isa}").argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                                                   f64, i64]
            getattr(lib, f"silu_mul_{name}_{isa}").argtypes = [ptr, ptr, i64, i64, i64]
            for kernel in KERNELS:
                getattr(lib, f"{kernel}_{name}_{isa}").restype = None


_kernels = OptionalKernels(SOURCE, _declare)


def library() -> ctypes.CDLL | None:
    """The built kernels, or None when they cannot be built here (no C++ compiler, a failed build)."""
    return _kernels.get()


def built_isas() -> tuple[str, ...]:
    """The widths the library holds here: ("avx2",) or ("avx2", "avx512"); () where it does not build."""
    lib = library()
    if lib is None:
        return ()
    if not hasattr(lib, "isas"):  # asked once per library: the kernels' calls read it
        lib.isas = tuple(lib.elementwise_isas().decode().split(","))
    return lib.isas


_isa_of: dict[str | None, str] = {}  # $ENGINE_KERNEL_ISA's value (None: unset) -> the width it selects, once checked


def isa() -> str:
    """The width the kernels run at: ``$ENGINE_KERNEL_ISA`` when set (ValueError when it names none of
    ``ISAS`` or one this build lacks), else the widest one built here. The variable is read at each
    call, so a test can switch it; what each value selects is worked out once (a refused value is
    refused again each time)."""
    forced = os.environ.get(ISA_ENV)
    chosen = _isa_of.get(forced)
    if chosen is None:
        chosen = choose_isa(forced, built_isas(), "elementwise kernels")
        if library() is not None:  # the built widths are known from now on
            _isa_of[forced] = chosen
    return chosen


def choose_isa(forced: str | None, built: tuple[str, ...], what: str) -> str:
    """The width a kernel library (``what``, built in ``built``: () when it is not built) runs at:
    ``forced`` (``$ENGINE_KERNEL_ISA``'s value) when set, else the widest built."""
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISAS)}")
        if built and forced not in built:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU's build of the {what} has only "
                             f"{', '.join(built)}; unset {ISA_ENV}")
        return forced
    return built[-1] if built else ISAS[0]


def describe() -> str:
    """One line for start-up reports: which width the elementwise kernels run at, and why."""
    if library() is None:
        return f"elementwise kernels: not built here ({_kernels.why})"
    return describe_isa("elementwise kernels", isa(), built_isas())


def describe_isa(what: str, chosen: str, built: tuple[str, ...]) -> str:
    """``what`` (a built kernel library) runs at width ``chosen`` of ``built``: the start-up line
    saying so, and why (``$ENGINE_KERNEL_ISA``, or the widest built)."""
    how = f"forced by {ISA_ENV}" if os.environ.get(ISA_ENV) else f"the widest of {', '.join(built)}"
    return f"{what}: {chosen} ({how})"


def takes_head_dim(dh: int) -> bool:
    """Whether ``qk_norm_rope`` takes heads of size ``dh`` (even, at most ``MAX_HEAD_DIM``); a model
    with other heads keeps its PyTorch code for that seam (decided when it is built)."""
    return dh % 2 == 0 and 0 < dh <= MAX_HEAD_DIM


def _threads(kernel: str, dtype: torch.dtype, elements: int) -> int:
    """The threads a ``kernel`` call in ``dtype`` writing ``elements`` shares its rows over."""
    least = MIN_ELEMENTS_PER_THREAD[(kernel, dtype)]
    if elements < 2 * least:  # one thread whatever torch's count (not asked for)
        return 1
    return max(1, min(torch.get_num_threads(), elements // least))


_functions: dict[tuple[str, torch.dtype, str], ctypes._CFuncPtr] = {}  # (kernel, dtype, width) -> the C function


def _kernel(name: str, *tensors: torch.Tensor):
    """The ``name`` kernel for the tensors' one dtype (contiguous CPU float32 or bfloat16 tensors),
    at the width ``isa()`` selects now (looked up in the library once per kernel, dtype and width)."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in DTYPES or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"the elementwise kernels take contiguous CPU tensors of one dtype, float32 or "
                             f"bfloat16, not {t.dtype} {tuple(t.shape)} on {t.device} (with {dtype})")
    return _function(name, dtype, isa())


def _function(name: str, dtype: torch.dtype, width: str):
    """The ``name`` kernel's C function for ``dtype`` (one of ``DTYPES``) at ``width``."""
    key = (name, dtype, width)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = getattr(library(), f"{name}_{DTYPES[dtype]}_{width}")
    return fn


def functions(dtype: torch.dtype) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """The C functions of (``add_rms_norm``, ``qk_norm_rope``, ``silu_mul``) for ``dtype`` at the
    width ``isa()`` selects now, for a caller that checks its tensors itself (contiguous CPU
    tensors of ``dtype``, the shapes the functions below check) and calls them many times a step
    (``FusedFlatModel``: each layer's three seams, ~5 us of checks a call saved). They take what
    the functions below pass them, in that order:
    add_rms_norm(hidden, residual, weight, out, n, d, eps, add, threads);
    qk_norm_rope(qkv, qkv row stride, n, hq, hkv, dh, weight, cos, sin, q, eps, threads);
    silu_mul(gate_up, out, n, width, threads): tensors as data_ptr()s, ``threads`` from
    ``threads_for``."""
    if dtype not in DTYPES:
        raise ValueError(f"the elementwise kernels take float32 or bfloat16, not {dtype}")
    width = isa()  # once for the three (it reads $ENGINE_KERNEL_ISA)
    return tuple(_function(name, dtype, width) for name in KERNELS)


def threads_for(kernel: str, dtype: torch.dtype, elements: int) -> int:
    """The thread count the functions below pass ``kernel`` (one of ``KERNELS``) for a call in
    ``dtype`` writing ``elements`` values (for ``functions``' callers)."""
    return _threads(kernel, dtype, elements)


def _out(out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` (checked: contiguous, ``like``'s dtype, on the CPU like ``like``, ``shape``) or a new
    tensor. A caller that passes the same buffer every layer saves the allocation and the page
    faults of fresh memory (tens of MB per call at a 2,048-token step)."""
    if out is None:
        return like.new_empty(shape)
    if out.shape != shape or out.dtype != like.dtype or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {like.dtype} tensor of shape {shape}, not {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden, residual [N, D] -> (normed [N, D], the new residual [N, D]).

    With a residual: ``residual += hidden`` in place, normed = RMSNorm(residual) * weight. Without
    (the first layer): the residual is ``hidden`` itself and only the norm is computed. ``out``:
    where to write normed (else a new tensor)."""
    if residual is None:
        residual, add = hidden, 0
    else:
        add = 1
    kernel = _kernel("add_rms_norm", hidden, residual, weight)
    if residual.dim() != 2 or hidden.shape != residual.shape or weight.shape != residual.shape[1:]:
        raise ValueError(f"add_rms_norm takes hidden and residual [N, D] and weight [D], got {tuple(hidden.shape)}, "
                         f"{tuple(residual.shape)}, {tuple(weight.shape)}")
    n, d = residual.shape
    out = _out(out, residual, (n, d))
    kernel(hidden.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                   n, d, eps, add, _threads("add_rms_norm", out.dtype, n * d))
    return out, residual


def qk_norm_rope(qkv: torch.Tensor, hq: int, hkv: int, dh: int, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) Dh] (q, k, v heads side by side); weight [Hq + Hkv, Dh] (each head's
    norm weight); cos, sin [N, Dh] -> q [N, Hq, Dh] normed and rotated (into ``out`` when given).
    The k heads are normed and rotated in place in ``qkv``; the v heads are not touched."""
    if not takes_head_dim(dh):
        raise ValueError(f"qk_norm_rope takes an even head size of at most {MAX_HEAD_DIM}, not {dh}")
    kernel = _kernel("qk_norm_rope", qkv, weight, cos, sin)
    n = qkv.shape[0]
    if (qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * dh or weight.shape != (hq + hkv, dh)
            or cos.shape != (n, dh) or sin.shape != (n, dh) or min(hq, hkv) < 1):
        raise ValueError(f"qk_norm_rope(hq={hq}, hkv={hkv}, dh={dh}) takes qkv [N, {(hq + 2 * hkv) * dh}], weight "
                         f"[{hq + hkv}, {dh}], cos and sin [N, {dh}]; got {tuple(qkv.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    q = _out(out, qkv, (n, hq, dh))
    kernel(qkv.data_ptr(), qkv.shape[1], n, hq, hkv, dh, weight.data_ptr(), cos.data_ptr(),
                                   sin.data_ptr(), q.data_ptr(), eps, _threads("qk_norm_rope", q.dtype, n * (hq + hkv) * dh))
    return q


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> SiLU(gate) * up [N, I] (into ``out`` when given)."""
    kernel = _kernel("silu_mul", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes gate_up [N, 2I], got {tuple(gate_up.shape)}")
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = _out(out, gate_up, (n, width))
    kernel(gate_up.data_ptr(), out.data_ptr(), n, width, _threads("silu_mul", out.dtype, n * width))
    return out
