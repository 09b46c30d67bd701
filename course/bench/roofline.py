"""The limit a decode step runs into on this machine: a roofline estimate.

A decode step of R requests reads every weight once (each linear's matrix and the LM head, the
rows of all R requests multiplied at once) and each request's K/V so far, and does two FLOPs per
weight per row plus the attention's dot products. Whichever takes longer on this machine — the
FLOPs at its measured peak GEMM rate, or the bytes at its measured memory bandwidth — bounds the
step from below:

    roofline time = max(FLOPs / peak FLOP/s, bytes / bandwidth)

and ``roofline time / measured step`` is the fraction of the limit an engine reached (1.0: at it).
A prompt's prefill up to its first token is bounded the same way (``prefill_cost``).

Counted (dense Qwen3 decoder, one new token per request, context ``c`` tokens each, the new one
included): per layer the q/k/v, o, gate/up and down matrices, D·(Hq + 2·Hkv)·Dh + Hq·Dh·D + 3·D·I
weights; the LM head, V·D (read once a step whether tied to the embedding or not); attention, per
layer and request 2·Hq·Dh·c FLOPs for q·k and as many for p·v, and 2·Hkv·Dh·c K/V values read.
Left out, each well under 1% of a step at the presets' shapes: norm weights, RoPE, the softmax,
activations (they stay in cache at decode sizes), the embedding rows looked up, the K/V written.

The peak and the bandwidth are measured here, at the thread count in use: the peak is the fastest
of a few ``torch.nn.functional.linear`` (what the engines' linears call) and ``torch.mm`` calls of
a square GEMM in the model's dtype, and for a 16-bit model also in float32: a 16-bit value widens
to float32 exactly, so float32 FMAs on widened weights are one way to do its arithmetic, and on a
CPU without 16-bit matmul units (where PyTorch's bfloat16 GEMM is emulated, several times slower)
the fastest one (``peak_dtype`` says which set the peak); the bandwidth is the faster of a large tensor copy (bytes read + written)
and a large sum (bytes read), each the fastest of a few tries (on one thread by that thread's CPU
clock, so that other jobs on a shared machine do not lower them; ``_fastest``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepCost:
    flops: float  # FLOPs of one decode step
    weight_bytes: float  # every weight read once
    kv_bytes: float  # every request's K/V read once per layer

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def weights_per_layer(cfg) -> int:
    """Weights of one dense decoder layer's matrices: q/k/v, o, gate/up, down."""
    d, dh, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    return d * (hq + 2 * hkv) * dh + hq * dh * d + 3 * d * inter


def decode_step_cost(cfg, requests: int, context: int, weight_bytes: int, kv_bytes: int) -> StepCost:
    """FLOPs and bytes of one decode step of ``requests`` rows, each attending to ``context`` tokens.

    ``weight_bytes`` / ``kv_bytes``: bytes per weight / per K or V value (4 float32, 2 bfloat16)."""
    if getattr(cfg, "num_experts", 0):
        raise ValueError("the roofline counts dense models only (this one has MoE layers)")
    if requests < 1 or context < 1:
        raise ValueError(f"need requests >= 1 and context >= 1, got {requests} and {context}")
    layers, d, dh = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    weights = layers * weights_per_layer(cfg) + cfg.vocab_size * d
    attention_flops = layers * requests * 4 * cfg.num_attention_heads * dh * context
    kv_values = layers * requests * 2 * cfg.num_key_value_heads * dh * context
    return StepCost(flops=2.0 * weights * requests + attention_flops, weight_bytes=float(weights * weight_bytes),
                    kv_bytes=float(kv_values * kv_bytes))


def prefill_cost(cfg, tokens: int, weight_bytes: int, kv_bytes: int) -> StepCost:
    """FLOPs and bytes of one prompt's prefill up to its first token (the time-to-first-token step).

    Every prompt token goes through every layer (two FLOPs per layer weight per token), attention
    is causal (token i attends to i + 1 tokens: 2·Hq·Dh FLOPs for q·k and as many for p·v per pair),
    and the LM head runs on the last token only. Bytes: every weight read once, and the prompt's
    K/V written once (``kv_values``, ``kv_bytes`` each)."""
    if getattr(cfg, "num_experts", 0):
        raise ValueError("the roofline counts dense models only (this one has MoE layers)")
    if tokens < 1:
        raise ValueError(f"need tokens >= 1, got {tokens}")
    layers, d, dh = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    layer_weights = layers * weights_per_layer(cfg)
    pairs = tokens * (tokens + 1) // 2  # (query, key) pairs of a causal prompt
    attention_flops = layers * 4 * cfg.num_attention_heads * dh * pairs
    kv_values = layers * tokens * 2 * cfg.num_key_value_heads * dh
    return StepCost(flops=2.0 * layer_weights * tokens + 2.0 * cfg.vocab_size * d + attention_flops,
                    weight_bytes=float((layer_weights + cfg.vocab_size * d) * weight_bytes),
                    kv_bytes=float(kv_values * kv_bytes))


def _fastest(fn, tries: int) -> float:
    """The fastest of ``tries`` calls of ``fn`` (after one untimed call: allocation, kernel choice).
    On one thread the call runs on this thread alone, so it is timed by this thread's CPU clock:
    a machine shared with other jobs then cannot make the peak look lower than it is by
    descheduling us; on more threads, by the wall clock."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(tries):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


_measured: dict[tuple, dict] = {}


def machine_limits(dtype: torch.dtype = torch.float32, size: int = 1024, copy_mib: int = 256,
                   tries: int = 7) -> dict:
    """This machine's peak GEMM FLOP/s in ``dtype`` and memory bandwidth (bytes/s), at
    ``torch.get_num_threads()`` threads; measured once per (dtype, threads, sizes) in a process."""
    key = (dtype, torch.get_num_threads(), size, copy_mib, tries)
    if key not in _measured:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=g).to(dtype)
        w = torch.randn(size, size, generator=g).to(dtype)
        wt = w.t().contiguous()
        with torch.inference_mode():  # the faster of the two layouts a GEMM library takes
            gemm_s = min(_fastest(lambda: F.linear(a, w), tries), _fastest(lambda: torch.mm(a, wt), tries))
            peak_dtype = dtype
            if dtype in (torch.bfloat16, torch.float16):  # its arithmetic in float32, on exactly widened values
                a32, w32 = a.float(), w.float()
                wide_s = _fastest(lambda: F.linear(a32, w32), tries)
                if wide_s < gemm_s:
                    gemm_s, peak_dtype = wide_s, torch.float32
            n = copy_mib * 2**20 // 4
            src, dst = torch.ones(n), torch.empty(n)
            copy_s = _fastest(lambda: dst.copy_(src), tries)
            sum_s = _fastest(lambda: src.sum(), tries)
            del src, dst
        _measured[key] = {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                          "peak_flops": 2.0 * size ** 3 / gemm_s, "peak_dtype": str(peak_dtype).removeprefix("torch."),
                          "copy_bandwidth": 2.0 * n * 4 / copy_s, "read_bandwidth": n * 4 / sum_s,
                          "bandwidth": max(2.0 * n * 4 / copy_s, n * 4 / sum_s)}
    return dict(_measured[key])


def roofline(cost: StepCost, limits: dict, step_ms: float | None = None) -> dict:
    """The roofline time of a step of ``cost`` under ``limits`` (``machine_limits``), which bound
    decides it, and (given the measured ``step_ms``) the fraction of the limit reached."""
    compute_ms = cost.flops / limits["peak_flops"] * 1000
    memory_ms = cost.bytes / limits["bandwidth"] * 1000
    out = {**asdict(cost), "compute_ms": round(compute_ms, 3), "memory_ms": round(memory_ms, 3),
           "roofline_ms": round(max(compute_ms, memory_ms), 3),
           "bound": "compute" if compute_ms >= memory_ms else "memory"}
    if step_ms:
        out["fraction"] = round(max(compute_ms, memory_ms) / step_ms, 3)
    return out


def describe(limits: dict) -> str:
    """One line: the measured peak and bandwidth."""
    arithmetic = limits["dtype"] if limits.get("peak_dtype", limits["dtype"]) == limits["dtype"] else \
        f"{limits['dtype']} values, {limits['peak_dtype']} arithmetic"
    return (f"peak GEMM {limits['peak_flops'] / 1e9:.1f} GFLOP/s ({arithmetic}, {limits['threads']} thread(s)), "
            f"memory bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s (copy {limits['copy_bandwidth'] / 1e9:.1f}, "
            f"read {limits['read_bandwidth'] / 1e9:.1f})")
