"""Chapter 17: Qwen3 with HF-compatible parameter names.

``Qwen3ForCausalLM(cfg)`` holds ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``...self_attn.{q,k}_norm``, ``...mlp.{gate,up,down}_proj``, ``...input_layernorm``,
``...post_attention_layernorm``, ``model.norm`` and ``lm_head`` (tied to the embedding when
``cfg.tie_word_embeddings``), so an HF state dict loads as it is. Its own ``forward`` runs ONE
sequence with plain causal attention and no cache: it serves ``generate()``, the oracle.

The decoder loop is written once, ``Qwen3Model.run_layers``; whoever drives the model passes its
own attention (an ``Attend`` callback). ``forward`` passes plain causal attention; chapter 24's
slots and chapter 31's ``FlatModel`` pass attention over their caches. The LM head's dtype rule is
``compute_logits``, also written once. RMSNorm, the MLP and ``add_norm`` live in
``engine.models.layers`` and the MoE block in ``engine.models.sparse_moe`` (both re-exported here).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention import causal_attention
from engine.models.config import Qwen3Config
from engine.models.layers import Qwen3MLP, RMSNorm, add_norm
from engine.models.sparse_moe import Qwen3MoeSparseMoeBlock
from engine.precision import work_dtype
from engine.rope import apply_rope, rope_cos_sin

__all__ = ["Attend", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3MLP", "Qwen3Model",
           "RMSNorm", "add_norm"]


class Qwen3Attention(nn.Module):
    """Projections and per-head q/k RMSNorm; the attention itself is done by whoever drives it."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, D] -> q [N, Hq, Dh], k and v [N, Hkv, Dh]; q and k normed per head and rotated."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        if cfg.is_sparse_layer(layer_idx):
            self.mlp: nn.Module = Qwen3MoeSparseMoeBlock(cfg)
        else:
            self.mlp = Qwen3MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# attend(layer_idx, attn, x, cos, sin) -> [N, D]: one layer's attention on normed rows x [N, D],
# o_proj included; how K/V are stored and which keys each row sees is the caller's business.
Attend = Callable[[int, Qwen3Attention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder stack on rows: embedded hidden [N, D] -> (hidden, residual), each [N, D].

        Per layer: h = h + attend(i, self_attn, input_layernorm(h), cos, sin); h = h +
        mlp(post_attention_layernorm(h)), each residual add fused with the norm after it through
        ``add_norm``. The last layer's residual add is left to the caller's final norm:
        ``add_norm(hidden, residual, self.norm)``. cos/sin [N, head_dim] are passed through to
        ``attend`` unchanged; every other operation here acts on each row alone. This one loop
        serves ``generate()``'s forward, chapter 24's slots and chapter 31's flat model.
        """
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = add_norm(hidden, residual, layer.input_layernorm)
            hidden = attend(i, layer.self_attn, x, cos, sin)
            x, residual = add_norm(hidden, residual, layer.post_attention_layernorm)
            hidden = layer.mlp(x)
        return hidden, residual


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 (dense; Qwen3-MoE when ``cfg.num_experts > 0``) with HF parameter names."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One sequence, no cache: input_ids [T] -> logits [T, V] (float32; float64 models stay
        float64). Positions are 0..T-1."""
        if input_ids.dim() != 1:
            raise ValueError(f"forward takes one sequence of shape [T], got {tuple(input_ids.shape)}")
        cfg, m = self.cfg, self.model
        pos = torch.arange(input_ids.shape[0], device=input_ids.device)
        h = m.embed_tokens(input_ids)  # [T, D]
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)  # [T, Dh] each

        def attend(i: int, attn: Qwen3Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            q, k, v = attn.qkv(x, cos, sin)
            o = causal_attention(q, k, v, pos, pos, scale=attn.scale, window=cfg.sliding_window)
            return attn.o_proj(o.reshape(o.shape[0], -1))  # [T, Hq * Dh] -> [T, D]

        h, residual = m.run_layers(h, cos, sin, attend)
        h, _ = add_norm(h, residual, m.norm)
        return self.compute_logits(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: hidden [M, D] -> logits [M, V] in ``work_dtype`` (float32; float64 models
        stay float64). The matmul runs in the model's dtype and only the logits are widened:
        upcasting the [V, D] weight instead would copy the model's largest matrix on every call."""
        return self.lm_head(hidden).to(work_dtype(hidden.dtype))
