"""Prefill attention on the CPU as matrix multiplies: one request's rows against its context at once.

``CPUBackend``'s C++ kernel attends one query row at a time: a request with t rows reads its
context t times and every score is a dot product of its own. A prefill chunk is better served
as what it is, a [t, keys] matrix product (twice: scores, then values). PyTorch's CPU flash
attention does exactly that, blocked, with its softmax kept online: measured on a Sapphire
Rapids core, ~120 GFLOP/s in float32 on one thread, against ~17 for the row kernel. Its bfloat16
form would run on the matrix units (AMX, ~340-400 GFLOP/s) but rounds the softmax weights to
bfloat16 before the value product; this engine computes attention in float32 with one rounding
at the output (engine/precision.py), so a bfloat16 request's context is widened to float32 for it.

``attend_requests`` serves requests of one shape (rows, cached prefix) together: their contexts'
blocks are gathered ONCE (one ``index_select`` per pool, not one per query tile), viewed
heads-first without a copy, and met by all their rows in one call (the call's fixed cost, ~50 us,
is most of a 64-row request's time). The mask stays exact, and is made only where needed:

- no window, no cached prefix (a fresh prompt): one call, causal (row i sees keys 0..i);
- no window, a cached prefix of c keys: the prefix (seen by every row, no mask) and the chunk's
  own keys (causal from c on) are two calls, joined through their log-sum-exps
  (``o = (e^lA oA + e^lB oB) / (e^lA + e^lB)``): exactly the softmax over all keys;
- a sliding window w: the keys from the first row's window on, with an additive mask
  (0 visible / -inf hidden) of row i seeing p when c + i - w < p <= c + i.

``attend_packed("blocked", ...)`` is the other matrix path: ``cpu_prefill_kernel.cpp``, tiles of 32 query rows
(every query head of a kv head's group) against chunks of keys packed once per tile, scores and
values as register-blocked products with an online softmax, all of a step's requests in one
call, no Python per request; float32 K is transposed by AVX-512 gathers. Heads of a multiple of
16 up to 256 (``blocked_serves``).

``attend_packed("amx", ...)`` is the third, for bfloat16 pools on a CPU with AMX (Sapphire Rapids
and later): ``cpu_prefill_amx.cpp`` packs each (request, kv head)'s keys and values once into the
matrix units' pair layout and runs both products as tile multiplies, the softmax online in
AVX-512 floats. Its bf16 products are exact and summed in float; the softmax weights enter the
value product as two bf16 parts (hi + lo, ~16 bits), so no weight is rounded to bf16 on its own
and the one rounding is still the output's. Heads of a multiple of 32 up to 256, at most 16 query
heads per kv head (``amx_serves``). Its speed against the others: ``python -m course.tuning.levers
prefill-attention --dtype bfloat16`` (docs/performance.md).

Which path a request takes is measured (``choose``) and depends on its row count: a request with
few rows over a long context gains little from a matrix product and pays its fixed cost. The
probe times each path that serves the shape on seeded random pools of the model's attention shape at ``PROBE_ROWS``
rows (a step of fresh prompts of that length, 512 rows in all, so that serving a step's requests
together counts; fastest of ``PROBE_ROUNDS`` interleaved rounds); at each
count the fastest wins (a matrix path by ``MARGIN`` over the kernel), and the choice is a few
steps, "blocked from 8 rows, sdpa from 128 rows" (``PrefillChoice.steps``; none: the kernel for
every row). Cached per (dtype, heads, head size, block size, threads) for the process; the probe
takes about half a second at Qwen3-0.6B's shape, once, in the first prefill (a benchmark's
warm-up request).
``ENGINE_ATTENTION_PREFILL=kernel|sdpa|blocked|amx`` (or ``CPUBackend(prefill=...)``) forces a path
for every request of two or more rows (``amx`` where it does not serve the dtype, shape or CPU:
``blocked``; ``blocked`` where it does not serve the head size: ``sdpa``), so tests run each on any
machine. ``chosen_report`` lists the choices, as ``run.py
bench`` prints.
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.fast import probe
from engine.fast.cpu_build import OptionalKernels

PATHS = ("kernel", "sdpa", "blocked", "amx")  # the C++ row kernel / PyTorch's CPU flash attention / cpu_prefill_kernel.cpp / cpu_prefill_amx.cpp
PACKED_PATHS = ("blocked", "amx")  # the C++ matrix kernels: all of a step's requests in one call
ENV = "ENGINE_ATTENTION_PREFILL"
PROBE_ROWS = (8, 32, 128, 512)  # the row counts each path is timed at (a step of 512 rows of prompts that long)
PROBE_ROUNDS = 3  # timed rounds after a warm-up; the fastest counts (other processes only ever add time)
MARGIN = 0.05  # the matrix path must be this much faster at a row count to take it
FORCED_MIN_ROWS = 2  # a forced matrix path: every request with more than one row
BLOCKED_SOURCE = Path(__file__).with_name("cpu_prefill_kernel.cpp")
AMX_SOURCE = Path(__file__).with_name("cpu_prefill_amx.cpp")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}

# PyTorch's flash attention rounds its softmax weights to bfloat16 before the value product on
# bfloat16 inputs; the chapter's rule (engine/precision.py) computes attention in float32 and rounds
# once, so generate()'s greedy tokens hold on every path: bfloat16 requests run on float32 copies.
WORK_DTYPE = {torch.bfloat16: torch.float32}
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp); GQA-aware


@dataclass(frozen=True)
class PrefillChoice:
    """Which path a request of several rows takes: ``steps`` ((min_rows, path), ...) in rising
    min_rows; a request of t rows takes the path of the last step with min_rows <= t, the row
    kernel below the first. ``ms[path]``: its ms at each of ``PROBE_ROWS`` (empty when forced)."""

    steps: tuple[tuple[int, str], ...]
    ms: dict[str, tuple[float, ...]]
    forced: bool = False

    def path_for(self, rows: int) -> str:
        path = "kernel"
        for min_rows, step_path in self.steps:
            if rows >= min_rows:
                path = step_path
        return path

    @property
    def path(self) -> str:
        """The path of the longest requests."""
        return self.steps[-1][1] if self.steps else "kernel"

    @property
    def min_rows(self) -> int:
        """The fewest rows a request takes a matrix path with (0: none does)."""
        return next((r for r, p in self.steps if p != "kernel"), 0)

    def describe(self) -> str:
        what = ", ".join(f"{p} from {r} rows" for r, p in self.steps) or "kernel"
        if not self.ms:
            return what + (" (forced)" if self.forced else "")
        times = "; ".join(f"{name} " + "/".join(f"{t:.2f}" for t in ms) for name, ms in self.ms.items())
        return f"{what} (ms at {'/'.join(map(str, PROBE_ROWS))} rows: {times})"


_chosen: dict[tuple, PrefillChoice] = {}  # measured, per shape, for the process
_made: dict[tuple, PrefillChoice] = {}  # every choice made (measured or forced), for chosen_report


def forced_path(path: str | None) -> str | None:
    """The path asked for (``path``, else ``$ENGINE_ATTENTION_PREFILL``); None: measure."""
    return probe.forced_name(path, ENV, PATHS, "attention prefill path")


def attend_requests(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                    context: int, scale: float, window: int = 0) -> torch.Tensor:
    """B requests of the same shape, t rows each, the last t positions of ``context`` + t keys:
    q [B, t, Hq, D] -> [B, t, Hq, D] in q's dtype. ``blocks``: [B, >= ceil((context + t) / bs)]
    their block tables; pools [blocks, bs, Hkv, D]. Query head j reads kv head j // (Hq / Hkv)."""
    b, t, hq, d = q.shape
    bs = k_pool.shape[1]
    total = context + t
    first = max(0, context - window + 1) if window > 0 else 0  # the first key any row sees
    b0, b1 = first // bs, (total - 1) // bs + 1
    ids = blocks[:, b0:b1].reshape(-1)  # [B * nb]
    lo, hi = first - b0 * bs, total - b0 * bs

    work = WORK_DTYPE.get(q.dtype, q.dtype)  # bfloat16 is computed in float32: one rounding, at the output

    def heads_first(pool: torch.Tensor) -> torch.Tensor:  # [B, Hkv, keys, D], a strided view of the gather
        return pool.index_select(0, ids).view(b, (b1 - b0) * bs, *pool.shape[2:])[:, lo:hi].transpose(1, 2).to(work)

    k, v = heads_first(k_pool), heads_first(v_pool)
    q4 = q.transpose(1, 2).to(work)  # [B, Hq, t, D]
    if window > 0:
        q_pos = torch.arange(context, total)[:, None]  # [t, 1]
        k_pos = torch.arange(first, total)[None, :]  # [1, keys]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - window)
        mask = torch.zeros(hidden.shape, dtype=work).masked_fill_(hidden, float("-inf"))
        o = _flash(q4, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]
    elif context == 0:
        o = _flash(q4, k, v, 0.0, True, scale=scale)[0]
    else:  # the cached prefix (no mask) and the chunk's own keys (causal), joined by their log-sum-exps
        o_pre, l_pre = _flash(q4, k[:, :, :context], v[:, :, :context], 0.0, False, scale=scale)
        o_own, l_own = _flash(q4, k[:, :, context:], v[:, :, context:], 0.0, True, scale=scale)
        top = torch.maximum(l_pre, l_own)
        w_pre, w_own = (l_pre - top).exp_(), (l_own - top).exp_()  # [B, Hq, t]
        o = (o_pre * w_pre[..., None] + o_own * w_own[..., None]).div_((w_pre + w_own)[..., None])
    return o.transpose(1, 2).to(q.dtype)  # [B, t, Hq, D]


# The C++ matrix kernels' one signature: (q, k, v, out, tables, table stride, row0, rows, context,
# requests, Hq, Hkv, D, block size, scale, window, threads) -> status (0: computed; else nothing was).
PACKED_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 \
    + [ctypes.c_double, ctypes.c_int64, ctypes.c_int64]


def _declare(lib: ctypes.CDLL) -> None:
    for name in DTYPE_NAMES.values():
        fn = getattr(lib, f"prefill_blocked_{name}")
        fn.restype = ctypes.c_int64  # -1: this head size is not served (nothing computed)
        fn.argtypes = PACKED_ARGTYPES


_blocked = OptionalKernels(BLOCKED_SOURCE, _declare)  # cpu_prefill_kernel.cpp, built on first use


def blocked_library() -> ctypes.CDLL | None:
    """The blocked prefill kernel, or None where it cannot be built here."""
    return _blocked.get()


def blocked_serves(dtype: torch.dtype, d: int) -> bool:
    """Whether the blocked kernel serves heads of size ``d`` in ``dtype`` here: a multiple of 16
    (its vectors' lanes at any width it is built for; 1, 2, 4, 8 or 16 vectors), and it builds."""
    return dtype in DTYPE_NAMES and d % 16 == 0 and d <= 256 and blocked_library() is not None


def _declare_amx(lib: ctypes.CDLL) -> None:
    lib.prefill_amx_bfloat16.restype = ctypes.c_int64  # 0; -1 not served here; -2 tiles refused (nothing computed)
    lib.prefill_amx_bfloat16.argtypes = PACKED_ARGTYPES
    lib.prefill_amx_available.restype = ctypes.c_int64
    lib.prefill_amx_available.argtypes = []
    lib.prefill_amx_tile_config.restype = ctypes.c_int64  # the calling thread's 64-byte tile setup (tests)
    lib.prefill_amx_tile_config.argtypes = [ctypes.c_void_p]


_amx = OptionalKernels(AMX_SOURCE, _declare_amx)  # cpu_prefill_amx.cpp, built on first use
_amx_usable: list[bool] = []  # [whether a first call ran], once per process


def amx_library() -> ctypes.CDLL | None:
    """The AMX prefill kernel where it runs here: built for a CPU with AMX-BF16 and granted the
    tile state by the OS (tried once, on one row); else None."""
    lib = _amx.get()
    if lib is None or not lib.prefill_amx_available():
        return None
    if not _amx_usable:
        pool = torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)  # one key of one head of 32
        q, out = torch.zeros(1, 1, 32, dtype=torch.bfloat16), torch.empty(1, 1, 32, dtype=torch.bfloat16)
        table, zero, one = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
        status = lib.prefill_amx_bfloat16(q.data_ptr(), pool.data_ptr(), pool.data_ptr(), out.data_ptr(), table.data_ptr(),
                                          1, zero.data_ptr(), one.data_ptr(), zero.data_ptr(), 1, 1, 1, 32, 1, 1.0, 0, 1)
        _amx_usable.append(status == 0)
    return lib if _amx_usable[0] else None


def amx_serves(dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Whether the AMX kernel serves this attention shape here: bfloat16 pools, heads of a multiple
    of 32 up to 256, at most 16 query heads per kv head, on a CPU (and OS) that runs AMX tiles."""
    return (dtype == torch.bfloat16 and d % 32 == 0 and d <= 256 and hkv > 0 and hq % hkv == 0
            and hq // hkv <= 16 and amx_library() is not None)


def serves(path: str, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Whether ``path`` can serve this shape here (the row kernel and sdpa serve every one)."""
    if path == "blocked":
        return blocked_serves(dtype, d)
    if path == "amx":
        return amx_serves(dtype, hq, hkv, d)
    return True


def attend_packed(path: str, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                  row0: torch.Tensor, rows: torch.Tensor, context: torch.Tensor, scale: float, window: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Requests r (``row0[r]``, ``rows[r]`` rows after ``context[r]`` cached keys, block table
    ``tables[r]`` int32) through the C++ matrix kernel ``path`` ("blocked": cpu_prefill_kernel.cpp,
    "amx": cpu_prefill_amx.cpp) in one call, written into ``out`` [N, Hq, D] at their rows (others
    untouched); q [N, Hq, D] and pools contiguous, of one dtype."""
    n, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    assert q.is_contiguous() and out.is_contiguous() and k_pool.is_contiguous() \
        and v_pool.is_contiguous() and tables.dtype == torch.int32 and tables.stride(1) == 1
    if path == "amx":
        lib = amx_library()
        assert lib is not None and q.dtype == torch.bfloat16
        fn = lib.prefill_amx_bfloat16
    else:
        lib = blocked_library()
        assert lib is not None
        fn = getattr(lib, f"prefill_blocked_{DTYPE_NAMES[q.dtype]}")
    threads = max(1, min(torch.get_num_threads(), int(rows.shape[0]) * hkv))
    status = fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), tables.data_ptr(), tables.stride(0),
                row0.data_ptr(), rows.data_ptr(), context.data_ptr(), rows.shape[0], hq, hkv, d, bs, float(scale),
                int(window), threads)
    if status:
        raise ValueError(f"the {path} prefill kernel does not serve {hq} query / {hkv} kv heads of {d} here "
                         f"(status {status}); force another path with {ENV}")
    return out


def measure(kernel: Callable[[torch.Tensor, tuple, torch.Tensor, int], torch.Tensor], dtype: torch.dtype,
            hq: int, hkv: int, d: int, bs: int) -> dict[str, tuple[float, ...]]:
    """Ms of each path at each of ``PROBE_ROWS`` (the fastest of ``PROBE_ROUNDS`` interleaved
    rounds), on a seeded random pool of the shape: a step of ``max(PROBE_ROWS)`` rows made of fresh
    prompts of that many rows each (one of 512 rows, or 64 of 8), so that what a path saves by
    serving a step's requests together counts as it does in the engine.
    ``kernel(q, (k_pool, v_pool), tables int32 [N, W], q_pos int64 [N])`` runs the row kernel."""
    gen = torch.Generator().manual_seed(0)
    most = max(PROBE_ROWS)
    out: dict[str, list[float]] = {p: [] for p in PATHS}
    packed = [p for p in PACKED_PATHS if serves(p, dtype, hq, hkv, d)]
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            reqs, width = max(1, most // rows), -(-rows // bs)
            shape = (reqs * width + 1, bs, hkv, d)
            k_pool, v_pool = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
            blocks = torch.randperm(reqs * width + 1, generator=gen)[:reqs * width].view(reqs, width)  # scattered
            tables = blocks.to(torch.int32)  # [R, W]
            row_tables = tables.repeat_interleave(rows, 0)  # [R * rows, W]
            q_pos = torch.arange(rows).repeat(reqs)
            q = torch.randn(reqs * rows, hq, d, generator=gen).to(dtype)
            plan = (torch.arange(reqs) * rows, torch.full((reqs,), rows), torch.zeros(reqs, dtype=torch.int64))
            fns = {"kernel": lambda: kernel(q, (k_pool, v_pool), row_tables, q_pos),
                   "sdpa": lambda: attend_requests(q.view(reqs, rows, hq, d), k_pool, v_pool, blocks, 0, d ** -0.5)}
            for name in packed:
                fns[name] = lambda name=name: attend_packed(name, q, k_pool, v_pool, tables, *plan, d ** -0.5, 0,
                                                            torch.empty_like(q))
            times: dict[str, list[float]] = {p: [] for p in fns}
            for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms up
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    if round_:
                        times[name].append((time.perf_counter() - start) * 1000)
            for name in times:
                out[name].append(min(times[name]))
    return {name: tuple(ms) for name, ms in out.items() if ms}


def decide(ms: dict[str, tuple[float, ...]]) -> tuple[tuple[int, str], ...]:
    """The steps of a measured choice: at each of ``PROBE_ROWS`` the fastest path, where a matrix
    path must be ``MARGIN`` faster than the kernel to be taken; a path that does not win at every
    larger count as well is not taken from there (a request's path changes once, at most twice,
    with its length, not back and forth on noise)."""
    winners = []
    for i in range(len(PROBE_ROWS)):
        kern = ms["kernel"][i]
        best = min((p for p in ms if p != "kernel"), key=lambda p: ms[p][i], default=None)
        winners.append(best if best is not None and ms[best][i] < (1 - MARGIN) * kern else "kernel")
    # From the longest down: a matrix path keeps a row count only if no row count above it fell to the kernel.
    for i in range(len(winners) - 2, -1, -1):
        if winners[i + 1] == "kernel":
            winners[i] = "kernel"
    steps: list[tuple[int, str]] = []
    for rows, path in zip(PROBE_ROWS, winners):
        if path != "kernel" and (not steps or steps[-1][1] != path):  # kernel steps can only lead: implied
            steps.append((rows, path))
    return tuple(steps)


def choose(kernel: Callable, dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int,
           path: str | None = None) -> PrefillChoice:
    """Which requests take the matrix path for this attention shape: forced (``path`` or
    ``$ENGINE_ATTENTION_PREFILL``), else measured once per shape and thread count."""
    forced = forced_path(path)
    if forced == "amx" and not amx_serves(dtype, hq, hkv, d):
        forced = "blocked"  # no AMX here, or not this dtype / shape: the next matrix kernel
    if forced == "blocked" and not blocked_serves(dtype, d):
        forced = "sdpa"  # the blocked kernel cannot serve this head size or cannot be built here
    steps = None if forced is None else () if forced == "kernel" else ((FORCED_MIN_ROWS, forced),)

    def measured() -> PrefillChoice:
        ms = measure(kernel, dtype, hq, hkv, d, bs)
        return PrefillChoice(decide(ms), ms)

    return probe.remembered(_chosen, _made, probe.attention_key(dtype, hq, hkv, d, bs),
                            None if steps is None else PrefillChoice(steps, {}, forced=True), measured)


def chosen_report() -> list[str]:
    """One line per (dtype, attention shape, threads) this process chose a prefill path for."""
    return [probe.shape_line(choice.describe().replace(" (forced)", ""), key, bool(choice.ms))
            for key, choice in _made.items()]


def flops(rows: int, context: int, hq: int, d: int) -> float:
    """Multiply-adds x 2 of one request's attention (scores and values), causal: for the report."""
    keys = rows * context + rows * (rows + 1) / 2
    return 4.0 * hq * d * keys

