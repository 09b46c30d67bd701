"""Seeded request workloads for the chapter's benchmark and experiments.

The token-id workloads (shared prefix, random, chat) draw random ids and fit any model; the text
workload is real English, tokenized by a checkpoint's tokenizer (the repository's
``models/qwen3-kjv-tiny`` by default), so its outputs can be read.
"""
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


def random_workload(num_requests: int = 64, seed: int = 0, vocab_size: int = 512,
                    prompt_len: tuple[int, int] = (16, 256),
                    output_len: tuple[int, int] = (16, 128)) -> list[WorkItem]:
    """nano-vllm's throughput benchmark, scaled for a CPU: independent random prompts and output
    lengths drawn uniformly (bounds inclusive), no shared prefix. Run it with ``ignore_eos``."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    return [WorkItem(f"rand{i}", [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))],
                     rng.randint(*output_len)) for i in range(num_requests)]


@dataclass(frozen=True)
class ChatTurn:
    """One user turn of a conversation: the new message's tokens and the answer's length."""

    conversation: int
    message: list[int]
    max_tokens: int


def chat_workload(num_conversations: int = 8, num_turns: int = 4, seed: int = 0, vocab_size: int = 512,
                  system_len: int = 64, message_len: tuple[int, int] = (16, 48),
                  output_len: tuple[int, int] = (16, 32)) -> tuple[list[int], list[list[ChatTurn]]]:
    """A multi-turn chat: (system prompt, turns by round). Round k holds turn k of every conversation.

    A turn's prompt is only known once the previous turn has been answered: it is the previous
    turn's prompt + that answer + the new message (the first turn: system prompt + message). So
    the rounds run one after another, and a prefix cache that keeps generated tokens' blocks
    serves each turn's whole history.
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError(f"need at least one conversation and one turn, got {num_conversations} x {num_turns}")
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_len)]
    rounds = [[ChatTurn(c, [rng.randrange(vocab_size) for _ in range(rng.randint(*message_len))],
                        rng.randint(*output_len)) for c in range(num_conversations)]
              for _ in range(num_turns)]
    return system, rounds


# Psalm 23 (King James Version, public domain): the text workload's shared system prompt, one
# verse per document as models/qwen3-kjv-tiny was trained (each verse followed by EOS).
PSALM_23 = (
    "The LORD is my shepherd; I shall not want.",
    "He maketh me to lie down in green pastures: he leadeth me beside the still waters.",
    "He restoreth my soul: he leadeth me in the paths of righteousness for his name's sake.",
    "Yea, though I walk through the valley of the shadow of death, I will fear no evil: for thou art "
    "with me; thy rod and thy staff they comfort me.",
    "Thou preparest a table before me in the presence of mine enemies: thou anointest my head with "
    "oil; my cup runneth over.",
    "Surely goodness and mercy shall follow me all the days of my life: and I will dwell in the house "
    "of the LORD for ever.",
)
# Openings of verses in the KJV's manner: each request continues one of them.
OPENINGS = (
    "And the LORD spake unto Moses, saying,", "In the beginning", "And it came to pass, when",
    "Blessed are they that", "Hear, O Israel:", "And Jesus said unto them,", "The fear of the LORD is",
    "And the king said unto", "Praise ye the LORD.", "Now the sons of", "Thus saith the LORD;",
    "And he went up", "My son, hear", "And the children of Israel", "For God so loved", "Behold, I",
)


def text_workload(tokenizer, num_requests: int = 16, seed: int = 0,
                  output_len: tuple[int, int] = (16, 48)) -> list[WorkItem]:
    """Real text: every request = Psalm 23 (the shared system prompt, each verse + EOS) + one of
    ``OPENINGS`` (in turn), wanting ``output_len`` tokens (bounds inclusive, seeded).

    ``tokenizer``: an ``engine.tokenizer.Tokenizer`` with an EOS token.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the text workload needs a tokenizer with an EOS token (it ends each verse)")
    rng = random.Random(seed)
    system = [t for verse in PSALM_23 for t in tokenizer.encode(verse) + [tokenizer.eos_token_id]]
    return [WorkItem(f"text{i}", system + tokenizer.encode(OPENINGS[i % len(OPENINGS)]), rng.randint(*output_len))
            for i in range(num_requests)]
