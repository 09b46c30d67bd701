"""Chapter 8: turning one row of logits into one token (temperature, top-k, top-p)."""
from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits [V] outside the top-k (0 = no limit) and outside the top-p nucleus to -inf.

    The nucleus is the smallest set of highest-probability tokens whose mass reaches top_p; the
    most likely token always stays.
    """
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop = mass_before >= top_p
        drop[0] = False
        logits[order[drop]] = float("-inf")
    return logits


def sample_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token from logits [V]. temperature 0 means greedy (argmax); otherwise softmax of
    logits / temperature after top-k/top-p, drawn with ``generator`` (seeded => reproducible)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0.0:
        return int(torch.argmax(logits))
    masked = apply_top_k_top_p(logits / temperature, top_k, top_p)
    probs = torch.softmax(masked, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
