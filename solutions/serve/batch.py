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

import numpy as np
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


_NUMPY_INT = {torch.int32: np.int32, torch.int64: np.int64}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor from a Python list of ints (or of equally long lists), through numpy:
    ``torch.tensor(list)`` inspects every element and costs several times more, on every step."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_INT[dtype]))


def padded_table(tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """int32 [R, width] host tensor: each request's block table, zero padded on the right."""
    zeros = [0] * width
    return host_tensor([[*table, *zeros[len(table):]] for table in tables], torch.int32).view(len(tables), width)


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The host tensors on ``device`` (themselves on a CPU: nothing to copy, nothing to call)."""
    device = torch.device(device)
    return list(tensors) if device.type == "cpu" else [t.to(device, non_blocking=True) for t in tensors]


def build_batch(
    scheduled: Sequence[tuple[Request, int]],
    block_tables: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    pad_to: int | None = None,
) -> Batch:
    """Flatten this step's ``(request, n)`` pairs into one Batch. (Your engine: Chapter 31)

    ``block_tables`` gives each scheduled request's blocks in logical order: a sequence aligned
    with ``scheduled`` or a mapping from request id. For request r with c = num_computed_tokens:
    - its rows are the tokens ``(token_ids + spec_token_ids)[c:c+n]`` (fewer than n available ->
      ValueError), at positions c .. c+n-1, and its seq_len is c+n;
    - position p is written to slot ``table[p // block_size] * block_size + p % block_size``;
    - it samples from the last k = min(n, max(0, c + n - (num_tokens - 1))) rows of its span:
      1 for a decode or for the chunk that reaches the prompt's last token, 0 for a chunk that
      stops mid-prompt (its logits would predict a token we already know);
    - if ``params.prompt_logprobs`` is set, rows at positions c .. min(c+n, P-1)-1 (each predicts
      a prompt token) are added to ``logits_indices`` AFTER all sample rows, with a
      ``prompt_spans`` entry (request, c, the prompt tokens they predict).
    ``pad_to`` appends dummy requests (one row each: token 0, position 0, slot PAD_SLOT, seq_len 0,
    empty table) until there are pad_to requests.
    Collect plain Python lists, then make each tensor once at the end (``host_tensor``,
    ``padded_table``), never a tensor per token.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[Sequence[int]] = []
    sample_rows: list[int] = []
    sample_counts: list[int] = []
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[Request, int, list[int]]] = []
    request_ids: list[str] = []
    by_id = isinstance(block_tables, Mapping)
    for i, (req, n) in enumerate(scheduled):
        table = block_tables[req.request_id] if by_id else block_tables[i]
        c = req.num_computed_tokens
        if n < 1:
            raise ValueError(f"request {req.request_id!r}: scheduled n must be >= 1, got {n}")
        tokens = req.token_ids[c:c + n]
        if len(tokens) < n:
            tokens = tokens + req.spec_token_ids[max(0, c - req.num_tokens):c + n - req.num_tokens]
            if len(tokens) < n:
                raise ValueError(
                    f"request {req.request_id!r}: {n} tokens scheduled from position {c}, "
                    f"but only {len(tokens)} exist (num_tokens_with_spec={req.num_tokens_with_spec})")
        if len(table) * block_size < c + n:
            raise ValueError(
                f"request {req.request_id!r}: its {len(table)} blocks hold {len(table) * block_size} "
                f"tokens, but the step needs {c + n}; allocate slots before building the batch")
        start = len(input_ids)
        input_ids += tokens
        if n == 1:  # a decode: one row, the common case
            positions.append(c)
            slots.append(table[c // block_size] * block_size + c % block_size)
        else:
            positions += range(c, c + n)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(start + n)
        seq_lens.append(c + n)
        tables.append(table)
        request_ids.append(req.request_id)
        k = c + n - req.num_tokens + 1  # rows from the last known token on; clamped to [0, n]
        k = 0 if k < 0 else (n if k > n else k)
        sample_counts.append(k)
        if k == 1:
            sample_rows.append(start + n - 1)
        elif k:
            sample_rows += range(start + n - k, start + n)
        if req.params.prompt_logprobs is not None:
            end = min(c + n, req.num_prompt_tokens - 1)
            if end > c:
                prompt_rows.extend(range(start, start + end - c))
                prompt_spans.append((req, c, req.prompt_token_ids[c + 1:end + 1]))
    if pad_to is not None:
        if pad_to < len(scheduled):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(scheduled)} scheduled requests")
        for _ in range(pad_to - len(scheduled)):
            input_ids.append(0)
            positions.append(0)
            slots.append(PAD_SLOT)
            qsl.append(len(input_ids))
            seq_lens.append(0)
            tables.append([])
            request_ids.append("")
            sample_counts.append(0)
    width = max(map(len, tables), default=0)
    # One numpy array per dtype (each call into numpy or torch costs microseconds, every step).
    qsl_cpu, seq_lens_cpu = host_tensor(qsl + seq_lens, torch.int32).split([len(qsl), len(seq_lens)])
    ids, pos, slot_mapping = host_tensor([input_ids, positions, slots], torch.int64)  # [3, N] -> 3 x [N]
    dev = to_device([qsl_cpu, seq_lens_cpu, padded_table(tables, width), slot_mapping, ids, pos,
                     host_tensor(sample_rows + prompt_rows, torch.int64)], device)
    meta = BatchMeta(
        query_start_loc=dev[0],
        seq_lens=dev[1],
        block_table=dev[2],
        slot_mapping=dev[3],
        block_size=block_size,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max((b - a for a, b in zip(qsl, qsl[1:])), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return Batch(
        input_ids=dev[4],
        positions=dev[5],
        meta=meta,
        logits_indices=dev[6],
        sample_counts=sample_counts,
        request_ids=request_ids,
        prompt_spans=prompt_spans,
    )
