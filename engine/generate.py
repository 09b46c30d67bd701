"""Chapter 16: the reference ``generate()`` — one prompt, greedy, no cache, obviously right.

Every engine in the course is tested against this function. It re-runs the whole sequence
through the model for every new token: quadratic and slow, and that is the point — there is no
cache, no batching and no bookkeeping in which a bug could hide.
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy continuation of one prompt: the list of output token ids (at most max_new_tokens,
    ending early after ``eos_token_id`` when given, the EOS itself included)."""
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    tokens = list(prompt_token_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        logits = model(ids)  # [T, V]
        nxt = int(torch.argmax(logits[-1]))
        out.append(nxt)
        tokens.append(nxt)
        if eos_token_id is not None and nxt == eos_token_id:
            break
    return out
