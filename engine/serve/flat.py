"""FlatModel: an already loaded Qwen3 / Qwen3-MoE, run on the flattened batch's rows.

Nothing is copied or renamed: FlatModel drives the model's own modules (projections, norms, MLP
or MoE block, LM head) on ``[N, ...]`` rows that may belong to many requests, through the model's
own decoder loop (``Qwen3Model.run_layers``, the loop ``generate()`` runs too). Only attention
looks at request boundaries, through ``BatchMeta`` and an attention backend: it is the one piece
FlatModel hands the loop. ``add_norm`` (residual add + norm, the seam a later chapter fuses) lives
in ``engine.models.layers`` and is re-exported here.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import add_norm
from engine.rope import rope_cos_sin
from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.batch import Batch, BatchMeta

__all__ = ["FlatModel", "add_norm"]


class FlatModel:
    """Runs a Qwen3-family model on N flat rows with K/V in a block pool."""

    def __init__(self, model: nn.Module) -> None:
        if not all(hasattr(model, a) for a in ("cfg", "model", "compute_logits")):
            raise ValueError("FlatModel wraps a Qwen3ForCausalLM-style model: .cfg, .model, .compute_logits")
        self.model = model
        self.cfg = model.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def kv_spec(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim): for each token, every one of the ``layers`` layers keeps
        ``kv_heads`` K vectors and as many V vectors, each of ``head_dim`` numbers."""
        c = self.cfg
        per_layer = (c.num_key_value_heads, c.head_dim)
        return (c.num_hidden_layers, *per_layer)

    def attention(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_cache: KVCache, meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """One layer's attention on the flat rows. (Your engine: Chapter 31)

        x: [N, D] (already normed); cos/sin [N, head_dim], computed once per step. ``attn.qkv(x,
        cos, sin)`` gives q [N, Hq, Dh] and k, v [N, Hkv, Dh], with Qwen3's per-head RMSNorm and
        RoPE by each row's own position already applied to q and k. Write this step's k and v —
        AFTER RoPE, as they come out of ``qkv`` — into the pool FIRST, through the backend's
        ``write`` (given kv_cache, then k, v and meta), not ``write_kv`` directly: a backend may keep
        its pool in a layout of its own; then attend through the
        backend (which reads this step's K/V back from the pool) with the layer's ``attn.scale``
        and the model's ``self.cfg.sliding_window``; then ``attn.o_proj`` on the [N, Hq * Dh]
        output. Returns [N, D].
        """
        raise NotImplementedError("FlatModel.attention is a hole: fill it in (Chapter 31, engine/serve/flat.py)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """The whole model on the flat batch: input_ids, positions [N] -> final hidden [N, D].
        (Your engine: Chapter 31)

        Embed the rows (``self.model.model.embed_tokens``); compute the RoPE tables ONCE for all N
        rows from their ``positions`` (``rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta,
        self.dtype)``, shared by every layer); run the model's decoder loop
        ``self.model.model.run_layers(hidden, cos, sin, attend)`` with an ``attend(layer_idx,
        attn, x, cos, sin)`` that is ``self.attention`` on layer ``layer_idx``'s pool
        ``kv_caches[layer_idx]``. The loop returns (hidden, residual) with the last residual add
        still to do: finish with ``add_norm(hidden, residual, self.model.model.norm)`` (it returns
        (norm(hidden + residual), hidden + residual)) and return the normed rows.
        """
        raise NotImplementedError("FlatModel.forward is a hole: fill it in (Chapter 31, engine/serve/flat.py)")

    def logits(self, batch: Batch, kv_caches: list[KVCache], backend: AttentionBackend) -> torch.Tensor:
        """One forward pass over the batch -> logits of its ``logits_indices`` rows [M, V] (float32,
        or float64 for a float64 model; [0, V] when no row needs one). A faster flat model may skip
        the rows nobody reads; this one runs them all and selects."""
        hidden = self.forward(batch.input_ids, batch.positions, kv_caches, batch.meta, backend)  # [N, D]
        rows = batch.logits_indices
        if rows.numel() == 0:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        return self.compute_logits(hidden.index_select(0, rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the rows the sampler needs only: hidden [M, D] -> logits [M, V], in float32
        (float64 for a float64 model). A 2,000-token prefill sends one row through here, not 2,000.
        The model's own ``compute_logits``: the matmul runs in the model's dtype and only the
        logits are widened (upcasting the [V, D] weight instead would copy the model's largest
        matrix every step)."""
        return self.model.compute_logits(hidden)
