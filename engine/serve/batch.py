"""The flattened batch: every scheduled token of every request in one [N] sequence.

Matmuls see ``[N, D]`` and never care which request a row belongs to; only attention needs the
per-request structure, which travels in ``BatchMeta``. Worked example (block_size 16): a = chunk of
3 at c=6, b = decode at 41, c = decode at 9, d = new 4-token prompt gives
input_ids a6 a7 a8 b41 c9 d0 d1 d2 d3, positions 6 7 8 41 9 0 1 2 3, query_start_loc 0 3 4 5 9 and
seq_lens 9 42 10 4.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.serve.request import Request

PAD_SLOT = -1  # slot of a padding row: write_kv sends it to the pool's scratch slot


@dataclass
class BatchMeta:
    """What attention needs to find each request's rows and its K/V in the pool.

    R requests, N rows. Request r owns the t rows ``query_start_loc[r]:query_start_loc[r+1]``,
    which are the final t tokens of its context: that context has ``seq_lens[r]`` tokens, stored
    in the blocks ``block_table[r]`` (zero padded past the request's real blocks). ``slot_mapping[i]`` is the
    flat pool slot that row i's K/V is written to (``PAD_SLOT`` for padding rows). The ``*_cpu``
    copies let kernels be launched without reading the device.
    """

    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    slot_mapping: torch.Tensor  # int64 [N]
    block_size: int
    query_start_loc_cpu: torch.Tensor  # int32 [R + 1], host copy
    seq_lens_cpu: torch.Tensor  # int32 [R], host copy
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class Batch:
    """One step's input: rows, their positions, the attention metadata, and which rows to sample.

    ``logits_indices`` lists the rows whose logits are needed: first every request's sample rows
    (``sample_counts[r]`` rows at the end of request r's span, in request order), then the
    prompt-logprob rows of ``prompt_spans`` in order. ``request_ids[r]`` names request r.
    """

    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    meta: BatchMeta
    logits_indices: torch.Tensor  # int64 [M]
    sample_counts: list[int]
    request_ids: list[str]
    prompt_spans: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sample_rows(self) -> int:
        return sum(self.sample_counts)


def build_batch(
    scheduled: Sequence[tuple[Request, int]],
    block_tables: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    pad_to: int | None = None,
) -> Batch:
    """Flatten this step's ``(request, n)`` pairs into one Batch. (Your engine: Chapter 31)

    ``block_tables`` gives each scheduled request's blocks in logical order: a sequence aligned
    with ``scheduled`` or a mapping from request id (look each request up by its id: the mapping's
    own order need not be the plan's). For request r with c = num_computed_tokens:
    - its rows are the tokens ``(token_ids + spec_token_ids)[c:c+n]`` (fewer than n available ->
      ValueError), at positions c .. c+n-1, and its seq_len is c+n;
    - its table must hold every position up to c+n-1: a table too short
      (``len(table) * block_size < c + n``) is a ValueError naming the request, raised before any
      slot is looked up (not the IndexError of reading past the table's end);
    - position p is written to slot ``table[p // block_size] * block_size + p % block_size``;
    - it samples from the last k = min(n, max(0, c + n - (num_tokens - 1))) rows of its span
      (num_tokens counts prompt AND outputs): 1 for a decode, for the chunk that reaches the
      prompt's last token and for a resumed request's re-run history (prompt + outputs), 0 for a
      chunk that stops mid-prompt (its logits would predict a token we already know);
    - if ``params.prompt_logprobs`` is set, rows at positions c .. min(c+n, P-1)-1 (each predicts
      a prompt token) are added to ``logits_indices`` AFTER all sample rows, with a
      ``prompt_spans`` entry (request, c, the prompt tokens they predict) — only for a span that
      has such rows: a decode, or the one-row chunk at the prompt's last token, gets no entry.
    ``pad_to`` appends dummy requests (one row each: token 0, position 0, slot PAD_SLOT, seq_len 0,
    empty table, request id "", sample_counts 0) until there are pad_to requests.
    ``input_ids``, ``positions`` and ``logits_indices`` are int64 (as ``Batch``'s comments say).
    The meta's fields are as ``BatchMeta`` documents them (dtypes in its comments), over all R
    requests, dummies included: ``max_query_len`` is the longest span (a dummy's is 1),
    ``max_seq_len`` the largest seq_len; ``block_table`` is [R, the longest table], shorter tables
    padded with 0 — [R, 0] when every table is empty (only dummies, or no request at all), never a
    padded column.
    """
    raise NotImplementedError("build_batch is a hole: fill it in (Chapter 31, engine/serve/batch.py)")
