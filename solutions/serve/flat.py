"""FlatModel: an already loaded Qwen3 / Qwen3-MoE, run on the flattened batch's rows.

Nothing is copied or renamed: FlatModel drives the model's own modules (projections, norms, MLP
or MoE block, LM head) on ``[N, ...]`` rows that may belong to many requests. Only attention
looks at request boundaries, through ``BatchMeta`` and an attention backend.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.rope import apply_rope, rope_cos_sin
from engine.serve.attention import AttentionBackend, KVCache
from engine.serve.batch import BatchMeta


def add_norm(hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns (norm(hidden + residual), hidden + residual).

    One helper so that a later chapter can fuse the two into one kernel. ``residual=None`` at the
    first layer means there is nothing to add yet.
    """
    if residual is not None:
        hidden = hidden + residual
    return norm(hidden), hidden


class FlatModel:
    """Runs a Qwen3-family model on N flat rows with K/V in a block pool."""

    def __init__(self, model: nn.Module) -> None:
        if not hasattr(model, "cfg") or not hasattr(model, "model"):
            raise ValueError("FlatModel wraps a Qwen3ForCausalLM-style model with .cfg and .model")
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

        x: [N, D] (already normed). Project q, k, v and view them as [N, heads, head_dim]; apply
        Qwen3's per-head RMSNorm to q and k; rotate q and k by each row's own position (cos/sin
        [N, head_dim], computed once per step); write this step's k and v — AFTER RoPE — into the
        pool; attend through the backend (which reads this step's K/V back from the pool) with the
        layer's ``attn.scale`` and the model's ``self.cfg.sliding_window``; o_proj.
        Returns [N, D].
        """
        n = x.shape[0]
        q = attn.q_norm(attn.q_proj(x).view(n, attn.num_heads, attn.head_dim))  # [N, Hq, Dh]
        k = attn.k_norm(attn.k_proj(x).view(n, attn.num_kv_heads, attn.head_dim))  # [N, Hkv, Dh]
        v = attn.v_proj(x).view(n, attn.num_kv_heads, attn.head_dim)  # [N, Hkv, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.write(kv_cache, k, v, meta)
        o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)
        return attn.o_proj(o.reshape(n, -1))  # [N, Hq * Dh] -> [N, D]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """The whole model on the flat batch: input_ids, positions [N] -> final hidden [N, D].
        (Your engine: Chapter 31)

        RoPE tables are computed once for all N positions and shared by every layer. Each layer:
        h = h + attention(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)), written
        with ``add_norm`` so the residual add and the following norm are one call; the final
        ``model.norm`` is applied before returning. The MLP (dense or MoE) already works on rows.
        """
        m = self.model.model
        hidden = m.embed_tokens(input_ids)  # [N, D]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(m.layers, kv_caches):
            x, residual = add_norm(hidden, residual, layer.input_layernorm)
            hidden = self.attention(layer.self_attn, x, cos, sin, kv_cache, meta, backend)
            x, residual = add_norm(hidden, residual, layer.post_attention_layernorm)
            hidden = layer.mlp(x)
        out, _ = add_norm(hidden, residual, m.norm)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the rows the sampler needs only: hidden [M, D] -> logits [M, V], in float32
        (float64 for a float64 model). A 2,000-token prefill sends one row through here, not 2,000.
        The matmul runs in the model's dtype and only the logits are widened (upcasting the [V, D]
        weight instead would copy the model's largest matrix every step)."""
        work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        return self.model.lm_head(hidden).to(work)
