"""CPUBackend: attention that reads K/V where they lie in the pool (a small C++ kernel).

``TorchBackend`` copies every decode request's whole context out of the pool (``index_select``)
in every layer of every step, then multiplies the copy; at a few hundred tokens of context that
copy is the largest part of a CPU decode step. This backend's rows go through
``cpu_paged_kernel.cpp`` instead: for each row and kv head it walks the request's block table,
reads each key's K and V row from the pool in place (in the pool's own dtype: bfloat16 stays
bfloat16 in memory and is widened in registers) and computes softmax(q k^T * scale) v in float
(double for float64 pools). Decode rows take the kernel; a request with several rows (a prefill
chunk) takes it too, each row with its own causal limit, or is served as matrix products by
``cpu_prefill`` (PyTorch's CPU flash attention over its context gathered once, in float32, or
the blocked kernel ``cpu_prefill_kernel.cpp``, or for bfloat16 on a CPU with AMX the matrix
units' kernel ``cpu_prefill_amx.cpp``): which, by
its row count, is measured per attention shape on the machine at hand
(``cpu_prefill.choose``), printed by ``run.py bench``, and forced by ``prefill="kernel"|"sdpa"|"blocked"|"amx"``
or ``$ENGINE_ATTENTION_PREFILL`` (``prefill_in_place=False``: the older design, requests with several
rows through ``TorchBackend``'s tile path of one gather per 32-row tile, measured slower).
``write`` stores the step's K/V rows with one kernel call too (``cpu_write_kernel.cpp``'s plain
copy where a bfloat16 model hands bfloat16 rows to its bfloat16 pool), and ``forward_rows`` attends only
the rows asked for (the fast flat models' last layer).

Measured before writing a kernel (docs/performance.md): the same gather-free decode attention
written as tensor indexing and compiled by TorchInductor (dynamic shapes) ran no faster than the
gather plus ``bmm`` it replaces; the copy's cost moved into poorly vectorised indirect loads.

The kernel is compiled on first use with the host's C++ compiler (``$CXX``, else ``c++``; the
same compiler TorchInductor needs) into a cache directory, and loaded with ctypes
(``cpu_build.py``): no extension build, no torch headers, about a second. With ``torch.get_num_threads()`` > 1 the step's rows
are shared by that many threads in small chunks: OpenMP's, and the same workers torch's own ops
run on, since the library links the OpenMP runtime torch has already loaded
(``cpu_kernel_share.h``; a compiler without OpenMP builds it single-threaded). ctypes releases the
GIL during the call.
"""
from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import numpy as np
import torch

from engine.serve.attention import KVCache
from engine.serve.batch import BatchMeta
from engine.fast import cpu_decode_variant, cpu_prefill, huge_pages
from engine.fast.cpu_build import OptionalKernels
from engine.fast.torch_attention import TorchBackend, _TileGroup

SOURCE = Path(__file__).with_name("cpu_paged_kernel.cpp")
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}
MIN_ROWS_PER_THREAD = 4  # fewer decode rows than this per thread: one thread does them all
MIN_WRITE_ROWS_PER_THREAD = 64  # a row's K/V copy is far less work than its attention: share big writes only


def _declare(lib: ctypes.CDLL) -> None:
    for name in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{name}")
        fn.restype = ctypes.c_int64  # the number of rows whose keys lie outside the pool (then nothing is computed)
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 7 \
            + [ctypes.c_double, ctypes.c_int64]
        fn = getattr(lib, f"write_kv_{name}")
        fn.restype = ctypes.c_int64  # the number of slots out of range (then nothing is written)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] \
            + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    for name in ("paged_set_prefetch", "paged_set_blocked"):  # on by default; off only to measure them (levers.py) or test
        if hasattr(lib, name):  # a library built from an older revision (levers.py's "before") may lack the second
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [ctypes.c_int64]


_kernel = OptionalKernels(SOURCE, _declare)
WRITE_SOURCE = Path(__file__).with_name("cpu_write_kernel.cpp")  # bfloat16 rows into a bfloat16 pool: copied


def _declare_write(lib: ctypes.CDLL) -> None:
    lib.write_kv_copy.restype = ctypes.c_int64  # the number of slots out of range (then nothing is written)
    lib.write_kv_copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] \
        + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2


_write_kernel = OptionalKernels(WRITE_SOURCE, _declare_write)
# The kernel's builds (cpu_attn_vec.h; which one serves a shape: cpu_decode_variant): "native",
# the widest vectors -march=native targets (AVX-512: bfloat16 keys widened in registers for the
# scores); "dpbf16", the same with a bfloat16 row's scores by AVX512-BF16 dot products (vdpbf16ps)
# where the CPU has them (elsewhere it is "native"); "avx2", the same source held to 32-byte
# vectors without bf16 dot products (what a CPU without AVX-512 runs).
_variants = {"native": None,  # _kernel, looked up at call time
             "dpbf16": OptionalKernels(SOURCE, _declare, extra=("-DATTN_SCORES_DPBF16",)),
             "avx2": OptionalKernels(SOURCE, _declare, extra=("-DATTN_VEC_BYTES=32", "-DATTN_NO_DPBF16"))}


def load_kernel(variant: str = "native") -> ctypes.CDLL:
    """The compiled attention kernel library of build ``variant`` (built once per source,
    compiler, flags and CPU); ValueError saying why where it cannot be built here (tried once per
    process: asking again, as every ``LLM`` does when it picks its backend, does not run the
    compiler again)."""
    kernels = _variants[variant] or _kernel
    lib = kernels.get()
    if lib is None:
        raise ValueError(kernels.why)
    return lib


def _bad_slots(bad: int, num_slots: int) -> ValueError:
    """The write kernel's refusal: ``bad`` rows' slots lie outside the pool."""
    return ValueError(f"write: {bad} slot(s) of the slot mapping lie outside the pool's {num_slots} slots")


def _write_rows(call: tuple, k_ptr: int, k_stride: int, v_ptr: int, v_stride: int, cache: KVCache) -> None:
    """The write kernel of ``call`` (``CPUBackend._write_call``: checked for this step's slot mapping,
    rows and pools) on K and V rows at ``k_ptr`` / ``v_ptr``, ``k_stride`` / ``v_stride`` elements
    apart, into ``cache``'s pools; ValueError where a slot lies outside them."""
    slots, fn, bytes_, (n, row, num_slots, threads) = call[0], call[7], call[8], call[9]
    bad = fn(k_ptr, bytes_ * k_stride, v_ptr, bytes_ * v_stride, slots.data_ptr(), n, row, cache[0].data_ptr(),
             cache[1].data_ptr(), num_slots, threads)
    if bad:
        raise _bad_slots(bad, num_slots)


def _same_pools(call: tuple | None, cache: KVCache, slots: torch.Tensor) -> bool:
    """Whether ``call`` (``CPUBackend._write_call``, or None) was checked for this step's slot
    mapping, pools of these shapes and dtypes (contiguous) and torch's thread count now: what
    ``write`` and ``write_merged`` ask of a checked call besides their rows' own layout."""
    k_pool, v_pool = cache
    return (call is not None and call[0] is slots and k_pool.shape == call[3] and v_pool.shape == call[3]
            and k_pool.dtype is call[4] and v_pool.dtype is call[4] and k_pool.is_contiguous()
            and v_pool.is_contiguous() and torch.get_num_threads() == call[6])


def _bad_rows(bad: int, num_blocks: int, width: int) -> ValueError:
    """The row kernel's refusal: ``bad`` rows would read past the pool or their block table."""
    return ValueError(f"attention: {bad} row(s) would read keys outside the K/V pool's {num_blocks} blocks "
                      f"or past their block table's {width} columns (a corrupt block table)")


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Where the row kernel writes q's rows: ``out`` (``forward_into``'s buffer: ValueError unless a
    contiguous tensor of q's shape and dtype), or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype is not q.dtype or not out.is_contiguous():
        raise ValueError(f"attention out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)}, "
                         f"not {out.dtype} {tuple(out.shape)}")
    return out


class CPUBackend(TorchBackend):
    """TorchBackend whose rows read the pool in place through a C++ kernel (name "cpu"); same
    contract and results as the reference. Cascade attention is off: with no per-request copy
    there is nothing for a shared prefix to save.

    ``prefill_in_place=True`` (the default): every row of the batch goes through the kernel, each
    with its request's block table and its own position (the causal limit), except the rows of
    requests the prefill choice sends to matrix products (``prefill``: "kernel", "sdpa",
    "blocked", "amx", or None / "auto": ``$ENGINE_ATTENTION_PREFILL``, else measured; ``cpu_prefill``). ``False``:
    only decode tiles take the kernel; tiles of several rows take ``TorchBackend``'s
    gather-and-SDPA path (an earlier design, kept to measure against). ``decode``: the kernel
    build rows take, "native" or "avx2" (None / "auto": ``$ENGINE_ATTENTION_DECODE``, else
    measured per attention shape; ``cpu_decode_variant``).

    Invariant: ``_rows`` caches the per-row plan of exactly one BatchMeta (``_rows_key``), and
    ``_matrix`` (with ``_matrix_rows``) the matrix paths' plan of one (BatchMeta, rows, choice)
    (``_matrix_key``); every layer of a step reuses them.
    """

    name = "cpu"

    def __init__(self, prefill_in_place: bool = True, prefill: str | None = None, decode: str | None = None,
                 **options) -> None:
        options.setdefault("cascade_min_reqs", 0)
        super().__init__(**options)
        self.prefill_in_place = prefill_in_place
        cpu_prefill.forced_path(prefill)  # a bad name: ValueError now, not at the first prefill
        self.prefill = prefill  # None: $ENGINE_ATTENTION_PREFILL, else measured (cpu_prefill.choose)
        cpu_decode_variant.forced_variant(decode)  # a bad name: ValueError now
        self.decode = decode  # the kernel build: None / "auto" ($ENGINE_ATTENTION_DECODE, else measured per shape)
        self._lib = load_kernel()  # the native build: writes, and rows until a shape's build is chosen
        self._rows_key: tuple[BatchMeta, int] | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._matrix_key: tuple | None = None
        self._matrix: tuple | None = None
        self._matrix_rows: tuple[bool, torch.Tensor | None] = (True, None)  # _matrix's (any kernel row, padding rows)
        self._checked: tuple | None = None  # (BatchMeta, pool blocks, window) whose matrix requests' tables passed
        self._decode_libs: dict[tuple, ctypes.CDLL] = {}  # _decode_lib's memo
        self._call: tuple | None = None  # _run's checked call of the last (tables, q_pos): every layer of a step
        self._write_call: tuple | None = None  # write's checked call of the last slot mapping
        self._prefill_choices: dict[tuple, cpu_prefill.PrefillChoice] = {}  # prefill_choice's memo

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        if torch.device(device).type != "cpu" or dtype not in DTYPES:
            raise ValueError(f"the 'cpu' attention backend serves CPU pools of {sorted(map(str, DTYPES))}, "
                             f"not {dtype} on {device}; use attention_backend='torch'")
        return huge_pages.zeros(shape, dtype), huge_pages.zeros(shape, dtype)  # zeros, on 2 MiB pages where granted

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        """The reference's ``write_kv`` (padding rows into the last slot) in one kernel call, k and v
        read where they lie (e.g. views of a merged qkv projection). Rows in the pool's dtype are
        stored as they are; float32 rows into a bfloat16 pool are rounded on the way
        (``cpu_paged_kernel.cpp``'s ``write_kv_*``). A bfloat16 pool's bfloat16 rows (a bfloat16
        model whose matmuls run in bfloat16) are copied by ``cpu_write_kernel.cpp``. Rows of any
        other dtype, and any kernel that cannot be built here, take the reference's path."""
        k_pool, v_pool, slots = *cache, meta.slot_mapping
        call = self._write_call
        if (_same_pools(call, cache, slots) and k.shape == call[1] and v.shape == call[1] and k.dtype is call[2]
                and v.dtype is call[2] and k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == call[5]
                and v.stride(1) == call[5]):
            # Another layer of the step whose call was checked (``_write_call``): rows of the same
            # shape, dtype and row layout into pools of the same shape; only the addresses differ.
            _write_rows(call, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache)
            return
        n, hkv, d = k.shape
        if v.shape != k.shape or k_pool.shape[2:] != (hkv, d) or v_pool.shape != k_pool.shape:
            raise ValueError(f"write: rows k {tuple(k.shape)}, v {tuple(v.shape)} do not fit pools "
                             f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)} ([blocks, bs, Hkv, D] each)")
        copy = k.dtype == torch.bfloat16 and k_pool.dtype == torch.bfloat16  # bf16 rows: a plain copy
        source = torch.float32 if k_pool.dtype == torch.bfloat16 and not copy else k_pool.dtype
        rows_ok = all(t.dtype == source and t.stride(2) == 1 and t.stride(1) == d for t in (k, v))
        slots_ok = slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == n
        lib = _write_kernel.get() if copy else self._lib
        if not (rows_ok and slots_ok and k_pool.is_contiguous() and v_pool.is_contiguous()) or lib is None:
            return super().write(cache, k, v, meta)
        num_slots = k_pool.shape[0] * k_pool.shape[1]
        threads = max(1, min(torch.get_num_threads(), n // MIN_WRITE_ROWS_PER_THREAD))
        if copy:  # strides in bytes, 2 bytes an element
            fn, bytes_ = lib.write_kv_copy, 2
        else:  # strides in elements
            fn, bytes_ = getattr(lib, f"write_kv_{DTYPES[k_pool.dtype]}"), 1
        # What the step's other layers reuse: (slot mapping, row shape, row dtype, pool shape, pool
        # dtype, row stride 1, thread count, kernel, bytes an element in its strides, its fixed arguments).
        self._write_call = (slots, k.shape, k.dtype, k_pool.shape, k_pool.dtype, d, torch.get_num_threads(), fn,
                            bytes_, (n, bytes_ * hkv * d, num_slots, threads))
        _write_rows(self._write_call, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cache)

    def write_merged(self, cache: KVCache, qkv: torch.Tensor, k_at: int, v_at: int, meta: BatchMeta) -> None:
        """``write(cache, k, v, meta)`` of the rows' K and V held side by side in one projection's
        output: k = qkv[:, k_at:k_at + Hkv D] and v = qkv[:, v_at:v_at + Hkv D], each as [N, Hkv, D]
        (Hkv, D: the pools'), read where they lie without making those views once ``write`` has
        checked a call of this step (``_write_call``: the same slot mapping, row shape and dtype, and
        pools; the rows' stride in qkv its own). qkv: [N, width], unit column stride."""
        slots, call = meta.slot_mapping, self._write_call
        hkv, d = cache[0].shape[2:]
        w = hkv * d
        if (_same_pools(call, cache, slots) and qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.dtype is call[2]
                and call[1] == (qkv.shape[0], hkv, d) and 0 <= k_at and 0 <= v_at and k_at + w <= qkv.shape[1]
                and v_at + w <= qkv.shape[1] and call[5] == d):
            base, size = qkv.data_ptr(), qkv.element_size()
            _write_rows(call, base + k_at * size, qkv.stride(0), base + v_at * size, qkv.stride(0), cache)
            return
        n = qkv.shape[0]
        self.write(cache, qkv[:, k_at:k_at + w].view(n, hkv, d), qkv[:, v_at:v_at + w].view(n, hkv, d), meta)

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """q: [N, Hq, D] -> [N, Hq, D]; the same contract as ``ReferenceBackend.forward``."""
        if not self.prefill_in_place:
            return super().forward(q, cache, meta, scale=scale, window=window)
        return self._in_place(q, cache, meta, None, scale, window)

    def forward_rows(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, rows: torch.Tensor,
                     scale: float | None = None, window: int = 0) -> torch.Tensor:
        """``forward(q, cache, meta)[rows]`` without computing the other rows: q [N, Hq, D], rows
        int64 [M] -> [M, Hq, D]."""
        if not self.prefill_in_place:
            return self.forward(q, cache, meta, scale=scale, window=window).index_select(0, rows)
        return self._in_place(q, cache, meta, rows, scale, window)

    def forward_into(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, out: torch.Tensor,
                     scale: float | None = None, window: int = 0) -> torch.Tensor:
        """``forward(q, cache, meta)``, written into ``out`` (a contiguous tensor of q's shape and
        dtype: ValueError otherwise) when every row takes the row kernel, as a decode step's do; the
        returned tensor is the result (``out``, or a new one where rows took a matrix path)."""
        if not self.prefill_in_place:
            return super().forward(q, cache, meta, scale=scale, window=window)
        return self._in_place(q, cache, meta, None, scale, window, out)

    def _in_place(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, rows: torch.Tensor | None,
                scale: float | None, window: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every row through the kernel (``rows``: only those rows of the batch; ``out``: where the
        row kernel writes when it serves every row)."""
        n, hq, d = q.shape
        if hq % cache[0].shape[2] != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({cache[0].shape[2]})")
        tables, q_pos = self._row_plan(meta, n)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        if rows is not None:  # a few rows (the logits rows): one kernel row each, nothing else computed
            q, tables, q_pos = (t.index_select(0, rows) for t in (q, tables, q_pos))
            return self._run(q, cache, tables, q_pos, scale, window)
        if meta.max_query_len > 1:
            choice = self.prefill_choice(q.dtype, hq, cache)
            if choice.steps:
                return self._with_matrices(q, cache, meta, tables, q_pos, choice, scale, window)
        return self._run(q, cache, tables, q_pos, scale, window, out=out)

    def decode_choice(self, dtype: torch.dtype, hq: int, cache: KVCache) -> cpu_decode_variant.DecodeChoice:
        """Which kernel build serves rows of this attention shape (``cpu_decode_variant.choose``:
        forced, or measured once per shape; where the "avx2" build fails, "native")."""
        _, bs, hkv, d = cache[0].shape

        def run(variant, q, pools, tables, q_pos):
            return self._run(q, pools, tables, q_pos, d ** -0.5, 0, lib=load_kernel(variant))
        if cpu_decode_variant.forced_variant(self.decode) is None:
            try:
                for variant in cpu_decode_variant.candidates(dtype):
                    load_kernel(variant)
            except ValueError:  # only the native build here: nothing to measure
                return cpu_decode_variant.choose(run, dtype, hq, hkv, d, bs, "native")
        return cpu_decode_variant.choose(run, dtype, hq, hkv, d, bs, self.decode)

    def _decode_lib(self, dtype: torch.dtype, hq: int, cache: KVCache) -> ctypes.CDLL:
        """The library of the build ``decode_choice`` gives, remembered per (dtype, shape, thread
        count, ``$ENGINE_ATTENTION_DECODE``'s value): every layer of every step asks, and the
        choice is the same until one of those changes."""
        key = (dtype, hq, cache[0].shape[1:], torch.get_num_threads(), os.environ.get(cpu_decode_variant.ENV))
        lib = self._decode_libs.get(key)
        if lib is None:
            lib = self._decode_libs[key] = load_kernel(self.decode_choice(dtype, hq, cache).variant)
        return lib

    def prefill_choice(self, dtype: torch.dtype, hq: int, cache: KVCache) -> cpu_prefill.PrefillChoice:
        """Which requests of a step take the matrix path (``cpu_prefill.choose``: forced, or
        measured once per attention shape), remembered per (dtype, shape, thread count,
        ``$ENGINE_ATTENTION_PREFILL``'s value): every layer of a prefill step asks."""
        _, bs, hkv, d = cache[0].shape
        key = (dtype, hq, bs, hkv, d, torch.get_num_threads(), os.environ.get(cpu_prefill.ENV))
        choice = self._prefill_choices.get(key)
        if choice is None:
            choice = self._prefill_choices[key] = cpu_prefill.choose(
                lambda q, c, tables, q_pos: self._run(q, c, tables, q_pos, d ** -0.5, 0), dtype, hq, hkv, d, bs,
                self.prefill)
        return choice

    def _with_matrices(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, tables: torch.Tensor,
                       q_pos: torch.Tensor, choice: cpu_prefill.PrefillChoice, scale: float,
                       window: int) -> torch.Tensor:
        """Each request of several rows through the path ``choice`` gives its row count: "sdpa"
        (``cpu_prefill.attend_requests``, requests of one shape together, their contexts gathered
        once), "blocked" or "amx" (``cpu_prefill.attend_packed``, all of a kernel's requests in one
        call); every other row through the row kernel."""
        groups, packed, kernel_pos = self._matrix_plan(meta, q_pos, choice)
        k_pool, v_pool = cache
        checked = self._checked
        if checked is None or checked[0] is not meta or checked[1:] != (k_pool.shape[0], window):  # once per step
            self._check_tables(meta, kernel_pos != q_pos, k_pool.shape[0], window)
            self._checked = (meta, k_pool.shape[0], window)
        q = q.contiguous()
        any_kernel, padding = self._matrix_rows
        if any_kernel:
            out = self._run(q, cache, tables, kernel_pos, scale, window)  # the matrix rows come back as zeros
        else:  # every row a matrix path writes but the padding ones, zeroed here
            out = torch.empty_like(q)
            if padding is not None:
                out.index_fill_(0, padding, 0)
        hq, d = q.shape[1:]
        for path, plan in packed.items():  # the C++ matrix kernels: each its requests in one call
            cpu_prefill.attend_packed(path, q, k_pool, v_pool, *plan, scale, window, out)
        for (t, context), (rows, reqs, start) in groups.items():
            b = reqs.shape[0]
            blocks = meta.block_table.index_select(0, reqs)  # [B, W]
            if start is not None:  # the group's rows are consecutive: views in and out, no copies
                out[start:start + b * t].view(b, t, hq, d)[:] = cpu_prefill.attend_requests(
                    q[start:start + b * t].view(b, t, hq, d), k_pool, v_pool, blocks, context, scale, window)
            else:
                o = cpu_prefill.attend_requests(q.index_select(0, rows).view(b, t, hq, d), k_pool, v_pool, blocks,
                                                context, scale, window)
                out.index_copy_(0, rows, o.reshape(b * t, hq, d))
        return out

    @staticmethod
    def _check_tables(meta: BatchMeta, matrix_rows: torch.Tensor, num_blocks: int, window: int) -> None:
        """ValueError, before anything is computed, when a request served as matrices would read a
        block-table column past the table or an entry outside the pool's ``num_blocks`` (the row
        kernel checks its own rows likewise)."""
        qsl = meta.query_start_loc_cpu.numpy()
        starts = qsl[:-1][(qsl[1:] > qsl[:-1])]
        reqs = np.flatnonzero(qsl[1:] > qsl[:-1])[matrix_rows.numpy()[starts]]  # requests whose rows took a matrix path
        bs, width = meta.block_size, meta.block_table.shape[1]
        table = meta.block_table.numpy() if meta.block_table.device.type == "cpu" else meta.block_table.cpu().numpy()
        seq_len = meta.seq_lens_cpu.numpy()[reqs].astype(np.int64)  # [M]
        t = (qsl[reqs + 1] - qsl[reqs]).astype(np.int64)
        first = np.maximum(0, seq_len - t - window + 1) if window > 0 else np.zeros_like(seq_len)
        last_block = (seq_len - 1) // bs
        cols = np.arange(width)[None, :]
        used = (cols >= (first // bs)[:, None]) & (cols <= last_block[:, None])  # [M, W] the columns each reads
        entries = table[reqs]
        bad = int(((last_block >= width) | (used & ((entries < 0) | (entries >= num_blocks))).any(1)).sum())
        if bad:
            raise ValueError(f"attention: {bad} request(s) would read keys outside the K/V pool's {num_blocks} blocks "
                             f"or past their block table's {width} columns (a corrupt block table)")

    def _matrix_plan(self, meta: BatchMeta, q_pos: torch.Tensor, choice: cpu_prefill.PrefillChoice):
        """The requests of several rows by the path ``choice`` gives them: "sdpa" ones grouped by
        (rows t, cached context), per group its rows (int64 [B * t]), its requests (int64 [B]) and
        its first row when the rows are consecutive (else None); per C++ matrix kernel ("blocked",
        "amx") that has requests, theirs as (tables int32 [B, W], first rows, row counts, cached
        contexts: int64 [B] each); and the kernel's positions: ``q_pos`` with every matrix row at
        -1 (skipped)."""
        key = (meta, q_pos.shape[0], choice.steps)
        if self._matrix_key is not None and self._matrix_key[0] is meta and self._matrix_key[1:] == key[1:]:
            return self._matrix
        qsl = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        positions = q_pos.numpy()  # [N]
        matrix = np.zeros(positions.shape[0], dtype=bool)  # rows a matrix path serves
        members: dict[tuple[int, int], list[int]] = {}
        packed_reqs: dict[str, list[int]] = {}
        for r, seq_len in enumerate(seq_lens):
            t = qsl[r + 1] - qsl[r]
            path = choice.path_for(t) if t > 1 and seq_len > 0 else "kernel"
            if path == "sdpa":
                members.setdefault((t, seq_len - t), []).append(r)
            elif path != "kernel":
                packed_reqs.setdefault(path, []).append(r)
            if path != "kernel":
                matrix[qsl[r]:qsl[r + 1]] = True
        kernel_pos = torch.from_numpy(np.where(matrix, -1, positions))
        groups = {}
        for (t, context), reqs in members.items():
            starts = [qsl[r] for r in reqs]
            consecutive = all(s == starts[0] + i * t for i, s in enumerate(starts))
            rows = torch.tensor([s + j for s in starts for j in range(t)], dtype=torch.int64)
            groups[(t, context)] = (rows, torch.tensor(reqs, dtype=torch.int64), starts[0] if consecutive else None)
        packed = {}
        for path, reqs in packed_reqs.items():
            idx = torch.tensor(reqs, dtype=torch.int64)
            t = torch.tensor([qsl[r + 1] - qsl[r] for r in reqs], dtype=torch.int64)
            packed[path] = (meta.block_table.index_select(0, idx).to(torch.int32).contiguous(),
                            torch.tensor([qsl[r] for r in reqs], dtype=torch.int64), t,
                            torch.tensor([seq_lens[r] for r in reqs], dtype=torch.int64) - t)
        self._matrix_key, self._matrix = key, (groups, packed, kernel_pos)
        padding = np.flatnonzero(positions < 0)  # rows of no request (and of requests without keys)
        self._matrix_rows = (bool((~matrix & (positions >= 0)).any()), torch.from_numpy(padding) if padding.size else None)
        return self._matrix

    def _row_plan(self, meta: BatchMeta, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: its request's block table (int32 [N, W]) and position (int64 [N]; -1 for a
        padding row)."""
        if self._rows_key is not None and self._rows_key[0] is meta and self._rows_key[1] == n:
            return self._rows
        width = max(1, -(-meta.max_seq_len // meta.block_size))
        if meta.max_query_len == 1 and n == meta.num_reqs == meta.query_start_loc_cpu.tolist()[-1]:
            # Pure decode, one row per request (the common step): row r is request r, at position
            # seq_len - 1 (-1: a padding request's row, seq_len 0). The general plan below gives
            # the same tables and positions with more arithmetic. (In an engine step, where numpy's
            # code has gone cold since the last step, the general plan's numpy calls took ~60 us;
            # torch.tensor of the positions as a Python list, ~0.5 us a row.)
            q_pos = (meta.seq_lens_cpu.to(torch.int64) - 1).clamp_min_(-1)  # int64 [N], a new tensor
            tables = meta.block_table[:, :width].to(torch.int32).contiguous()
            self._rows_key, self._rows = (meta, n), (tables, q_pos)
            return self._rows
        qsl = meta.query_start_loc_cpu.numpy().astype(np.int64)  # [R + 1]
        seq_lens = meta.seq_lens_cpu.numpy().astype(np.int64)  # [R]
        num_rows = np.diff(qsl)  # [R]
        req = np.repeat(np.arange(num_rows.size), num_rows)  # [rows] the request of each row
        q_pos = np.full(n, -1, dtype=np.int64)
        first_row = qsl[:-1][req]
        # A request's t rows end its context: row j of them is position seq_len - t + j.
        pos = seq_lens[req] - num_rows[req] + (np.arange(req.size) - first_row)
        q_pos[:req.size] = np.where(seq_lens[req] > 0, pos, -1)
        if req.size == meta.num_reqs and (num_rows == 1).all():
            tables = meta.block_table[:, :width]  # pure decode: row r is request r
        else:
            tables = meta.block_table[:, :width].index_select(0, torch.from_numpy(req))
        if tables.shape[0] < n:  # padding rows past the requests' rows: any table, no keys read
            tables = torch.cat([tables, tables.new_zeros((n - tables.shape[0], width))])
        tables = tables.to(torch.int32).contiguous()
        self._rows_key, self._rows = (meta, n), (tables, torch.from_numpy(q_pos))
        return self._rows

    def _forward_identity(self, q: torch.Tensor, cache: KVCache, group: _TileGroup, scale: float,
                          window: int) -> torch.Tensor:
        return self._decode(q, cache, group, scale, window)  # no chunking: nothing is gathered

    def _forward_group(self, q: torch.Tensor, cache: KVCache, group: _TileGroup, scale: float, window: int,
                       out: torch.Tensor) -> None:
        if group.q_rows.shape[1] > 1:  # tiles of several rows: gather and SDPA
            return super()._forward_group(q, cache, group, scale, window, out)
        out.index_copy_(0, group.out_rows[:, 0], self._decode(q.index_select(0, group.q_rows[:, 0]), cache, group,
                                                               scale, window))

    def _decode(self, q: torch.Tensor, cache: KVCache, group: _TileGroup, scale: float, window: int) -> torch.Tensor:
        """One query row per tile: q [G, Hq, D] -> [G, Hq, D], keys read through ``group.tables``."""
        return self._run(q, cache, group.tables, group.q_pos[:, 0], scale, window)

    def _run(self, q: torch.Tensor, cache: KVCache, tables: torch.Tensor, q_pos: torch.Tensor, scale: float,
             window: int, lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel on rows q [G, Hq, D] with their tables [G, W] and positions [G] -> [G, Hq, D]
        (``lib``: that build; default: the one chosen for this shape, ``decode_choice``), written
        into ``out`` when given (contiguous, q's shape and dtype), else into a new tensor."""
        k_pool, v_pool = cache
        call = self._call
        if (lib is None and call is not None and call[0] is tables and call[1] is q_pos and q.shape == call[2]
                and q.dtype is call[3] and k_pool.dtype is call[3] and v_pool.dtype is call[3]
                and k_pool.shape == call[4] and v_pool.shape == call[4] and scale == call[5] and window == call[6]
                and q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()
                and torch.get_num_threads() == call[7]):
            # Another layer of the step whose call was checked (``_call``): rows of the same shape
            # and dtype, the same tables and positions (so the same step: its first layer read
            # $ENGINE_ATTENTION_DECODE, ``_decode_lib``), pools of the same shape; only the
            # tensors' addresses differ.
            out = _output(out, q)
            bad = call[9](q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), *call[10])
            if bad:
                raise _bad_rows(bad, call[4][0], tables.shape[1])
            return out
        if q.dtype != k_pool.dtype or v_pool.dtype != k_pool.dtype:
            raise ValueError(f"queries ({q.dtype}) and pools ({k_pool.dtype}, {v_pool.dtype}) must share a dtype")
        g, hq, d = q.shape
        num_blocks, bs, hkv, pool_d = k_pool.shape
        if pool_d != d or bs < 1 or v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError(f"the 'cpu' backend reads contiguous K and V pools of one shape [blocks, bs, Hkv, {d}], "
                             f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
        if hkv < 1 or hq % hkv != 0:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
        if tables.dim() != 2 or tables.shape[0] < g or q_pos.shape != (g,):
            raise ValueError(f"{g} query rows need a block table of >= {g} rows and {g} positions, got "
                             f"{tuple(tables.shape)} and {tuple(q_pos.shape)}")
        q = q.contiguous()
        if tables.stride(1) != 1 or tables.dtype != torch.int32:
            tables = tables.to(torch.int32).contiguous()
        if q_pos.dtype != torch.int64 or not q_pos.is_contiguous():
            q_pos = q_pos.to(torch.int64).contiguous()  # int64 [G]
        out = _output(out, q)
        chosen = lib is None
        if chosen:
            lib = self._decode_lib(q.dtype, hq, cache)
        fn = getattr(lib, f"paged_decode_{DTYPES[q.dtype]}")
        rest = (tables.data_ptr(), tables.stride(0), tables.shape[1], q_pos.data_ptr(), g,
                max(1, min(torch.get_num_threads(), g // MIN_ROWS_PER_THREAD)),
                hq, hkv, d, bs, num_blocks, float(scale), int(window))
        if chosen and tables.is_contiguous() and q_pos.is_contiguous():
            # What the step's later layers reuse: (tables, positions, q's shape, dtype, pool shape,
            # scale, window, thread count, $ENGINE_ATTENTION_DECODE, kernel, its arguments after the pointers).
            self._call = (tables, q_pos, q.shape, q.dtype, k_pool.shape, scale, window, torch.get_num_threads(),
                          os.environ.get(cpu_decode_variant.ENV), fn, rest)
        bad = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), *rest)
        if bad:
            raise _bad_rows(bad, num_blocks, tables.shape[1])
        return out
