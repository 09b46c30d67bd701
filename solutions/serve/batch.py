"""The reference bodies of engine/serve/batch.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/batch.py.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping

import torch


def build_batch(scheduled, block_tables, block_size, device="cpu", pad_to=None):
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    input_ids, positions, slots = [], [], []  # one entry per row
    query_start_loc, seq_lens, tables, request_ids = [0], [], [], []  # one per request
    sample_rows, sample_counts, prompt_rows, prompt_spans = [], [], [], []
    by_id = isinstance(block_tables, Mapping)
    for i, (req, n) in enumerate(scheduled):
        table = block_tables[req.request_id] if by_id else block_tables[i]
        c = req.num_computed_tokens
        if n < 1:
            raise ValueError(f"request {req.request_id!r}: scheduled n must be >= 1, got {n}")
        spec = req.spec_token_ids
        tokens = (req.token_ids + spec)[c:c + n] if spec else req.token_ids[c:c + n]
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
        positions += range(c, c + n)
        if n == 1:  # a decode
            slots.append(table[c // block_size] * block_size + c % block_size)
        else:
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        query_start_loc.append(start + n)
        seq_lens.append(c + n)
        tables.append(table)  # read, not kept: the padded rows below are copies
        request_ids.append(req.request_id)
        # Rows from the one holding the last known token on predict new tokens; earlier rows don't.
        k = min(n, max(0, c + n - (req.num_tokens - 1)))
        sample_counts.append(k)
        sample_rows += range(start + n - k, start + n)
        if req.params.prompt_logprobs is not None:
            end = min(c + n, req.num_prompt_tokens - 1)
            if end > c:
                prompt_rows.extend(range(start, start + end - c))
                prompt_spans.append((req, c, req.prompt_token_ids[c + 1:end + 1]))
    if pad_to is not None:
        if pad_to < len(scheduled):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(scheduled)} scheduled requests")
        for _ in range(pad_to - len(scheduled)):  # one dummy row each, written to the scratch slot
            input_ids.append(0)
            positions.append(0)
            slots.append(PAD_SLOT)
            query_start_loc.append(len(input_ids))
            seq_lens.append(0)
            tables.append([])
            request_ids.append("")
            sample_counts.append(0)
    width = max(map(len, tables), default=0)

    def tensor(values, dtype):  # a list of ints -> a new 1-D CPU tensor (via a C array: torch.tensor on a list is ~0.5 us an element)
        if not values:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(array("i" if dtype == torch.int32 else "q", values), dtype=dtype)

    qsl_cpu = tensor(query_start_loc, torch.int32)
    seq_lens_cpu = tensor(seq_lens, torch.int32)
    flat_tables = []
    for t in tables:
        flat_tables += t
        if len(t) < width:
            flat_tables += [0] * (width - len(t))
    block_table = tensor(flat_tables, torch.int32).view(len(tables), width)
    meta = BatchMeta(
        query_start_loc=qsl_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=block_table.to(device),
        slot_mapping=tensor(slots, torch.int64).to(device),
        block_size=block_size,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return Batch(
        input_ids=tensor(input_ids, torch.int64).to(device),
        positions=tensor(positions, torch.int64).to(device),
        meta=meta,
        logits_indices=tensor(sample_rows + prompt_rows, torch.int64).to(device),
        sample_counts=sample_counts,
        request_ids=request_ids,
        prompt_spans=prompt_spans,
    )
