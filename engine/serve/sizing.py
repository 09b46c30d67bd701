"""Sizing the block pool: bytes per block, and how many blocks fit in the memory left over.

Figures for the chapter: Qwen3-8B in BF16 keeps 2 (K and V) x 36 layers x 8 kv heads x 128 dims
x 2 bytes = 147,456 bytes per token. On an 80 GB H100 at 90% utilisation, 72 GB minus 16.4 GB of
weights minus ~2 GB of activations leaves ~53 GB: ~360,000 tokens of K/V.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


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
