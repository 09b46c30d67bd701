"""Chapter 27: Qwen3-MoE's sparse block, on flat rows [N, D].

A router (``mlp.gate``, a linear layer to one logit per expert) picks the top-k experts for each
row; their SwiGLU outputs are mixed by the softmax weights (renormalised over the chosen k when
``norm_topk_prob``). Parameter names follow HF: ``mlp.gate.weight``,
``mlp.experts.E.{gate,up,down}_proj.weight``. Because it works on rows, not sequences, it runs
unchanged inside chapter 31's flattened batch. ``Qwen3DecoderLayer`` builds it for a sparse layer.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.models.config import Qwen3Config
from engine.models.layers import Qwen3MLP
from engine.precision import work_dtype


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
        probs = torch.softmax(self.gate(x).to(work_dtype(x.dtype)), dim=-1)  # [N, E]
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
