"""Chapter 5: causal attention with grouped-query heads.

The one attention everything else is checked against. Queries and keys carry explicit positions,
so the same function serves a whole prompt (positions 0..T-1 on both sides), a decode step (one
query at position T against keys 0..T) and a prefill chunk (queries at c..c+n-1 against keys
0..c+n-1).
"""
from __future__ import annotations

import math

import torch

from engine.precision import work_dtype


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attend ``q`` to ``k``/``v`` under the causal rule ``k_pos <= q_pos``.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Hq a multiple of Hkv (grouped-query attention: query
    head h reads kv head h // (Hq // Hkv)). q_pos [Tq] and k_pos [Tk] default to the last Tq
    positions of 0..Tk-1 and to 0..Tk-1. ``allowed`` ([Tq, Tk] bool) further restricts which keys a
    query may see. ``window > 0`` keeps only keys with ``k_pos > q_pos - window`` (sliding window;
    0 means no window). ``scale`` defaults to 1/sqrt(D). Scores and softmax run in float32 (or
    float64 when the inputs are float64); the result has q's dtype, [Tq, Hq, D]. A query that may
    see no key at all gets a zero output.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if k_pos is None:
        k_pos = torch.arange(tk, device=q.device)
    if q_pos is None:
        q_pos = torch.arange(tk - tq, tk, device=q.device)
    work = work_dtype(q.dtype)
    group = hq // hkv
    kf = k.to(work).repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    vf = v.to(work).repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.to(work), kf) * scale  # [Hq, Tq, Tk]
    mask = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    if window > 0:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a query with no visible key: all -inf -> NaN -> 0
    out = torch.einsum("hqk,khd->qhd", probs, vf)  # [Tq, Hq, D]
    return out.to(q.dtype)
