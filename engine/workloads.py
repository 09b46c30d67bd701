"""Seeded request workloads for the chapter's benchmark and experiments."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: its id, prompt token ids and how many tokens it wants."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def shared_prefix_workload(num_requests: int = 16, seed: int = 0, vocab_size: int = 512,
                           system_len: int = 192, question_len: tuple[int, int] = (8, 48),
                           output_len: tuple[int, int] = (8, 40)) -> list[WorkItem]:
    """The chapter's workload: every request = one shared ``system_len``-token system prompt +
    its own question of ``question_len`` tokens, wanting ``output_len`` tokens (bounds inclusive)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_len)]
    items = []
    for i in range(num_requests):
        question = [rng.randrange(vocab_size) for _ in range(rng.randint(*question_len))]
        items.append(WorkItem(f"req{i}", system + question, rng.randint(*output_len)))
    return items
