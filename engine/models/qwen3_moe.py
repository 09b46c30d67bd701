"""Chapter 27: Qwen3-MoE's sparse block, on flat rows [N, D].

A router (``mlp.gate``, a linear layer to one logit per expert) picks the top-k experts for each
row; their SwiGLU outputs are mixed by the softmax weights (renormalised over the chosen k when
``norm_topk_prob``). Parameter names follow HF: ``mlp.gate.weight``,
``mlp.experts.E.{gate,up,down}_proj.weight``. Because it works on rows, not sequences, it runs
unchanged inside chapter 31's flattened batch.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.config import Qwen3Config
from engine.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Qwen3MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D]. Each row's result depends on that row alone."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        probs = torch.softmax(self.gate(x).to(work), dim=-1)  # [N, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)  # rows that picked expert e
            y = self.experts[e](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out.reshape(shape)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 whose MLPs are sparse MoE blocks (``cfg.num_experts > 0``)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        if not cfg.is_moe:
            raise ValueError("Qwen3MoeForCausalLM needs cfg.num_experts > 0")
        super().__init__(cfg)
