"""Rotary position embeddings (RoPE), the rotate-half form Qwen3 and HF transformers use."""
from __future__ import annotations

import torch

from engine.precision import work_dtype


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for each position: positions [N] -> two [N, head_dim] tensors.

    Angles are computed in float32 (float64 for float64 models) and cast to ``dtype``; computing
    them once per step for all N rows is what lets every layer reuse them.
    """
    work = work_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim))
    freqs = positions.to(work)[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by the per-row tables cos/sin [N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
