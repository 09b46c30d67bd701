"""ModelRunner: owns the K/V pools, turns a schedule into a Batch, and runs the model once."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.batch import Batch, build_batch
from engine.serve.flat import FlatModel
from engine.serve.request import Request


class ModelRunner:
    """The device side of the engine.

    Holds one (K, V) pool per layer, each ``[num_blocks + 1, block_size, Hkv, D]`` (the +1 is the
    scratch block padding rows write to), and the host copies of swapped-out requests' K/V.
    Invariant: ``swapped`` holds an entry exactly for requests that are swapped out and not
    finished.
    """

    def __init__(self, flat: FlatModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        self.flat = flat
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device) if device is not None else flat.device
        self.dtype = dtype or flat.dtype
        layers, kv_heads, head_dim = flat.kv_spec()
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        self.kv_caches: list[KVCache] = [backend.allocate(shape, self.dtype, self.device) for _ in range(layers)]
        self.swapped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

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
        hidden = self.flat.forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                                   self.backend)  # [N, D]
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.flat.cfg.vocab_size), dtype=torch.float32)
        return self.flat.compute_logits(hidden.index_select(0, batch.logits_indices))
