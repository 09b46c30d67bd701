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


class RopeTable:
    """``rope_cos_sin`` by lookup: the cos and sin rows of positions 0..P-1 computed once (by
    ``rope_cos_sin`` itself) and each step's rows selected from them, instead of two
    transcendental functions per row every step (vLLM's engine keeps such a cache too).

    Invariant: ``cos[p]``, ``sin[p]`` are ``rope_cos_sin``'s rows for position p; the table grows
    (doubling, to at least ``MIN_ROWS``) when a step asks past its end. The lookup is the computed
    value only where the angle's cos and sin do not depend on where the row sits in the batch
    (elementwise ops: tests check it against ``rope_cos_sin`` on this machine's torch).
    Negative positions (no table row) are computed as ``rope_cos_sin`` computes them, and so are
    positions on another device than the CPU (the lookup needs the largest position on the host:
    there, a wait for the device every step).
    """

    MIN_ROWS = 1024

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.head_dim, self.theta, self.dtype, self.device = head_dim, theta, dtype, torch.device(device)
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin), [P, head_dim] each

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (int64) -> cos, sin [N, head_dim], as ``rope_cos_sin(positions, head_dim, theta, dtype)``."""
        if positions.numel() == 0 or positions.device.type != "cpu" or positions.device != self.device:
            return rope_cos_sin(positions, self.head_dim, self.theta, self.dtype)
        if positions.shape[0] <= 256:  # a decode step's few rows: Python's min and max beat one more op kind
            values = positions.tolist()
            low, high = min(values), max(values)
        else:
            low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0:
            return rope_cos_sin(positions, self.head_dim, self.theta, self.dtype)
        table = self.table
        if table is None or high >= table[0].shape[0]:
            size = max(self.MIN_ROWS, 1 << high.bit_length())  # > high
            rows = torch.arange(size, device=self.device)
            table = self.table = rope_cos_sin(rows, self.head_dim, self.theta, self.dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)
