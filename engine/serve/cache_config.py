"""CacheConfig: the K/V pool's knobs — block size, how many blocks (or how much memory), prefix caching."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    """How the block pool is laid out and sized.

    ``num_blocks=None`` sizes the pool from memory (``ModelRunner.determine_num_blocks``):
    ``kv_cache_bytes`` on a CPU (None: sized for the model, ``sizing.default_kv_cache_bytes``),
    profiling plus ``gpu_memory_utilization`` on CUDA.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None: the model's K/V for sizing.DEFAULT_KV_CACHE_TOKENS tokens (capped)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        optional = tuple(n for n in ("num_blocks", "kv_cache_bytes") if getattr(self, n) is not None)
        for name in ("block_size",) + optional:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
