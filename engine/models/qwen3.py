"""Chapter 17: Qwen3 with HF-compatible parameter names.

``Qwen3ForCausalLM(cfg)`` holds ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``...self_attn.{q,k}_norm``, ``...mlp.{gate,up,down}_proj``, ``...input_layernorm``,
``...post_attention_layernorm``, ``model.norm`` and ``lm_head`` (tied to the embedding when
``cfg.tie_word_embeddings``), so an HF state dict loads as it is. Its own ``forward`` runs ONE
sequence with plain causal attention and no cache: it serves ``generate()``, the oracle. Serving
engines (chapters 24 and 31) drive the same modules their own way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import causal_attention
from engine.models.config import Qwen3Config
from engine.rope import apply_rope, rope_cos_sin


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 (float64 stays float64), as HF computes it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            # Same arithmetic as below, as one fused op: this norm runs four times per layer, and
            # on small batches each extra elementwise op costs more than the math.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        work = torch.float32  # 16-bit inputs: normalise in float32, scale after casting back (as HF)
        h = x.to(work)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
            from engine.models.qwen3_moe import Qwen3MoeSparseMoeBlock

            self.mlp: nn.Module = Qwen3MoeSparseMoeBlock(cfg)
        else:
            self.mlp = Qwen3MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


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
        cfg = self.cfg
        pos = torch.arange(input_ids.shape[0], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)  # [T, D]
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)
        for layer in self.model.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)
            o = causal_attention(q, k, v, pos, pos, scale=attn.scale, window=cfg.sliding_window)
            h = h + attn.o_proj(o.reshape(o.shape[0], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.model.norm(h)
        # The LM head runs in the model's dtype and only its output is widened: upcasting the
        # [V, D] weight instead would copy the model's largest matrix on every call.
        work = torch.float64 if h.dtype == torch.float64 else torch.float32
        return self.lm_head(h).to(work)
