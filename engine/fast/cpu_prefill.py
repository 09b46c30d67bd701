"""Prefill attention on the CPU as matrix multiplies: one request's rows against its context at once.

``CPUBackend``'s C++ kernel attends one query row at a time: a request with t rows reads its
context t times and every score is a dot product of its own. A prefill chunk is better served
as what it is, a [t, keys] matrix product (twice: scores, then values). PyTorch's CPU flash
attention does exactly that, blocked, with its softmax kept online, and on a CPU with bf16
matrix units (AMX) its bfloat16 products run on them (oneDNN's brgemm micro-kernels): measured
on the issue's Sapphire Rapids, ~340-400 GFLOP/s in bfloat16 and ~120 in float32 on one
thread, against ~17 for the row kernel.

``attend_requests`` serves requests of one shape (rows, cached prefix) together: their contexts'
blocks are gathered ONCE (one ``index_select`` per pool, not one per query tile), viewed
heads-first without a copy, and met by all their rows in one call (the call's fixed cost, ~50 us,
is most of a 64-row request's time). The mask stays exact without materialising it where it is not needed:

- no window, no cached prefix (a fresh prompt): one call, causal (row i sees keys 0..i);
- no window, a cached prefix of c keys: the prefix (seen by every row, no mask) and the chunk's
  own keys (causal from c on) are two calls, joined through their log-sum-exps
  (``o = (e^lA oA + e^lB oB) / (e^lA + e^lB)``): exactly the softmax over all keys;
- a sliding window w: the keys from the first row's window on, with an additive mask
  (0 visible / -inf hidden) of row i seeing p when c + i - w < p <= c + i.

Which rows take this path rather than the row kernel is measured (``choose``): a request with
few rows over a long context gains little from a matrix product and pays the calls' fixed cost.
The probe times both on seeded random pools of the model's attention shape at ``PROBE_ROWS``
rows (fresh prompts of that length, fastest of ``PROBE_ROUNDS`` interleaved rounds) and keeps the
smallest row count from which the matrix path wins at that count and every larger one
(``min_rows``); it never wins: ``kernel`` for every row. Cached per (dtype, heads, head size,
block size, threads) for the process. ``ENGINE_ATTENTION_PREFILL=kernel|sdpa`` (or
``CPUBackend(prefill=...)``) forces a path (``sdpa``: every request of two or more rows), so
tests run both on any machine. ``chosen_report`` lists the choices, as ``run.py bench`` prints.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PATHS = ("kernel", "sdpa")  # the C++ row kernel / PyTorch's CPU flash attention over the gathered context
ENV = "ENGINE_ATTENTION_PREFILL"
PROBE_ROWS = (8, 32, 128, 512)  # a request's row count (its whole context: a fresh prompt) at which both are timed
PROBE_ROUNDS = 3  # timed rounds after a warm-up; the fastest counts (other processes only ever add time)
MARGIN = 0.05  # the matrix path must be this much faster at a row count to take it
FORCED_MIN_ROWS = 2  # a forced ``sdpa``: every request with more than one row

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp); GQA-aware


@dataclass(frozen=True)
class PrefillChoice:
    """Which requests take the matrix path: those with at least ``min_rows`` rows (0: none, every
    row takes the kernel). ``ms[path]``: its ms at each of ``PROBE_ROWS`` (empty when forced)."""

    min_rows: int
    ms: dict[str, tuple[float, ...]]
    forced: bool = False

    @property
    def path(self) -> str:
        return "sdpa" if self.min_rows else "kernel"

    def describe(self) -> str:
        what = f"sdpa from {self.min_rows} rows" if self.min_rows else "kernel"
        if not self.ms:
            return what + (" (forced)" if self.forced else "")
        times = "; ".join(f"{name} " + "/".join(f"{t:.2f}" for t in ms) for name, ms in self.ms.items())
        return f"{what} (ms at {'/'.join(map(str, PROBE_ROWS))} rows: {times})"


_chosen: dict[tuple, PrefillChoice] = {}  # measured, per shape, for the process
_made: dict[tuple, PrefillChoice] = {}  # every choice made (measured or forced), for chosen_report


def forced_path(path: str | None) -> str | None:
    """The path asked for (``path``, else ``$ENGINE_ATTENTION_PREFILL``); None: measure."""
    asked = path if path is not None else os.environ.get(ENV) or None
    if asked in (None, "auto"):
        return None
    if asked not in PATHS:
        where = "" if path is not None else f" (from ${ENV})"
        raise ValueError(f"attention prefill path{where} must be one of {', '.join(PATHS)} or 'auto', not {asked!r}")
    return asked


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

    def heads_first(pool: torch.Tensor) -> torch.Tensor:  # [B, Hkv, keys, D], a strided view of the gather
        return pool.index_select(0, ids).view(b, (b1 - b0) * bs, *pool.shape[2:])[:, lo:hi].transpose(1, 2)

    k, v = heads_first(k_pool), heads_first(v_pool)
    q4 = q.transpose(1, 2)  # [B, Hq, t, D]
    if window > 0:
        q_pos = torch.arange(context, total)[:, None]  # [t, 1]
        k_pos = torch.arange(first, total)[None, :]  # [1, keys]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - window)
        mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
        o = _flash(q4, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]
    elif context == 0:
        o = _flash(q4, k, v, 0.0, True, scale=scale)[0]
    else:  # the cached prefix (no mask) and the chunk's own keys (causal), joined by their log-sum-exps
        o_pre, l_pre = _flash(q4, k[:, :, :context], v[:, :, :context], 0.0, False, scale=scale)
        o_own, l_own = _flash(q4, k[:, :, context:], v[:, :, context:], 0.0, True, scale=scale)
        work = l_pre.dtype  # float32 (float64 for float64)
        top = torch.maximum(l_pre, l_own)
        w_pre, w_own = (l_pre - top).exp_(), (l_own - top).exp_()  # [B, Hq, t]
        o = (o_pre.to(work) * w_pre[..., None] + o_own.to(work) * w_own[..., None]).div_(
            (w_pre + w_own)[..., None]).to(q.dtype)
    return o.transpose(1, 2)  # [B, t, Hq, D]


def measure(kernel: Callable[[torch.Tensor, tuple, torch.Tensor, int], torch.Tensor], dtype: torch.dtype,
            hq: int, hkv: int, d: int, bs: int) -> dict[str, tuple[float, ...]]:
    """Ms of each path at each of ``PROBE_ROWS`` (a fresh prompt of that many rows; the fastest
    of ``PROBE_ROUNDS`` interleaved rounds), on a seeded random pool of the shape.
    ``kernel(q, (k_pool, v_pool), table int32 [t, W], q_pos int64 [t])`` runs the row kernel."""
    gen = torch.Generator().manual_seed(0)
    most = max(PROBE_ROWS)
    width = -(-most // bs)
    shape = (width + 1, bs, hkv, d)
    k_pool, v_pool = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    blocks = torch.randperm(width + 1, generator=gen)[:width]  # scattered, as a pool's blocks are
    table = blocks.to(torch.int32)[None, :]
    out: dict[str, list[float]] = {p: [] for p in PATHS}
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            q = torch.randn(rows, hq, d, generator=gen).to(dtype)
            tables, q_pos = table.expand(rows, width), torch.arange(rows)
            fns = {"kernel": lambda: kernel(q, (k_pool, v_pool), tables, q_pos),
                   "sdpa": lambda: attend_requests(q[None], k_pool, v_pool, blocks[None], 0, d ** -0.5)}
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms up
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    if round_:
                        times[name].append((time.perf_counter() - start) * 1000)
            for name in PATHS:
                out[name].append(min(times[name]))
    return {name: tuple(ms) for name, ms in out.items()}


def decide(ms: dict[str, tuple[float, ...]]) -> int:
    """The smallest of ``PROBE_ROWS`` from which sdpa is ``MARGIN`` faster at it and every larger
    count (0: it never is)."""
    min_rows = 0
    for rows, kern, mat in reversed(list(zip(PROBE_ROWS, ms["kernel"], ms["sdpa"]))):
        if mat > (1 - MARGIN) * kern:
            break
        min_rows = rows
    return min_rows


def choose(kernel: Callable, dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int,
           path: str | None = None) -> PrefillChoice:
    """Which requests take the matrix path for this attention shape: forced (``path`` or
    ``$ENGINE_ATTENTION_PREFILL``), else measured once per shape and thread count."""
    forced = forced_path(path)
    key = (dtype, hq, hkv, d, bs, torch.get_num_threads())
    if forced is not None:
        choice = PrefillChoice(FORCED_MIN_ROWS if forced == "sdpa" else 0, {}, forced=True)
    else:
        if key not in _chosen:
            ms = measure(kernel, dtype, hq, hkv, d, bs)
            _chosen[key] = PrefillChoice(decide(ms), ms)
        choice = _chosen[key]
    _made[key + (choice.forced,)] = choice
    return choice


def chosen_report() -> list[str]:
    """One line per (dtype, attention shape, threads) this process chose a prefill path for."""
    lines = []
    for (dtype, hq, hkv, d, bs, threads, _), choice in _made.items():
        how = "measured" if choice.ms else "forced"
        lines.append(f"{choice.describe().replace(' (forced)', '')} [{how}; {str(dtype).removeprefix('torch.')}, "
                     f"{hq}/{hkv} heads of {d}, blocks of {bs}, {threads} thread(s)]")
    return lines


def flops(rows: int, context: int, hq: int, d: int) -> float:
    """Multiply-adds x 2 of one request's attention (scores and values), causal: for the report."""
    keys = rows * context + rows * (rows + 1) / 2
    return 4.0 * hq * d * keys

