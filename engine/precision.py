"""The engine's one precision rule: float64 stays float64, every other dtype computes in float32.

Softmax (attention and the MoE router), RoPE angles and the LM head's logits are widened by this
rule: a 16-bit model gets float32 scores, a float32 model keeps float32, and a float64 model (the
tests' exact oracle runs) is never narrowed.
"""
from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for tensors (or a model) of ``dtype``: float64 for float64, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
