"""Sizing the block pool: bytes per block, and how many blocks fit in the memory left over.

Figures for the chapter: Qwen3-8B in BF16 keeps 2 (K and V) x 36 layers x 8 kv heads x 128 dims
x 2 bytes = 147,456 bytes per token. On an 80 GB H100 at 90% utilisation, 72 GB minus 16.4 GB of
weights minus ~2 GB of activations leaves ~53 GB: ~360,000 tokens of K/V.

A pool given in bytes (``kv_cache_bytes``, vLLM's ``kv_cache_memory_bytes``) gets that many on any
device. On a CPU it is otherwise sized for the model: ``DEFAULT_KV_CACHE_TOKENS`` tokens of ITS K/V
(Qwen3-0.6B in float32 keeps 2 x 28 x 8 x 128 x 4 = 229,376 bytes a token: 16,384 tokens are
3.5 GiB), capped at ``DEFAULT_KV_CACHE_SHARE`` of the machine's physical memory. The engine prints
what it got.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

# The CPU pool when kv_cache_bytes is not given: this many tokens of the model's own K/V (the bench's
# small model in float32: 128 MiB, enough that no bench workload preempts) ...
DEFAULT_KV_CACHE_TOKENS = 16_384
# ... but at most this share of the machine's physical memory (not of what is free now, which on a
# shared machine changes from one run to the next).
DEFAULT_KV_CACHE_SHARE = 0.10
_announced: set[str] = set()  # pool descriptions already printed by this process


def kv_bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, pools: int = 2) -> int:
    """Bytes one block occupies across every layer: pools (K and V) x layers x block_size x
    kv_heads x head_dim x bytes per element."""
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("pools", pools)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    bytes_per_vector = kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()  # one token, one layer, one pool
    return bytes_per_vector * block_size * layers * pools


def num_blocks_for_memory(free_bytes: int, layers: int, kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype, pools: int = 2) -> int:
    """How many whole blocks fit in ``free_bytes`` (ValueError if not even one does)."""
    per_block = kv_bytes_per_block(layers, kv_heads, head_dim, block_size, dtype, pools)
    blocks = int(free_bytes) // per_block
    if blocks < 1:
        raise ValueError(
            f"{free_bytes} bytes hold no block of {per_block} bytes; give the KV cache more memory "
            "(kv_cache_bytes / gpu_memory_utilization) or use a smaller block_size")
    return blocks


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def default_kv_cache_bytes(bytes_per_token: int, total_memory: int | None = None) -> int:
    """The CPU pool's bytes when none are given: ``DEFAULT_KV_CACHE_TOKENS`` tokens of
    ``bytes_per_token`` (the model's K/V for one token, every layer), capped at
    ``DEFAULT_KV_CACHE_SHARE`` of ``total_memory`` (default: this machine's)."""
    want = DEFAULT_KV_CACHE_TOKENS * bytes_per_token
    total = physical_memory() if total_memory is None else total_memory
    return want if total is None else min(want, int(total * DEFAULT_KV_CACHE_SHARE))


def cpu_num_blocks(kv_cache_bytes: int | None, layers: int, kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, total_memory: int | None = None, announce: bool = True) -> int:
    """Blocks of a pool given in bytes: ``kv_cache_bytes`` over the bytes per block (any device),
    or with None the CPU's model-sized default (``default_kv_cache_bytes``). With ``announce``, the resulting capacity is
    printed on stderr (once per distinct pool in a process)."""
    per_block = kv_bytes_per_block(layers, kv_heads, head_dim, block_size, dtype)
    nbytes = kv_cache_bytes
    if nbytes is None:
        nbytes = default_kv_cache_bytes(per_block // block_size, total_memory)
    blocks = num_blocks_for_memory(nbytes, layers, kv_heads, head_dim, block_size, dtype)
    if announce:
        how = (f"kv_cache_bytes={kv_cache_bytes:,}" if kv_cache_bytes is not None else
               f"the default: {DEFAULT_KV_CACHE_TOKENS:,} tokens at most, and at most "
               f"{DEFAULT_KV_CACHE_SHARE:.0%} of physical memory; set kv_cache_bytes or num_blocks to choose")
        line = (f"KV cache: {blocks * block_size:,} tokens ({blocks:,} blocks of {block_size}, "
                f"{blocks * per_block / 2**20:,.0f} MiB at {per_block // block_size:,} bytes per token; {how})")
        if line not in _announced:
            _announced.add(line)
            print(line, file=sys.stderr, flush=True)
    return blocks


def profile_num_blocks(run_max_step: Callable[[], None], bytes_per_block: int,
                       gpu_memory_utilization: float, device: torch.device | str = "cuda",
                       mem_info: Callable[[], tuple[int, int]] | None = None,
                       peak_bytes: Callable[[], int] | None = None) -> int:
    """Blocks for the pool on a CUDA device, measured rather than guessed.

    ``run_max_step`` runs one step of the largest size the engine will schedule
    (``ModelRunner.profile_run``, against a pool just big enough for it). Afterwards the peak allocated memory is what weights plus activations
    need; the pool gets the rest of ``total * gpu_memory_utilization``. ``mem_info`` (returns
    (free, total)) and ``peak_bytes`` default to torch.cuda's counters; tests pass fakes.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if mem_info is None or peak_bytes is None:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        mem_info = mem_info or (lambda: torch.cuda.mem_get_info(device))
        peak_bytes = peak_bytes or (lambda: torch.cuda.max_memory_allocated(device))
    run_max_step()
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    total = mem_info()[1]
    peak = int(peak_bytes())  # weights + the largest step's activations
    allowed = int(total * gpu_memory_utilization)  # what the whole engine may occupy
    num_blocks = (allowed - peak) // bytes_per_block if allowed > peak else 0
    if num_blocks == 0:
        raise ValueError(
            f"after the model's peak of {peak} bytes, {gpu_memory_utilization:.0%} of "
            f"{total} bytes leaves no room for one {bytes_per_block}-byte KV block; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or use a smaller model")
    return num_blocks
