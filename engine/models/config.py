"""The model config dataclass shared by Qwen3 and Qwen3-MoE (HF ``config.json`` field names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Qwen3Config:
    """Shapes and constants of a Qwen3 / Qwen3-MoE model.

    ``num_experts == 0`` means a dense model; otherwise every layer not in ``mlp_only_layers``
    whose index i satisfies ``(i + 1) % decoder_sparse_step == 0`` has a sparse MoE block.
    ``sliding_window == 0`` means full attention.
    """

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    sliding_window: int = 0
    # Mixture of experts (chapter 27); zero experts = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"Qwen3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError("moe_intermediate_size must be >= 1 for an MoE model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % max(1, self.decoder_sparse_step) == 0)
