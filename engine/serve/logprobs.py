"""Logprobs the engine reports: one position's {token id: logprob} with each token's rank.

A position's entry scores one token (a sampled token, or a prompt token) and lists, after it,
the k most likely tokens of the same distribution. It is a plain ``dict`` from token id to
logprob (so ``entry[token]`` is a float), in that order, with ``ranks``: token id -> rank, 1 being
the most likely. The scored token's rank counts the tokens at least as likely as it (so a tie
ranks it last among equals, as vLLM does); the top k are ranked 1 .. k in order.

The distribution is the model's raw one, log_softmax of the logits before any penalty,
temperature, min_p, top-k or top-p (vLLM's default ``logprobs_mode="raw_logprobs"``).
"""
from __future__ import annotations

import torch


class TokenLogprobs(dict):
    """{token id: logprob}, the scored token first, then the top k; ``ranks`` gives each one's rank."""

    __slots__ = ("ranks",)

    def __init__(self, items=(), ranks: dict[int, int] | None = None) -> None:
        super().__init__(items)
        self.ranks: dict[int, int] = dict(ranks or {})

    def __reduce__(self):  # keep ``ranks`` across copy / pickle
        return (TokenLogprobs, (list(self.items()), self.ranks))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """One row of log_softmax output [V] -> the entry for ``token`` and its top ``k`` alternatives
    (k = -1: the whole vocabulary)."""
    k = logprobs.shape[-1] if k < 0 else min(k, logprobs.shape[-1])
    value = logprobs[token]
    rank = int((logprobs >= value).sum())
    entry = TokenLogprobs({int(token): float(value)}, {int(token): rank})
    if k:
        top = torch.topk(logprobs, k)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            if t not in entry:
                entry[t] = float(v)
                entry.ranks[t] = r
    return entry
