"""The reference bodies of engine/serve/batch.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/batch.py.
"""
from __future__ import annotations

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
        tokens = (req.token_ids + req.spec_token_ids)[c:c + n]
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
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        query_start_loc.append(start + n)
        seq_lens.append(c + n)
        tables.append(list(table))
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
    qsl_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)
    meta = BatchMeta(
        query_start_loc=qsl_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return Batch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=torch.tensor(sample_rows + prompt_rows, dtype=torch.int64, device=device),
        sample_counts=sample_counts,
        request_ids=request_ids,
        prompt_spans=prompt_spans,
    )
