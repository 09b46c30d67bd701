"""ModelRunner: owns the K/V pools (and sizes them), turns a schedule into a Batch, and runs the model once."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.batch import Batch, build_batch
from engine.serve.config import CacheConfig
from engine.serve.flat import FlatModel
from engine.serve.params import SamplingParams
from engine.serve.request import Request
from engine.serve.sizing import cpu_num_blocks, kv_bytes_per_block, profile_num_blocks


class ModelRunner:
    """The device side of the engine.

    Holds one (K, V) pool per layer, each ``[num_blocks + 1, block_size, Hkv, D]`` (the +1 is the
    scratch block padding rows write to), and the host copies of swapped-out requests' K/V.
    ``ModelRunner(flat, backend, num_blocks, block_size)`` allocates the pools at once;
    ``ModelRunner.with_pool(flat, backend, cache, max_num_tokens)`` (the engine's one way) sizes
    them from the configuration first. With ``num_blocks=None`` there is no pool until
    ``initialize_kv_cache``. Invariant: ``swapped`` holds an entry exactly for requests that are
    swapped out and not finished.
    """

    def __init__(self, flat: FlatModel, backend: AttentionBackend, num_blocks: int | None, block_size: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.flat = flat
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device) if device is not None else flat.device
        self.dtype = dtype or flat.dtype
        self.kv_spec = flat.kv_spec()  # (layers, kv_heads, head_dim): what one token keeps
        self.num_blocks: int | None = None
        self.kv_caches: list[KVCache] = []
        self.swapped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        if num_blocks is not None:
            self.initialize_kv_cache(num_blocks)

    @classmethod
    def with_pool(cls, flat: FlatModel, backend: AttentionBackend, cache: CacheConfig,
                  max_num_tokens: int) -> ModelRunner:
        """A runner and its pool, sized once: ``cache.num_blocks`` if given, else what
        ``determine_num_blocks`` finds room for (measured by a profiling run on CUDA)."""
        runner = cls(flat, backend, None, cache.block_size)
        runner.initialize_kv_cache(cache.num_blocks or runner.determine_num_blocks(cache, max_num_tokens))
        return runner

    # ----- the pool ----------------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's (K, V) pool for ``num_blocks`` blocks (plus the scratch block)."""
        layers, kv_heads, head_dim = self.kv_spec
        shape = (num_blocks + 1, self.block_size, kv_heads, head_dim)
        self.kv_caches = [self.backend.allocate(shape, self.dtype, self.device) for _ in range(layers)]
        self.num_blocks = num_blocks

    def determine_num_blocks(self, cache: CacheConfig, max_num_tokens: int,
                             mem_info: Callable[[], tuple[int, int]] | None = None,
                             peak_bytes: Callable[[], int] | None = None) -> int:
        """How many blocks the pool can have: ``cache.kv_cache_bytes`` over the bytes per block
        when given (on any device, as vLLM's ``kv_cache_memory_bytes``); otherwise on a CPU the
        model-sized default (``sizing.cpu_num_blocks``), on CUDA what ``profile_run(max_num_tokens)``
        leaves of ``gpu_memory_utilization``.

        ``mem_info`` and ``peak_bytes`` (``profile_num_blocks``' fakes for tests) take the CUDA
        path on any device. Call it before ``initialize_kv_cache``: the measurement assumes no pool.
        """
        layers, kv_heads, head_dim = self.kv_spec
        if cache.kv_cache_bytes is not None or (self.device.type != "cuda" and mem_info is None):
            return cpu_num_blocks(cache.kv_cache_bytes, layers, kv_heads, head_dim, self.block_size, self.dtype)
        per_block = kv_bytes_per_block(layers, kv_heads, head_dim, self.block_size, self.dtype)
        return profile_num_blocks(lambda: self.profile_run(max_num_tokens), per_block,
                                  cache.gpu_memory_utilization, self.device, mem_info, peak_bytes)

    def profile_run(self, num_tokens: int) -> None:
        """Run the largest step the engine will schedule — one request's ``num_tokens`` prompt
        tokens — against a pool just big enough for it, then free that pool."""
        if self.kv_caches:
            raise RuntimeError("profile_run measures the model without its pool; call it before initialize_kv_cache")
        blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(blocks)
        try:
            req = Request("profile", [0] * num_tokens, SamplingParams(max_tokens=1, temperature=0.0))
            self.execute(self.prepare([(req, num_tokens)], [list(range(blocks))]))
        finally:
            self.kv_caches, self.num_blocks = [], None

    # ----- swapping ----------------------------------------------------------------------
    def swap_out(self, request: Request, blocks: Sequence[int]) -> None:
        """Copy ``blocks`` of every layer to host memory (pinned on CUDA), kept under the request's id."""
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        saved = []
        for k_pool, v_pool in self.kv_caches:
            k = k_pool.index_select(0, idx).to("cpu")  # [B, block_size, Hkv, D]
            v = v_pool.index_select(0, idx).to("cpu")
            saved.append((k.pin_memory(), v.pin_memory()) if pin else (k, v))
        self.swapped[request.request_id] = saved

    def swap_in(self, request: Request, blocks: Sequence[int]) -> None:
        """Copy the request's saved K/V into ``blocks`` (its new table's first blocks)."""
        saved = self.swapped[request.request_id]  # dropped only once the copy is done
        if saved and saved[0][0].shape[0] != len(blocks):
            raise RuntimeError(f"request {request.request_id!r}: swapped {saved[0][0].shape[0]} blocks "
                               f"out but {len(blocks)} came back")
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        for (k_pool, v_pool), (k, v) in zip(self.kv_caches, saved):
            k_pool.index_copy_(0, idx, k.to(self.device, non_blocking=True))
            v_pool.index_copy_(0, idx, v.to(self.device, non_blocking=True))
        del self.swapped[request.request_id]

    def drop(self, request_id: str) -> None:
        """Forget a finished request's swapped K/V, if any."""
        self.swapped.pop(request_id, None)

    # ----- one step ----------------------------------------------------------------------
    def prepare(self, scheduled: Sequence[tuple[Request, int]],
                block_tables: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
                pad_to: int | None = None) -> Batch:
        return build_batch(scheduled, block_tables, self.block_size, self.device, pad_to)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """One forward pass over the batch -> logits [len(logits_indices), V] (float32/float64)."""
        return self.flat.logits(batch, self.kv_caches, self.backend)
