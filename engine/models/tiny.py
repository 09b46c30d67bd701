"""The 2-layer test model: a seeded Qwen3 (or Qwen3-MoE) small enough for a laptop CPU.

Weights are drawn from a private ``torch.Generator`` in a fixed order, so ``tiny_model(seed=s)``
is the same model on every machine and in every process. The embedding and LM head are drawn
wide on purpose: logits spread over several units, so greedy choices are well separated and a
float32 batched step cannot flip a near-tie that a one-prompt ``generate()`` resolves the other
way.
"""
from __future__ import annotations

import torch

from engine.models.config import Qwen3Config
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM


def tiny_config(moe: bool = False, **overrides) -> Qwen3Config:
    """The test model's config: 2 layers, hidden 128, 4 query / 2 kv heads of 32, vocab 512."""
    cfg = dict(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    )
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def tiny_model(seed: int = 0, moe: bool = False, dtype: torch.dtype = torch.float32,
               **overrides) -> Qwen3ForCausalLM:
    """A deterministic random 2-layer Qwen3 (``moe=True``: Qwen3-MoE), in eval mode, on the CPU."""
    cfg = tiny_config(moe, **overrides)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.0)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)
    return model.to(dtype).eval()
