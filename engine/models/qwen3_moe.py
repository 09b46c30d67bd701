"""Chapter 27: Qwen3-MoE, the Qwen3 model whose MLPs are sparse mixture-of-experts blocks.

The block itself is ``engine.models.sparse_moe.Qwen3MoeSparseMoeBlock`` (re-exported here);
``Qwen3DecoderLayer`` builds it wherever ``cfg.is_sparse_layer(i)``, so this class only refuses a
config without experts. Imports go one way: this file imports ``qwen3``, never the reverse.
"""
from __future__ import annotations

from engine.models.config import Qwen3Config
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.sparse_moe import Qwen3MoeSparseMoeBlock

__all__ = ["Qwen3MoeForCausalLM", "Qwen3MoeSparseMoeBlock"]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 whose MLPs are sparse MoE blocks (``cfg.num_experts > 0``)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        if not cfg.is_moe:
            raise ValueError("Qwen3MoeForCausalLM needs cfg.num_experts > 0")
        super().__init__(cfg)
