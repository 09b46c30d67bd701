"""Qwen3's per-row building blocks: RMSNorm, the SwiGLU MLP, and the residual add + norm seam.

Every function here acts on each row of ``[..., D]`` on its own, so the same modules serve one
sequence (``generate()``), chapter 24's slots and chapter 31's flattened batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


def add_norm(hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns (norm(hidden + residual), hidden + residual).

    One helper so that a later chapter can fuse the two into one kernel. ``residual=None`` at the
    first layer means there is nothing to add yet.
    """
    if residual is not None:
        hidden = hidden + residual
    return norm(hidden), hidden
