"""Which build of the paged attention kernel serves the rows: measured per attention shape.

``cpu_paged_kernel.cpp`` is built three times from one source (``cpu_attn_vec.h``): ``native``, at
the widest vectors ``-march=native`` targets (AVX-512's 16 floats; a bfloat16 row's keys widened
in registers, two instructions per 32 values, for float FMAs), ``dpbf16``, the same but with a
bfloat16 row's scores as AVX512-BF16 dot products (vdpbf16ps on q's and k's own bits) where the
CPU has them, and ``avx2``, held to 32-byte vectors without bf16 dot products (what a CPU without
AVX-512 runs anyway; there the builds are the same code). Wider is not always faster: some CPUs
lower their clock under 512-bit work, and a decode row is mostly the trip of its K/V from memory;
nor is one dot-product instruction: on the Sapphire Rapids-class Xeon of issue 40 vdpbf16ps ran
about 1 per 3.5 cycles against 2 FMAs per cycle. So the probe times the candidates (``dpbf16``
only for bfloat16 rows, the one dtype it changes) on a seeded decode batch of the model's
attention shape (``PROBE_REQUESTS`` rows over ``PROBE_CONTEXT`` keys each, fastest of
``PROBE_ROUNDS`` interleaved rounds) and keeps ``native`` unless another is ``MARGIN`` faster (the
fastest such). Cached per (dtype, heads, head size, block size, threads) for the process;
``ENGINE_ATTENTION_DECODE=native|dpbf16|avx2`` (or ``CPUBackend(decode=...)``) forces a build, so
tests run each on any machine. ``chosen_report`` lists the choices, as ``run.py bench`` prints.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.fast import probe

VARIANTS = ("native", "dpbf16", "avx2")
ENV = "ENGINE_ATTENTION_DECODE"
PROBE_REQUESTS = 16
PROBE_CONTEXT = 256
PROBE_ROUNDS = 3
MARGIN = 0.05


@dataclass(frozen=True)
class DecodeChoice:
    """The build the rows take; ``ms[variant]`` its probe time (empty when forced)."""

    variant: str
    ms: dict[str, float]
    forced: bool = False


_chosen: dict[tuple, DecodeChoice] = {}
_made: dict[tuple, DecodeChoice] = {}


def forced_variant(variant: str | None) -> str | None:
    """The build asked for (``variant``, else ``$ENGINE_ATTENTION_DECODE``); None: measure."""
    return probe.forced_name(variant, ENV, VARIANTS, "attention decode variant")


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The builds the probe times for rows of ``dtype``: ``dpbf16`` differs from ``native`` only
    for bfloat16 rows."""
    return VARIANTS if dtype == torch.bfloat16 else tuple(v for v in VARIANTS if v != "dpbf16")


def measure(run: Callable[[str, torch.Tensor, tuple, torch.Tensor, torch.Tensor], torch.Tensor],
            dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int) -> dict[str, float]:
    """Ms of each candidate build on one seeded decode batch; ``run(variant, q, (k_pool, v_pool),
    tables int32 [R, W], q_pos int64 [R])`` runs the kernel of that build."""
    gen = torch.Generator().manual_seed(0)
    width = -(-PROBE_CONTEXT // bs)
    blocks = PROBE_REQUESTS * width
    pools = tuple(torch.randn(blocks + 1, bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(PROBE_REQUESTS, width)
    q_pos = torch.full((PROBE_REQUESTS,), PROBE_CONTEXT - 1, dtype=torch.int64)
    q = torch.randn(PROBE_REQUESTS, hq, d, generator=gen).to(dtype)
    times: dict[str, list[float]] = {v: [] for v in candidates(dtype)}
    with torch.inference_mode():
        for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms up
            for variant in times:
                start = time.perf_counter()
                run(variant, q, pools, tables, q_pos)
                if round_:
                    times[variant].append((time.perf_counter() - start) * 1000)
    return {v: min(t) for v, t in times.items()}


def choose(run: Callable, dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int,
           variant: str | None = None) -> DecodeChoice:
    """The build for this attention shape: forced, else measured once per shape and thread count."""
    forced = forced_variant(variant)

    def measured() -> DecodeChoice:
        ms = measure(run, dtype, hq, hkv, d, bs)
        faster = [v for v in ms if ms[v] < (1 - MARGIN) * ms["native"]]
        return DecodeChoice(min(faster, key=ms.__getitem__) if faster else "native", ms)

    return probe.remembered(_chosen, _made, probe.attention_key(dtype, hq, hkv, d, bs),
                            None if forced is None else DecodeChoice(forced, {}, forced=True), measured)


def chosen_report() -> list[str]:
    """One line per (dtype, attention shape, threads) this process chose a kernel build for."""
    return [probe.shape_line(choice.variant + (" (ms per probe batch: " + "; ".join(
        f"{v} {t:.3f}" for v, t in choice.ms.items()) + ")" if choice.ms else ""), key, bool(choice.ms))
        for key, choice in _made.items()]
