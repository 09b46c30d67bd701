"""Chapter 31: Engine v2 — one core for every request.

Tests are grouped by hole, in the order the chapter builds them; each carries
``@pytest.mark.hole("<hole>")`` and the hole's short name in its test name, and
``pytest tests/test_ch31_engine_v2.py --hole allocate_slots`` checks exactly that hole — your version of
it, with the reference for every other hole (engine/_impl.py's Switch). A few tests of code the chapter
gives complete are marked ``given``. The milestone at the end runs all your holes together. Every expected value comes from an independent oracle: the
spec's worked example, a plain PyTorch computation, or ``generate()`` on one prompt alone.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ch31_helpers import (assert_rows_close, assert_same_tokens, batch_rows, model64, oracle, prompts,
                          run_checked, where_raised)
from engine.attention import causal_attention
from engine.models import tiny_model
from engine.rope import apply_rope, rope_cos_sin
from engine.serve import (BlockManager, EngineConfig, EngineCore, FlatModel, ReferenceBackend, Request,
                          SamplingParams, Scheduler, SchedulerConfig, Status, build_batch, hash_block,
                          write_kv)
from engine.serve.scheduler import SchedulerOutput
from engine.serve.batch import PAD_SLOT
from engine.serve.sampler import SimpleSampler
from course.quality.invariants import InvariantError, check_idle

hole = pytest.mark.hole
ROOT = Path(__file__).resolve().parent.parent


def req(rid: str, tokens, computed: int = 0, prompt_len: int | None = None, **params) -> Request:
    """A request whose first ``prompt_len`` tokens are the prompt and the rest outputs."""
    tokens = list(tokens)
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    r = Request(rid, tokens[:prompt_len], SamplingParams(**{"temperature": 0.0, **params}))
    for t in tokens[prompt_len:]:
        r.append(t)
    r.num_computed_tokens = computed
    return r


# ===================================================================== build_batch
def worked_example():
    """The spec's example (block_size 16): a = chunk of 3 at c=6 (of a 20-token prompt), b = decode
    at 41, c = decode at 9, d = a new 4-token prompt."""
    a = req("a", range(100, 120), computed=6)
    b = req("b", list(range(200, 230)) + list(range(230, 242)), computed=41, prompt_len=30)
    c = req("c", list(range(300, 305)) + list(range(305, 310)), computed=9, prompt_len=5)
    d = req("d", range(400, 404))
    tables = {"a": [5], "b": [7, 8, 9], "c": [1], "d": [4]}
    return [(a, 3), (b, 1), (c, 1), (d, 4)], tables


@hole("build_batch")
def test_build_batch_worked_example():
    scheduled, tables = worked_example()
    batch = build_batch(scheduled, tables, 16)
    assert batch.input_ids.tolist() == [106, 107, 108, 241, 309, 400, 401, 402, 403], \
        "rows must be each request's tokens [c:c+n], requests in schedule order"
    assert batch.positions.tolist() == [6, 7, 8, 41, 9, 0, 1, 2, 3], "positions are c .. c+n-1"
    m = batch.meta
    assert m.query_start_loc.tolist() == [0, 3, 4, 5, 9], \
        "query_start_loc[r] is where request r's rows start: 0, then the running sum of the n's"
    assert m.seq_lens.tolist() == [9, 42, 10, 4], "seq_len is c + n (the context after this step)"
    want_slots = [5 * 16 + 6, 5 * 16 + 7, 5 * 16 + 8, 9 * 16 + 9, 1 * 16 + 9, 64, 65, 66, 67]
    assert m.slot_mapping.tolist() == want_slots, "slot = table[p // block_size] * block_size + p % block_size"
    assert m.block_table.tolist() == [[5, 0, 0], [7, 8, 9], [1, 0, 0], [4, 0, 0]], "tables zero padded"
    assert (m.query_start_loc.dtype, m.seq_lens.dtype, m.block_table.dtype, m.slot_mapping.dtype) == \
        (torch.int32, torch.int32, torch.int32, torch.int64), \
            'dtypes: query_start_loc, seq_lens, block_table int32; slot_mapping int64'
    assert m.query_start_loc_cpu.tolist() == [0, 3, 4, 5, 9] and m.seq_lens_cpu.tolist() == [9, 42, 10, 4], \
        'the *_cpu host copies hold the same values'
    assert (m.max_query_len, m.max_seq_len, m.num_reqs, m.decode_only) == (4, 42, 4, False), \
        'max_query_len = the largest n, max_seq_len = the largest c + n, num_reqs = R, decode_only = all n == 1'
    assert batch.sample_counts == [0, 1, 1, 1], "a stops mid-prompt (0 rows); b, c decode; d reaches its last token"
    assert batch.logits_indices.tolist() == [3, 4, 8], "sample rows are the LAST rows of each span"
    assert batch.request_ids == ["a", "b", "c", "d"] and batch.num_sample_rows == 3, \
        'request_ids in schedule order; num_sample_rows = sum(sample_counts)'


@hole("build_batch")
def test_build_batch_looks_up_a_mapping_of_tables_by_request_id():
    scheduled, tables = worked_example()
    reordered = {rid: tables[rid] for rid in ("d", "c", "b", "a")}  # not the plan's order
    batch = build_batch(scheduled, reordered, 16)
    assert batch.meta.block_table.tolist() == [[5, 0, 0], [7, 8, 9], [1, 0, 0], [4, 0, 0]], \
        "block_tables given as a mapping is looked up by request id (block_tables[req.request_id]); its own " \
        "order (here d, c, b, a) is not the plan's"
    assert batch.meta.slot_mapping.tolist() == [86, 87, 88, 153, 25, 64, 65, 66, 67], \
        "each request's slots come from ITS table, whatever order the mapping lists them in"


@hole("build_batch")
def test_build_batch_a_resumed_history_samples_one_row():
    # preempted by recompute after 3 outputs: its whole history (6 prompt + 3 output tokens) runs again
    r = req("r", list(range(6)) + [40, 41, 42], computed=0, prompt_len=6)
    batch = build_batch([(r, 9)], [[2, 5, 7]], 4)
    assert batch.sample_counts == [1] and batch.logits_indices.tolist() == [8], \
        "a resumed request re-running prompt + outputs samples ONE row, its last: k counts from num_tokens " \
        "(prompt and outputs), not from the prompt's length (that would sample 4 rows here)"


@hole("build_batch")
def test_build_batch_prompt_spans_only_for_spans_that_predict_prompt_tokens():
    dec = req("dec", list(range(6)) + [9], computed=6, prompt_len=6, prompt_logprobs=0)  # a decode
    last = req("last", range(20, 26), computed=5, prompt_logprobs=0)  # the prompt's last token alone
    batch = build_batch([(dec, 1), (last, 1)], [[0, 1], [2, 3]], 4)
    assert batch.prompt_spans == [] and batch.logits_indices.tolist() == [0, 1], \
        "a decode, and a one-row chunk at the prompt's last token, predict no prompt token: no prompt_spans " \
        "entry and no prompt-logprob row, only their sample rows"


@hole("build_batch")
def test_build_batch_slot_at_block_boundary():
    r = req("r", range(40), computed=14)
    batch = build_batch([(r, 4)], [[7, 3, 11]], 16)  # positions 14, 15 | 16, 17 straddle blocks 0 and 1
    assert batch.meta.slot_mapping.tolist() == [7 * 16 + 14, 7 * 16 + 15, 3 * 16 + 0, 3 * 16 + 1], \
        "position 16 is the first slot of the SECOND block in the table (off-by-one at a block boundary?)"


@hole("build_batch")
def test_build_batch_decodes_on_both_sides_of_a_block_boundary():
    # One-row spans (decodes) at the last slot of block 0, the first of block 1, the first of block 2.
    last = req("last", range(16), computed=15, prompt_len=10)
    first = req("first", range(17), computed=16, prompt_len=10)
    third = req("third", range(33), computed=32, prompt_len=10)
    batch = build_batch([(last, 1), (first, 1), (third, 1)], [[7, 3], [5, 2], [9, 4, 6]], 16)
    assert batch.meta.slot_mapping.tolist() == [7 * 16 + 15, 2 * 16 + 0, 6 * 16 + 0], \
        "a decode at position 16 (32) writes the first slot of the table's second (third) block"
    assert batch.positions.tolist() == [15, 16, 32] and batch.input_ids.tolist() == [15, 16, 32], \
        'one row per decode, at position c, its token token_ids[c]'
    assert batch.logits_indices.tolist() == [0, 1, 2] and batch.meta.decode_only, \
        'a decode samples its only row; a batch of decodes only is decode_only'


@hole("build_batch")
def test_build_batch_sample_rows_for_each_kind_of_span():
    mid = req("mid", range(50), computed=10)  # rows 10..29 of a 50-token prompt: nothing to sample
    last = req("last", range(30), computed=20)  # chunk reaching the prompt's last token: 1 row
    decode = req("dec", list(range(10)) + [11, 12], computed=11, prompt_len=10)
    spec = req("spec", list(range(10)) + [11], computed=10, prompt_len=10)
    spec.spec_token_ids = [5, 6, 7]  # verification span: 1 + 3 drafts
    tables = {"mid": [0, 1], "last": [2, 3], "dec": [4], "spec": [5]}
    batch = build_batch([(mid, 20), (last, 10), (decode, 1), (spec, 4)], tables, 16)
    assert batch.sample_counts == [0, 1, 1, 4], \
        'sample rows: 0 mid-prompt, 1 for the chunk reaching the last token, 1 per decode, 1 + drafts for a verification span'
    assert batch.logits_indices.tolist() == [29, 30, 31, 32, 33, 34], \
        "a mid-prompt chunk must not sample; the others sample from the end of their span"
    assert batch.input_ids[-4:].tolist() == [11, 5, 6, 7], "a verification span feeds the drafts after the last token"


@hole("build_batch")
def test_build_batch_prompt_logprob_rows_come_after_all_sample_rows():
    a = req("a", range(10), computed=0, prompt_logprobs=0)  # whole prompt: rows 0..8 predict tokens 1..9
    b = req("b", list(range(6)) + [9], computed=6, prompt_len=6)
    batch = build_batch([(a, 10), (b, 1)], [[0], [1]], 16)
    assert batch.sample_counts == [1, 1], 'both spans reach their last known token: one sample row each'
    assert batch.logits_indices.tolist()[:2] == [9, 10], "sample rows first, in request order"
    assert batch.logits_indices.tolist()[2:] == list(range(0, 9)), "then the prompt-logprob rows"
    (r, c, targets), = batch.prompt_spans
    assert r is a and c == 0 and targets == list(range(1, 10)), \
        'a whole-prompt span: prompt_spans entry (request, c=0, prompt tokens 1..P-1)'


@hole("build_batch")
def test_build_batch_prompt_logprob_targets_of_later_chunks():
    mid = req("mid", range(100, 110), computed=4, prompt_logprobs=0)  # 2nd chunk: positions 4..7
    last = req("last", range(200, 210), computed=8, prompt_logprobs=0)  # last chunk: positions 8, 9
    batch = build_batch([(mid, 4), (last, 2)], [[0, 1, 2], [3, 4, 5]], 4)
    assert batch.sample_counts == [0, 1] and batch.logits_indices.tolist() == [5, 0, 1, 2, 3, 4], \
        "sample rows (last's final row, 5) first, then the prompt-logprob rows 0..3 and 4"
    (r1, c1, t1), (r2, c2, t2) = batch.prompt_spans
    assert (r1, c1, t1) == (mid, 4, [105, 106, 107, 108]), \
        "the row at position p predicts prompt token p + 1: a chunk starting at c predicts tokens c+1.., not 1.."
    assert (r2, c2, t2) == (last, 8, [209]), "the prompt's last row predicts no prompt token (it samples)"


@hole("build_batch")
def test_build_batch_pad_to_adds_inert_dummy_requests():
    r = req("r", range(5), computed=4)
    batch = build_batch([(r, 1)], [[3]], 16, pad_to=3)
    m = batch.meta
    assert batch.input_ids.tolist() == [4, 0, 0] and batch.positions.tolist() == [4, 0, 0], \
        'padding rows: token 0 at position 0'
    assert m.slot_mapping.tolist() == [3 * 16 + 4, PAD_SLOT, PAD_SLOT], 'padding rows write to PAD_SLOT'
    assert m.seq_lens.tolist() == [5, 0, 0] and m.query_start_loc.tolist() == [0, 1, 2, 3], \
        'padding requests have seq_len 0 and one row each'
    assert m.block_table.tolist() == [[3], [0], [0]], 'padding requests have empty (zero-padded) tables'
    assert batch.sample_counts == [1, 0, 0] and batch.logits_indices.tolist() == [0], \
        'padding requests sample nothing'
    assert batch.request_ids == ["r", "", ""] and (m.max_query_len, m.max_seq_len, m.num_reqs) == (1, 5, 3), \
        'dummy requests have id "" and count in R; max_query_len / max_seq_len are over every request'


@hole("build_batch")
def test_build_batch_rejects_more_tokens_than_exist():
    r = req("r", range(5), computed=3)
    with pytest.raises(ValueError):
        build_batch([(r, 4)], [[0]], 16)


@hole("build_batch")
def test_build_batch_rejects_a_table_too_short_for_the_positions():
    r = req("r", range(20), computed=14)  # positions 14, 15, 16: two blocks of 16, but the table holds one
    try:
        build_batch([(r, 3)], [[3]], 16)
    except ValueError as exc:
        assert "'r'" in str(exc), f"the ValueError names the request (its id 'r'): {exc}"
    except NotImplementedError:  # the unfilled hole says so itself
        raise
    except Exception as exc:  # noqa: BLE001 - any other error is the bug this test is for
        pytest.fail(f"a table of 1 block (16 slots) for positions 14..16 must be a ValueError naming the request, "
                    f"raised before any slot is looked up; got {type(exc).__name__}: {exc} (check "
                    f"len(table) * block_size >= c + n first)", pytrace=False)
    else:
        pytest.fail("a table of 1 block (16 slots) cannot hold position 16: build_batch must raise ValueError "
                    "(len(table) * block_size < c + n)", pytrace=False)


@hole("build_batch")
def test_build_batch_block_table_of_empty_tables_has_no_columns():
    dummies = build_batch([], [], 16, pad_to=2)
    assert tuple(dummies.meta.block_table.shape) == (2, 0), \
        "two dummies, each with an empty table: block_table is [2, 0] (as wide as the longest table, no padded column)"
    none = build_batch([], [], 16)
    assert tuple(none.meta.block_table.shape) == (0, 0), "no request at all: block_table is [0, 0]"
    assert none.meta.block_table.dtype == torch.int32 and dummies.meta.block_table.dtype == torch.int32


# ===================================================================== write_kv
@hole("write_kv")
def test_write_kv_scatters_rows_to_their_slots_and_padding_to_scratch():
    k_pool = torch.zeros(3 + 1, 4, 2, 3)  # 3 blocks + scratch, block_size 4, Hkv 2, D 3
    v_pool = torch.zeros_like(k_pool)
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    v = -k
    write_kv(k_pool, v_pool, k, v, torch.tensor([5, PAD_SLOT, 8]))
    assert not torch.equal(v_pool[1, 1], k[0]), "the V pool (v_pool) holds k's rows: write v into v_cache and k into k_cache (the K pool, k_pool)"
    assert torch.equal(k_pool[1, 1], k[0]) and torch.equal(v_pool[1, 1], v[0]), "slot 5 = block 1, offset 1"
    assert torch.equal(k_pool[2, 0], k[2]), "slot 8 = block 2, offset 0"
    assert torch.equal(k_pool[3, 3], k[1]), "slot -1 (padding) goes to the pool's LAST slot"
    written = {(1, 1), (2, 0), (3, 3)}
    for b in range(4):
        for o in range(4):
            if (b, o) not in written:
                assert not k_pool[b, o].any(), f"slot {b * 4 + o} was not in slot_mapping but changed"


@hole("write_kv")
def test_write_kv_casts_rows_to_the_pools_dtype():
    k_pool = torch.zeros(2, 4, 1, 3, dtype=torch.bfloat16)  # 1 block + scratch, block_size 4, Hkv 1, D 3
    v_pool = torch.zeros_like(k_pool)
    k = torch.tensor([[[1.0 + 2 ** -10, 3.14159, -2.71828]], [[0.1, 0.2, 0.3]]])  # float32, not exact in bfloat16
    try:
        write_kv(k_pool, v_pool, k, -k, torch.tensor([1, 2]))
    except NotImplementedError:  # a RuntimeError too: the unfilled hole must say so itself
        raise
    except RuntimeError as exc:
        pytest.fail(f"float32 rows into a bfloat16 pool: write_kv must cast the rows to the pool's dtype "
                    f"(rows.to(pool.dtype)) before index_copy_; got RuntimeError: {exc}", pytrace=False)
    assert k_pool.dtype == torch.bfloat16, "the pool keeps its dtype"
    assert torch.equal(k_pool[0, 1:3], k.to(torch.bfloat16)) and torch.equal(v_pool[0, 1:3], (-k).to(torch.bfloat16)), \
        "slots 1 and 2 hold the rows rounded to the pool's dtype"


# ===================================================================== ReferenceBackend.forward
def pool_with_requests(lens, block_size=4, hkv=2, hq=4, d=8, seed=0, num_blocks=40):
    """Random K/V for each request written into scattered blocks; returns what an oracle needs."""
    g = torch.Generator().manual_seed(seed)
    backend = ReferenceBackend()
    cache = backend.allocate((num_blocks + 1, block_size, hkv, d), torch.float64, "cpu")
    free = torch.randperm(num_blocks, generator=g).tolist()
    reqs, tables, ks, vs = [], {}, [], []
    for i, (ctx, q_len) in enumerate(lens):
        r = req(f"r{i}", range(ctx + 1), computed=ctx - q_len)
        nb = -(-ctx // block_size)
        tables[r.request_id] = [free.pop() for _ in range(nb)]
        k = torch.randn(ctx, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(ctx, hkv, d, generator=g, dtype=torch.float64)
        slots = torch.tensor([tables[r.request_id][p // block_size] * block_size + p % block_size
                              for p in range(ctx)])
        write_kv(cache[0], cache[1], k, v, slots)
        reqs.append((r, q_len))
        ks.append(k)
        vs.append(v)
    batch = build_batch(reqs, tables, block_size)
    q = torch.randn(batch.input_ids.shape[0], hq, d, generator=g, dtype=torch.float64)
    return backend, cache, batch, q, ks, vs


@hole("ReferenceBackend.forward")
@pytest.mark.parametrize("window", [0, 3])
def test_reference_forward_matches_plain_attention_per_request(window):
    # mixed: a chunk of 5 after 6 cached, a decode at 9, a whole 7-token prompt, a decode at 1
    lens = [(11, 5), (10, 1), (7, 7), (2, 1)]
    backend, cache, batch, q, ks, vs = pool_with_requests(lens)
    out = backend.forward(q, cache, batch.meta, window=window)
    qsl = batch.meta.query_start_loc_cpu.tolist()

    def plain(w: int, kv=lambda i, ctx: (ks[i], vs[i])) -> torch.Tensor:
        """The oracle: chapter 5's attention on each request's own K/V (``kv``: what it reads instead)."""
        return torch.cat([causal_attention(q[qsl[i]:qsl[i + 1]], *kv(i, ctx), torch.arange(ctx)[ctx - t:],
                                           torch.arange(ctx), window=w) for i, (ctx, t) in enumerate(lens)])

    want, rows = plain(window), batch_rows(batch)

    def read_at(slot_of):  # request i's K/V read back from the pool at slot_of(table, p), p < ctx
        flat_k, flat_v = (pool.view(-1, *pool.shape[2:]) for pool in cache)

        def kv(i: int, ctx: int):
            table = batch.meta.block_table[i].tolist()
            slots = torch.tensor([slot_of(table, p) for p in range(ctx)])
            return flat_k[slots], flat_v[slots]
        return kv

    def cause(bad: list[int]) -> str:
        differ = sorted({rows[i][0] for i in bad})
        bs = batch.meta.block_size
        if window and torch.allclose(out, plain(0), atol=1e-10):
            return (f"the output equals attention WITHOUT the window: with window={window} a query at position q "
                    f"sees only keys at positions > q - {window} (pass window on to the attention)")
        if torch.allclose(out, plain(window, lambda i, ctx: (ks[i], ks[i])), atol=1e-10):
            return ("the output equals attention whose VALUES are the keys: the values come from the V pool "
                    "(cache[1]), the keys from the K pool (cache[0])")
        if torch.allclose(out, plain(window, read_at(lambda tb, p: tb[p // bs] + p % bs)), atol=1e-10):
            return (f"the output equals attention over K/V read at slot table[p // block_size] + p % block_size: a "
                    f"position's slot is table[p // block_size] * block_size + p % block_size (block_size {bs})")
        return (f"requests {differ} differ: request r's t queries are the LAST t positions of its seq_len-token "
                f"context (query i at seq_len - t + i), its keys are read through its block table"
                + (f", and with window={window} only keys at positions > q - {window} count" if window else ""))

    assert_rows_close(out, want, f"ReferenceBackend.forward (window={window}) against plain causal attention",
                      atol=1e-10, rows=rows, cause=cause)


@hole("ReferenceBackend.forward")
def test_reference_forward_uses_the_callers_scale():
    lens = [(11, 5), (10, 1)]
    backend, cache, batch, q, ks, vs = pool_with_requests(lens)
    qsl = batch.meta.query_start_loc_cpu.tolist()
    want = torch.cat([causal_attention(q[qsl[i]:qsl[i + 1]], ks[i], vs[i], torch.arange(ctx)[ctx - t:],
                                       torch.arange(ctx), scale=0.9) for i, (ctx, t) in enumerate(lens)])
    out = backend.forward(q, cache, batch.meta, scale=0.9)
    assert_rows_close(out, want, "ReferenceBackend.forward(scale=0.9) against plain causal attention with that scale",
                      atol=1e-10, rows=batch_rows(batch),
                      cause=lambda bad: "pass the caller's scale on to causal_attention (its default is 1/sqrt(D), "
                                        "here 0.354, not the 0.9 asked for)")


@hole("ReferenceBackend.forward")
def test_reference_forward_leaves_padding_rows_zero():
    backend = ReferenceBackend()
    cache = backend.allocate((5, 4, 2, 8), torch.float64, "cpu")
    cache[0].normal_(generator=torch.Generator().manual_seed(0))
    cache[1].normal_(generator=torch.Generator().manual_seed(1))
    r = req("r0", range(7), computed=4)
    batch = build_batch([(r, 2)], [list(range(2))], 4, pad_to=3)
    q = torch.randn(4, 4, 8, dtype=torch.float64)
    out = backend.forward(q, cache, batch.meta)
    assert not out[2:].any(), "rows of seq_len 0 are padding and must stay zero"
    assert out[:2].abs().sum() > 0, 'real rows attend to something'


# ===================================================================== FlatModel
def run_flat(model, prompt, chunks, block_size=4, flat: FlatModel | None = None):
    """Run one prompt through FlatModel (``flat``, or a new one) in the given chunk sizes; returns each
    step's logits of all rows."""
    flat = flat or FlatModel(model)
    layers, hkv, d = flat.kv_spec()
    backend = ReferenceBackend()
    nb = -(-len(prompt) // block_size)
    caches = [backend.allocate((nb + 3, block_size, hkv, d), torch.float64, "cpu") for _ in range(layers)]
    table = list(range(nb + 2))[::-1][:nb]  # scattered, reversed block order
    r = req("r", prompt)
    outs = []
    for n in chunks:
        batch = build_batch([(r, n)], [table], block_size)
        hidden = flat.forward(batch.input_ids, batch.positions, caches, batch.meta, backend)
        outs.append(flat.compute_logits(hidden))
        r.num_computed_tokens += n
    return outs, caches, table


@hole("FlatModel.attention")
def test_flat_attention_writes_rotated_k_and_matches_plain_attention():
    model = model64()
    flat = FlatModel(model)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, model.cfg.hidden_size, generator=g, dtype=torch.float64)
    pos = torch.arange(6)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta, torch.float64)
    backend = ReferenceBackend()
    cache = backend.allocate((4, 4, model.cfg.num_key_value_heads, model.cfg.head_dim), torch.float64, "cpu")
    batch = build_batch([(req("r", range(7)), 6)], [[2, 0]], 4)
    out = flat.attention(attn, x, cos, sin, cache, batch.meta, backend)
    # oracle: the same layer computed by hand, contiguous, no pool
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(6, hq, d)), cos, sin)
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(6, hkv, d)), cos, sin)
    v = attn.v_proj(x).view(6, hkv, d)
    want = attn.o_proj(causal_attention(q, k, v, pos, pos).reshape(6, -1))
    slots = [("r", p) for p in range(6)]

    def cause(bad: list[int]) -> str:
        k_pool, v_pool = torch.cat([cache[0][2], cache[0][0, :2]]), torch.cat([cache[1][2], cache[1][0, :2]])
        if torch.allclose(k_pool, v, atol=1e-10) and torch.allclose(v_pool, k, atol=1e-10):
            return ("the K pool holds v and the V pool holds k: write them in that order, "
                    "backend.write(kv_cache, k, v, meta)")
        return ("the pool must hold this step's K/V before attention reads it; q and k get the per-head RMSNorm, "
                "then RoPE at each row's position; scale=attn.scale; then o_proj")

    assert_rows_close(out, want, "FlatModel.attention against q/k-norm, RoPE, causal attention and o_proj by hand",
                      atol=1e-10, rows=batch_rows(batch), cause=cause)
    assert_rows_close(torch.cat([cache[0][2], cache[0][0, :2]]), k, "the K pool at the request's slots", rows=slots,
                      atol=1e-10, cause="the pool must hold k AFTER q/k-norm and RoPE, at the slots of the block table")
    assert_rows_close(torch.cat([cache[1][2], cache[1][0, :2]]), v, "the V pool at the request's slots", rows=slots,
                      atol=1e-10, cause="the V pool holds v (not k) at the slots of the block table")


@hole("FlatModel.attention")
def test_flat_attention_uses_the_models_sliding_window():
    model = tiny_model(seed=0, dtype=torch.float64, sliding_window=3)
    prompt = prompts([13], seed=5)[0]
    outs, _, _ = run_flat(model, prompt, [6, 7])
    got, want = torch.cat(outs), model(torch.tensor(prompt))
    unwindowed = tiny_model(seed=0, dtype=torch.float64)(torch.tensor(prompt))  # the same weights, no window

    def cause(bad: list[int]) -> str:
        if torch.allclose(got, unwindowed, atol=1e-9):
            return ("the logits equal the model WITHOUT its sliding window: with sliding_window=3 a query sees only "
                    "the last 3 positions, so pass window=self.cfg.sliding_window (and scale=attn.scale) to "
                    "backend.forward")
        return ("with sliding_window=3 a query sees only the last 3 positions (window=self.cfg.sliding_window and "
                "scale=attn.scale to backend.forward); the rows of the second chunk (positions 6..12) read the "
                "first chunk's K/V back from the pool")

    assert_rows_close(got, want, "FlatModel logits of a sliding-window model (chunks of 6 and 7) against the "
                      "model's own forward", rows=[("r", p) for p in range(len(prompt))], cause=cause)


class RecordingBackend(ReferenceBackend):
    """The reference backend, recording each ``write`` it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def write(self, cache, k, v, meta) -> None:
        self.writes.append((k.clone(), v.clone()))
        super().write(cache, k, v, meta)


@hole("FlatModel.attention")
def test_flat_attention_writes_through_the_backend():
    model = model64()
    flat, attn = FlatModel(model), model.model.layers[0].self_attn
    x = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(5), model.cfg.head_dim, model.cfg.rope_theta, torch.float64)
    backend = RecordingBackend()
    cache = backend.allocate((3, 4, model.cfg.num_key_value_heads, model.cfg.head_dim), torch.float64, "cpu")
    batch = build_batch([(req("r", range(6)), 5)], [[1, 0]], 4)
    flat.attention(attn, x, cos, sin, cache, batch.meta, backend)
    _, k, v = attn.qkv(x, cos, sin)
    assert len(backend.writes) == 1, \
        f"FlatModel.attention must write this step's K/V through backend.write(kv_cache, k, v, meta), once " \
        f"(a backend may keep its own pool layout; write_kv is the reference backend's); it was called " \
        f"{len(backend.writes)} times"
    assert torch.equal(backend.writes[0][0], k) and torch.equal(backend.writes[0][1], v), \
        "backend.write gets k (after q/k-norm and RoPE) and v, in that order"


@hole("FlatModel.forward")
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_flat_forward_equals_the_models_own_forward(moe):
    model = model64(moe)
    prompt = prompts([13], seed=5)[0]
    flat, rope_dtypes = FlatModel(model), set()
    attention = flat.attention  # recorded on the way through: the dtype of the RoPE tables forward built
    flat.attention = lambda attn, x, cos, sin, *rest: rope_dtypes.add(cos.dtype) or attention(attn, x, cos, sin, *rest)
    (logits,), _, _ = run_flat(model, prompt, [13], flat=flat)
    want = model(torch.tensor(prompt))

    def cause(bad: list[int]) -> str:
        if rope_dtypes - {torch.float64}:
            return (f"the RoPE tables (cos, sin) handed to attention are {sorted(map(str, rope_dtypes))} in a float64 "
                    "model: build them in the hidden states' dtype, rope_cos_sin(positions, head_dim, rope_theta, "
                    "hidden.dtype) (float32 tables cost float32's precision everywhere after)")
        with torch.no_grad():
            if torch.allclose(logits, model(torch.arange(13)), atol=1e-9):
                return ("the logits equal the model's on the tokens 0..12, the rows' POSITIONS: embed the rows' token "
                        "ids (embed_tokens(input_ids)), not their positions")
            before_norm = []
            hook = model.model.norm.register_forward_hook(lambda mod, args, out: before_norm.append(args[0]))
            try:
                model(torch.tensor(prompt))
            finally:
                hook.remove()
            if torch.allclose(logits, flat.compute_logits(before_norm[-1]), atol=1e-9):
                return ("the logits equal the LM head on hidden + residual BEFORE the final norm: return the normed "
                        "output of the last add_norm (the model's final norm over hidden + residual)")
        return ("each layer: input norm, attention on ITS OWN pool, residual add, post-attention norm, MLP (or MoE), "
                "residual; then the final norm over hidden + residual")

    assert_rows_close(logits, want, f"FlatModel.forward ({'Qwen3-MoE' if moe else 'Qwen3'}, one 13-token pass) against "
                      "the model's own forward", rows=[("r", p) for p in range(13)], cause=cause)


@hole("FlatModel.forward")
def test_flat_forward_in_chunks_equals_one_pass():
    model = model64()
    prompt = prompts([13], seed=6)[0]
    outs, _, _ = run_flat(model, prompt, [5, 4, 3, 1])
    want = model(torch.tensor(prompt))

    def cause(bad: list[int]) -> str:
        if min(bad) >= 5:  # the first chunk (positions 0..4 = row numbers 0..4) is right
            return ("the first chunk (positions 0-4) is right and later chunks are wrong. In the first chunk each "
                    "row's number equals its position, so suspect what is right only then: RoPE must use "
                    "`positions` (row i is at position c + i), not the row number; and a later chunk must attend "
                    "to the earlier chunks' K/V read back from the pool")
        return "the first chunk is already wrong: see test_flat_forward_equals_the_models_own_forward"

    assert_rows_close(torch.cat(outs), want, "FlatModel.forward in chunks of 5, 4, 3, 1 against one pass of the model",
                      rows=[("r", p) for p in range(13)], cause=cause)


# ===================================================================== hash_block
@hole("hash_block")
def test_hash_block_is_blake2b_over_parent_and_int64_tokens():
    parent = bytes(range(16))
    tokens = [1, 2, 3, 70000]
    want = hashlib.blake2b(parent + struct.pack("<4q", *tokens), digest_size=16).digest()
    assert hash_block(parent, tokens) == want, \
        "digest = BLAKE2b-128 over the parent digest then the tokens as little-endian int64"


@hole("hash_block")
def test_hash_block_first_block_known_answers():
    from engine.serve.blocks import ROOT_HASH, encode_cache_key

    tokens = [7, 0, 65535, 2**40]
    want = hashlib.blake2b(ROOT_HASH + struct.pack("<4q", *tokens), digest_size=16).digest()
    assert hash_block(None, tokens) == want, \
        "the first block (parent None) hashes ROOT_HASH, then its tokens as little-endian int64: " \
        f"want {want.hex()}, got {hash_block(None, tokens).hex()}"
    key = ("tenant-a", 3)
    want_key = hashlib.blake2b(ROOT_HASH + struct.pack("<4q", *tokens) + b"\x00extra\x00" + encode_cache_key(key),
                               digest_size=16).digest()
    assert hash_block(None, tokens, key) == want_key, \
        "with a non-empty extra the digest goes on over b'\\x00extra\\x00' then encode_cache_key(extra): " \
        f"want {want_key.hex()}, got {hash_block(None, tokens, key).hex()}"


@hole("hash_block")
def test_hash_block_depends_on_parent_tokens_and_extra():
    base = hash_block(None, [1, 2, 3, 4])
    assert isinstance(base, bytes) and len(base) == 16, 'a 16-byte digest (bytes)'
    assert hash_block(None, [1, 2, 3, 4]) == base, "must be deterministic"
    assert hash_block(None, [1, 2, 3, 5]) != base, 'changing a token changes the digest'
    assert hash_block(base, [1, 2, 3, 4]) != base, "the parent is part of the name"
    assert hash_block(None, [1, 2, 3, 4], ("tenant-a",)) != base, 'a non-empty extra (cache_key) changes the digest'
    assert hash_block(None, [1, 2, 3, 4], ("tenant-a",)) != hash_block(None, [1, 2, 3, 4], ("tenant-b",)), \
        'different cache keys give different digests'
    assert hash_block(None, [1, 2, 3, 4], ()) == base, "empty extra changes nothing"


_HASH_IN_A_CHILD = """import sys
from engine.serve.blocks import hash_block
print(" ".join(hash_block(p, t, e).hex() for p, t, e in eval(sys.argv[1])))
"""


@hole("hash_block")
def test_hash_block_is_the_same_in_every_process():
    cases = [(None, [1, 2, 3, 4], ("tenant-a",)), (bytes(range(16)), [5, 6], ("adapter", 7, b"img"))]
    here = " ".join(hash_block(p, t, e).hex() for p, t, e in cases)
    # Python's hash() of a str differs between this process and a child with another PYTHONHASHSEED
    for seed in ["2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"]:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        res = subprocess.run([sys.executable, "-c", _HASH_IN_A_CHILD, repr(cases)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip() == here, (
            f"hash_block gives another digest in a process with PYTHONHASHSEED={seed}: a cache_key must be "
            "encoded with encode_cache_key() (tags and lengths, no repr), never Python's hash(), which changes from process to process")


# ===================================================================== BlockManager
def published(bm: BlockManager, r: Request, n: int) -> list[int]:
    """Allocate n tokens for r, mark them computed and published; returns its table."""
    assert bm.allocate_slots(r, n), 'helper: the allocation must succeed here'
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)
    return bm.req_blocks[r.request_id]


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_stops_at_first_miss():
    bm = BlockManager(16, 4)
    a = req("a", range(12))
    published(bm, a, 12)
    b = req("b", list(range(8)) + [99, 99, 99, 99, 5])
    found = bm.find_cached_prefix(b)
    assert b.block_hashes, \
        "find_cached_prefix must first fill in request.block_hashes with self.update_hashes(request)"
    assert found == bm.req_blocks["a"][:2], \
        "a's first two blocks match b's; b's third block differs: stop there"
    c = req("c", [7, 7, 7, 7] + list(range(4, 13)))
    assert bm.find_cached_prefix(c) == [], "block 1 matches a's tokens but its parent differs: no match"


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_stops_at_a_miss_even_when_later_blocks_are_cached():
    bm = BlockManager(16, 4)
    ta = published(bm, req("a", range(12)), 12)
    bm._evict(ta[1])  # block 1 lost its hash (what allocate_slots does to a block it hands out again)
    assert bm.find_cached_prefix(req("b", list(range(12)) + [5])) == [ta[0]], \
        "block 1 is a miss, so the prefix ends there although block 2's hash is still cached: going on past " \
        "a miss (continue instead of break) adopts block 2 without the K/V of block 1 in front of it"


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_never_matches_the_block_of_the_last_token():
    bm = BlockManager(16, 4)
    published(bm, req("a", range(12)), 12)
    b = req("b", range(8))  # two full blocks, both cached
    found = bm.find_cached_prefix(b)
    assert len(b.block_hashes) == 2, \
        "find_cached_prefix must first fill in request.block_hashes with self.update_hashes(request)"
    too_long = "the block holding the prompt's last token must run: its logits choose the first output"
    too_short = "the match is too SHORT: only the block of the LAST token is left out, at most (num_tokens - 1) // " \
                "block_size blocks (7 // 4 = 1 here; not num_tokens // block_size - 1)"
    assert found == bm.req_blocks["a"][:1], too_long if len(found) > 1 else too_short
    found = bm.find_cached_prefix(req("c", range(9)))
    assert found == bm.req_blocks["a"][:2], \
        "9 tokens: the last token is in block 2, so blocks 0 and 1 can match: (num_tokens - 1) // block_size = 8 // 4 " \
        "= 2 (num_tokens // block_size - 1 = 1 leaves out a full block that does not hold the last token)" \
        if len(found) < 2 else too_long


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_counts_queries_and_hits_and_respects_switches():
    bm = BlockManager(16, 4)
    published(bm, req("a", range(12)), 12)
    bm.num_queries = bm.num_hits = 0
    assert len(bm.find_cached_prefix(req("b", range(10)))) == 2, \
        '10 tokens: blocks 0 and 1 cached (block 2 holds the last token)'
    assert (bm.num_queries, bm.num_hits) == (10, 8) and bm.hit_rate == 0.8, \
        "queries count the request's tokens (10), hits the matched tokens (8)"
    assert bm.find_cached_prefix(req("c", range(10), prompt_logprobs=0)) == [], \
        "prompt logprobs need every prompt row computed"
    off = BlockManager(16, 4, enable_prefix_caching=False)
    published(off, req("a", range(12)), 12)
    assert off.find_cached_prefix(req("b", range(10))) == [], 'with prefix caching off nothing is ever found'


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_counts_a_lookup_that_finds_nothing_and_skips_the_switches():
    bm = BlockManager(16, 4)
    assert bm.find_cached_prefix(req("a", range(10))) == [], "nothing is cached yet"
    assert (bm.num_queries, bm.num_hits) == (10, 0), \
        "a lookup that matches nothing still counts: its 10 tokens are queries, 0 hits (else the hit rate " \
        "only sees the lookups that hit)"
    published(bm, req("p", range(12)), 12)
    bm.find_cached_prefix(req("b", range(10), prompt_logprobs=0))
    assert (bm.num_queries, bm.num_hits) == (10, 0), \
        "a request that wants prompt logprobs returns [] at once and counts nothing"
    off = BlockManager(16, 4, enable_prefix_caching=False)
    b = req("b", range(10))
    off.find_cached_prefix(b)
    assert (off.num_queries, off.num_hits) == (0, 0), "with prefix caching off a lookup counts nothing"
    assert b.block_hashes == [], \
        "with prefix caching off it returns [] at once, BEFORE update_hashes: block_hashes is left as it was (empty)"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_is_all_or_nothing():
    bm = BlockManager(4, 4)
    a = req("a", range(10))
    assert bm.allocate_slots(a, 10) and len(bm.req_blocks["a"]) == 3, '10 tokens in blocks of 4 need 3 blocks'
    b = req("b", range(8))
    before = (bm.num_free, list(bm.free_queue), dict(bm.req_blocks), list(bm.ref_count))
    assert bm.allocate_slots(b, 8) is False, "b needs 2 blocks but 1 is free"
    assert (bm.num_free, list(bm.free_queue), dict(bm.req_blocks), list(bm.ref_count)) == before, \
        "a failed allocation must change nothing"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_grows_only_when_a_block_fills():
    bm = BlockManager(8, 4)
    r = req("r", range(6))
    assert bm.allocate_slots(r, 6) and len(bm.req_blocks["r"]) == 2, '6 tokens in blocks of 4 need 2 blocks'
    r.num_computed_tokens = 6
    assert bm.allocate_slots(r, 2) and len(bm.req_blocks["r"]) == 2, "tokens 6, 7 fit in block 1"
    r.num_computed_tokens = 8
    assert bm.allocate_slots(r, 1) and len(bm.req_blocks["r"]) == 3, "token 8 opens block 2"
    assert bm.req_blocks["r"] == [0, 1, 2], "new blocks come from the FRONT of the free queue"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_counts_adopted_cached_free_blocks():
    bm = BlockManager(4, 4)
    a = req("a", range(9))
    published(bm, a, 9)  # blocks 0, 1 full and cached, block 2 partial
    bm.free(a)
    assert bm.num_free == 4, 'after free every block is free (cached-free counts as free)'
    b = req("b", list(range(8)) + list(range(50, 62)))  # 20 tokens: 2 cached blocks + 12 new tokens
    cached = bm.find_cached_prefix(b)
    assert cached == [0, 1], "b's first two blocks are a's cached (now free) blocks 0 and 1"
    # 2 adopted (cached-free, so they leave the free queue) + 3 new = 5 > 4 blocks
    ok = bm.allocate_slots(b, 12, cached)
    got = len(bm.req_blocks.get("b", ()))
    assert ok is False or got >= 5, \
        "b's table must cover its 2 adopted blocks' 8 tokens PLUS the 12 new ones (num_computed_tokens + " \
        f"len(cached_blocks) * block_size + n = 20 tokens, 5 blocks); it got a table of {got} blocks: the total " \
        "leaves out the adopted blocks' tokens"
    assert ok is False, \
        "adopting a cached-FREE block takes it out of the free queue: it counts against what is left"
    assert bm.num_free == 4 and "b" not in bm.req_blocks, 'a failed allocation changes nothing'
    c = req("c", list(range(8)) + list(range(50, 58)))  # 16 tokens: 2 cached + 2 new = 4 blocks
    cached = bm.find_cached_prefix(c)
    assert bm.allocate_slots(c, 8, cached), '2 adopted + 2 new = 4 blocks: it fits exactly'
    assert bm.req_blocks["c"][:2] == [0, 1] and bm.num_free == 0, \
        'the adopted blocks come first in the table, and leave the free queue'
    assert bm.ref_count[0] == bm.ref_count[1] == 1, "an adopted block's ref_count goes from 0 to 1"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_bookkeeping_on_success():
    bm = BlockManager(8, 4)
    published(bm, req("a", range(12)), 12)
    b = req("b", list(range(8)) + [50, 51])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2 and "b" in bm.pending_lookups, \
        "find_cached_prefix finds a's two full blocks and records a pending lookup"
    assert bm.allocate_slots(b, 2, cached) and bm.req_blocks["b"][:2] == cached, \
        'b adopts the 2 cached blocks first, then gets a new one'
    assert bm.num_published.get("b") == 2, \
        "adopted blocks are published already: a first allocation sets num_published[rid] to their count"
    assert "b" not in bm.pending_lookups, \
        "an allocation that succeeds admits the request: drop its pending_lookups entry (its lookup stays counted)"
    c = req("c", range(100, 105))
    assert bm.allocate_slots(c, 5) and bm.num_published.get("c") == 0, \
        "a first allocation without adopted blocks sets num_published[rid] = 0"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_rejects_cached_blocks_for_a_request_that_holds_blocks():
    bm = BlockManager(8, 4)
    published(bm, req("a", range(12)), 12)
    b = req("b", list(range(8)) + [50, 51])
    assert bm.allocate_slots(b, 2), "b gets 3 fresh blocks"
    before = (list(bm.req_blocks["b"]), list(bm.ref_count), list(bm.free_queue), dict(bm.num_published))
    with pytest.raises(ValueError):
        bm.allocate_slots(b, 1, bm.req_blocks["a"][:2])
    assert (list(bm.req_blocks["b"]), list(bm.ref_count), list(bm.free_queue), dict(bm.num_published)) == before, \
        "cached_blocks are adopted at admission only: for a request that already holds blocks it is a " \
        "ValueError, and nothing changes"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_an_empty_table_holds_no_blocks():
    bm = BlockManager(8, 4)
    cached = published(bm, req("a", range(12)), 12)[:2]  # a's first two blocks, full and published
    b = req("b", list(range(8)) + [50, 51])
    assert bm.allocate_slots(b, 0) and bm.req_blocks.get("b") == [], "room for 0 tokens: b's entry exists, empty"
    try:
        ok = bm.allocate_slots(b, 2, cached)
    except ValueError as exc:
        pytest.fail(f"b's req_blocks entry exists but is empty, so b holds no blocks yet and may adopt cached "
                    f"blocks; allocate_slots raised ValueError: {exc}", pytrace=False)
    assert ok and bm.req_blocks["b"][:2] == cached and len(bm.req_blocks["b"]) == 3, \
        "b adopts a's two cached blocks, then one new block for its last 2 tokens"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_evicts_the_old_hash_of_a_reused_block():
    bm = BlockManager(2, 4)
    a = req("a", range(5))
    published(bm, a, 5)
    h0 = a.block_hashes[0]
    assert bm.cached[h0] == 0, "a's first block was published under its hash"
    bm.free(a)  # tail first: queue = [1, 0]
    b = req("b", range(100, 108))
    assert bm.allocate_slots(b, 8) and bm.req_blocks["b"] == [1, 0], \
        "b takes the queue's front: a's blocks freed tail first, so [1, 0]"
    assert h0 not in bm.cached and bm.block_hash[0] is None, \
        "a block handed out again loses its old hash, or a later request would adopt b's K/V as a's"
    assert bm.find_cached_prefix(req("c", range(9))) == [], \
        "the old hash is gone: nothing matches a's tokens any more"


@hole("BlockManager.cache_full_blocks")
def test_cache_full_blocks_publishes_only_full_blocks():
    bm = BlockManager(8, 4)
    r = req("r", range(10))
    assert bm.allocate_slots(r, 10), '10 tokens need 3 blocks out of 8'
    bm.cache_full_blocks(r, 10)
    t = bm.req_blocks["r"]
    assert len(r.block_hashes) == 2, \
        "cache_full_blocks must first fill in request.block_hashes with self.update_hashes(request)"
    assert set(bm.cached.values()) == {t[0], t[1]}, "10 tokens: blocks 0 and 1 are full, block 2 is not"
    assert bm.block_hash[t[0]] == r.block_hashes[0] and bm.block_hash[t[2]] is None, \
        "block_hash of a published block is the request's hash of that position; the partial block has none"


@hole("BlockManager.cache_full_blocks")
def test_cache_full_blocks_raises_num_published_to_the_full_blocks():
    bm = BlockManager(8, 4)
    r = req("r", range(14))
    assert bm.allocate_slots(r, 14), "14 tokens need 4 blocks out of 8"
    bm.cache_full_blocks(r, 6)
    assert bm.num_published["r"] == 1, "6 tokens: 1 full block published, so num_published['r'] == 1"
    bm.cache_full_blocks(r, 13)
    assert bm.num_published["r"] == 3, "13 tokens: blocks 0-2 are full, so num_published['r'] rises to 3"
    assert set(bm.cached.values()) == set(bm.req_blocks["r"][:3]), "and those 3 blocks are in the cache"
    bm.cache_full_blocks(r, 5)
    assert bm.num_published["r"] == 3, "num_published never goes down when called with fewer tokens"


@hole("BlockManager.cache_full_blocks")
def test_cache_full_blocks_defaults_to_computed_tokens_and_first_writer_wins():
    bm = BlockManager(8, 4)
    a, b = req("a", range(8)), req("b", range(8))
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8), 'both fit (4 of 8 blocks)'
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert list(bm.cached.values()) == [bm.req_blocks["a"][0]], "default: only the computed tokens count"
    b.num_computed_tokens = 8
    bm.cache_full_blocks(b)
    assert bm.cached[b.block_hashes[0]] == bm.req_blocks["a"][0], "first writer wins"
    assert bm.block_hash[bm.req_blocks["b"][0]] is None, "the duplicate stays private"
    assert bm.cached.get(b.block_hashes[1]) == bm.req_blocks["b"][1], \
        "b's second block is new to the cache: b publishes it (8 computed tokens fill 8 // 4 = 2 blocks: a block " \
        "is full once all block_size of its tokens count, not (n - 1) // block_size)"


@hole("BlockManager.free")
def test_free_returns_blocks_tail_first_so_shared_heads_are_evicted_last():
    bm = BlockManager(6, 4)
    a = req("a", range(12))
    published(bm, a, 12)
    ta = list(bm.req_blocks["a"])
    bm.free(a)
    assert list(bm.free_queue)[-3:] == ta[::-1], \
        "freed blocks join the BACK of the queue tail first: the last block is evicted before the first"
    b = req("b", range(100, 120))  # 5 blocks: the 3 never-used ones, then a's LAST two
    assert bm.allocate_slots(b, 20), 'b needs 5 blocks and 6 are free'
    assert bm.req_blocks["b"][3:] == [ta[2], ta[1]], "after the 3 never-used blocks come a's blocks, LAST first"
    assert bm.find_cached_prefix(req("c", range(12))) == [ta[0]], "a's first block (shared prefix) survives"


@hole("BlockManager.free")
def test_free_keeps_shared_blocks_and_rejects_double_free():
    bm = BlockManager(8, 4)
    a = req("a", range(9))
    published(bm, a, 9)
    b = req("b", range(9))
    cached = bm.find_cached_prefix(b)
    assert bm.allocate_slots(b, 1, cached), "b adopts a's 2 blocks and needs one more"
    shared = bm.req_blocks["a"][:2]
    bm.free(a)
    assert all(bm.ref_count[x] == 1 for x in shared) and not any(x in bm.free_queue for x in shared), \
        "a block another request still holds must stay in use"
    bm.free(b)
    assert bm.num_free == 8 and all(c == 0 for c in bm.ref_count), \
        'after both frees every block is free with ref_count 0'
    bm.req_blocks["b"] = shared  # simulate a stale table
    with pytest.raises(RuntimeError):
        bm.free(b)


@pytest.mark.given  # trim, reset and add are given complete: no hole of yours runs here
def test_trim_and_reset_prefix_cache():
    bm = BlockManager(8, 4)
    r = req("r", range(14))
    published(bm, r, 14)
    bm.trim(r, 5)
    assert len(bm.req_blocks["r"]) == 2 and bm.num_free == 6, \
        'trim to 5 tokens keeps 2 blocks (of 4 tokens), releasing the rest'
    bm.free(r)
    assert bm.cached and bm.reset_prefix_cache() == 3 and not bm.cached, \
        "reset_prefix_cache forgets the 3 cached-free blocks' hashes"
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


@hole("BlockManager.free")
def test_free_drops_the_requests_entries_even_without_blocks():
    bm = BlockManager(4, 4)
    a = req("a", range(12))
    published(bm, a, 12)  # 3 of 4 blocks held
    b = req("b", list(range(8)) + list(range(50, 60)))  # 2 cached blocks + 3 new: does not fit
    assert not bm.allocate_slots(b, 10, bm.find_cached_prefix(b)) and "b" in bm.pending_lookups, \
        "b doesn't fit; its lookup is pending"
    bm.free(b)  # b is aborted while it waits: it holds no blocks
    assert "b" not in bm.pending_lookups, \
        "free() must drop pending_lookups even for a request that holds no blocks (a waiting request aborted)"
    bm.free(a)
    assert "a" not in bm.req_blocks and "a" not in bm.num_published, \
        "free() must drop num_published too, or the entry outlives the request (the invariant checker flags it)"
    again = req("a", range(100, 112))
    published(bm, again, 12)
    assert len(bm.cached) >= 3 and bm.block_hash[bm.req_blocks["a"][0]] == again.block_hashes[0], \
        'the id reused after free publishes its own blocks again'


# ===================================================================== Scheduler
def sched(num_blocks=64, block_size=16, caching=True, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, caching))


def first_chunk_sizes(s: Scheduler, steps: int) -> list[int]:
    """Schedule ``steps`` steps (advancing after each); the n given to the first request of each."""
    sizes = []
    for _ in range(steps):
        plan = s.schedule()
        sizes.append(plan.scheduled[0][1])
        advance(plan)
    return sizes


def advance(plan, sample_token: int = 1) -> None:
    """What the engine does after a forward pass: count the tokens computed and append samples."""
    for r, n in plan.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens >= r.num_tokens:
            r.append(sample_token)


def preempt_b(mode: str = "recompute", extra: tuple = (), **cfg):
    """a (6 tokens: 2 blocks) and b (4 tokens: 1 block) fill a 3-block pool; a's growth then preempts
    b, the last running request. Returns (scheduler, a, b, the plan that preempted, b's table before)."""
    s = sched(num_blocks=3, block_size=4, preemption_mode=mode, **cfg)
    a, b = req("a", range(6), max_tokens=6), req("b", range(10, 14), max_tokens=8)
    for r in (a, b, *extra):
        s.add(r)
    advance(s.schedule())
    b_blocks = list(s.blocks.req_blocks["b"])
    for _ in range(3):
        plan = s.schedule()
        if plan.preempted:
            break
        advance(plan)
    return s, a, b, plan, b_blocks


@hole("Scheduler.schedule")
def test_schedule_chunks_a_long_prompt_under_the_budget():
    s = sched(num_blocks=400, max_num_batched_tokens=2048)
    long = req("long", [3] * 5000, max_tokens=4)
    s.add(long)
    assert first_chunk_sizes(s, 3) == [2048, 2048, 904], "chunked prefill falls out of the budget: 2,048 + 2,048 + 904"
    assert long.num_output_tokens == 1, 'after 5,000 prompt tokens the request has sampled its first token'


@hole("Scheduler.schedule")
def test_schedule_runs_running_requests_first_and_shares_the_step():
    s = sched(max_num_batched_tokens=64)
    a = req("a", range(10), max_tokens=8)
    s.add(a)
    advance(s.schedule())  # a: whole prompt, now decoding
    b = req("b", range(100, 200), max_tokens=8)
    s.add(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 63)], \
        "the running decode goes first (1 token); the newcomer gets the rest of the budget"


@hole("Scheduler.schedule")
def test_schedule_an_admission_leaves_waiting_from_the_front_and_publishes_its_steps_blocks():
    s = sched(num_blocks=8, block_size=4, max_num_seqs=1)
    a, b = req("a", range(9), max_tokens=2), req("b", range(50, 53), max_tokens=2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 9)], "max_num_seqs=1: at most one request runs, so only a is admitted (b waits)"
    assert s.waiting == [b] and s.running == [a], \
        "the admitted request is the FRONT of waiting (waiting[0]) and leaves it from there; b, behind it, " \
        f"still waits; got waiting {[r.request_id for r in s.waiting]}"
    assert s.blocks.num_published.get("a") == 2 and len(s.blocks.cached) == 2, \
        "after a's allocation the scheduler publishes the blocks its step will fill (num_computed_tokens + n = 9 " \
        "tokens: 2 full blocks), in the plan itself, not only those computed so far (none)"


@hole("Scheduler.schedule")
def test_schedule_caps_chunks_at_the_threshold():
    s = sched(max_num_batched_tokens=100, long_prefill_token_threshold=16)
    s.add(req("a", range(40), max_tokens=2))
    s.add(req("b", range(50, 90), max_tokens=2))
    plan = s.schedule()
    assert [n for _, n in plan.scheduled] == [16, 16], \
        "both newcomers' chunks are capped at long_prefill_token_threshold=16"


@hole("Scheduler.schedule")
def test_schedule_without_chunking_waits_for_room_for_the_whole_prompt():
    s = sched(max_num_batched_tokens=40, enable_chunked_prefill=False)
    s.add(req("a", range(30), max_tokens=2))
    s.add(req("b", range(100, 120), max_tokens=2))
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 30)], "b's 20 tokens don't fit the 10 left"
    with pytest.raises(ValueError, match="chunked prefill"):
        s.add(req("c", range(41)))


@hole("Scheduler.schedule")
def test_schedule_without_chunking_a_prompt_that_waits_blocks_the_queue():
    s = sched(max_num_batched_tokens=40, enable_chunked_prefill=False)
    a, b, c = req("a", range(30), max_tokens=2), req("b", range(100, 120), max_tokens=2), req("c", range(50, 55))
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 30)] and s.waiting == [b, c], \
        "b's 20 tokens don't fit the 10 left, so admission stops at b: c (5 tokens) waits behind it " \
        "(first come, first served), it is not admitted ahead of b"


@hole("Scheduler.schedule")
def test_schedule_without_chunking_chunks_a_resumed_history_longer_than_the_budget():
    s = sched(num_blocks=16, block_size=4, caching=False, max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = req("a", range(6), max_tokens=10)
    s.add(a)
    for _ in range(5):  # the 6-token prompt, then 4 decodes: 11 tokens, 10 computed
        advance(s.schedule())
    assert (a.num_tokens, a.num_computed_tokens) == (11, 10), "setup: a has 5 outputs"
    s._preempt(a, SchedulerOutput())  # recompute: its K/V is forgotten, its whole history must run again
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 8)], \
        "with chunked prefill off, a resumed request whose 11-token history exceeds the WHOLE budget (8) can " \
        "never fit: it is chunked (8 now, the rest next step) instead of waiting forever"
    advance(plan)
    assert [(r.request_id, n) for r, n in s.schedule().scheduled] == [("a", 3)], "then the remaining 3 tokens"


@hole("Scheduler.schedule")
def test_schedule_a_blocked_head_of_the_queue_blocks_those_behind_it():
    s = sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = req("a", range(8), max_tokens=8)
    s.add(a)
    advance(s.schedule())  # a holds 2 blocks; its decode at position 8 takes a third
    b, c = req("b", range(100, 112), max_tokens=1), req("c", range(200, 203), max_tokens=1)
    s.add(b)  # needs 3 blocks: only 1 is left
    s.add(c)  # needs 1 block: it would fit
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1)] and s.waiting == [b, c], \
        "the head of the queue (b) doesn't fit, so admission stops there: c waits behind it although its one " \
        "block would fit (first come, first served; skipping ahead would starve b)"
    assert "c" not in s.blocks.req_blocks, "c is not admitted, so it holds no blocks"


@hole("Scheduler.schedule")
def test_schedule_a_request_resumed_after_recompute_looks_up_its_prefix_again():
    s = sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = req("a", range(8), max_tokens=6)  # 2 blocks
    b = req("b", range(10, 15), max_tokens=8)  # 5 tokens: 2 blocks, the first one full (published)
    s.add(a)
    s.add(b)
    advance(s.schedule())  # the pool is full
    plan = s.schedule()  # a's decode at position 8 needs a third block: b is preempted (recompute)
    assert plan.preempted == [b] and b.num_computed_tokens == 0, "setup: b is preempted by recompute"
    s.finish(a, Status.FINISHED_LENGTH)
    assert (s.blocks.num_queries, s.blocks.num_hits) == (13, 0), "setup: a's 8 and b's 5 tokens looked up, no hit"
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 2)] and b.num_computed_tokens == 4, \
        "b was preempted by recompute (nothing computed), so on readmission it starts after its longest cached " \
        "prefix: its own first block is still cached, so it resumes at token 4 and computes 2 (skipping the " \
        "lookup for a request that was admitted before recomputes everything)"
    assert (s.blocks.num_queries, s.blocks.num_hits) == (19, 4), \
        "the readmission's lookup counts: 6 more tokens queried, 4 hit (hit rate 4/19)"
    assert b.num_cached_tokens == 0 and b.admitted, \
        "num_cached_tokens is what the FIRST admission found (0); a readmission must not overwrite it " \
        "(only set it while admitted is still False)"


@hole("Scheduler.schedule")
def test_schedule_respects_max_num_seqs():
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["r0", "r1"], 'max_num_seqs=2: only two requests run'


@hole("Scheduler.schedule")
def test_schedule_priority_policy_admits_lowest_value_first():
    s = sched(policy="priority", max_num_seqs=2)
    for rid, prio, t in (("low", 5, 1.0), ("high", 0, 2.0), ("mid", 1, 0.5)):
        r = req(rid, range(5), max_tokens=3)
        r.priority, r.arrival_time = prio, t
        s.add(r)
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["high", "mid"], \
        'priority policy: lowest priority value first (high 0, mid 1), then arrival'


@hole("Scheduler.schedule")
def test_schedule_starts_a_request_after_its_cached_prefix():
    s = sched(block_size=4)
    a = req("a", range(20), max_tokens=2)
    s.add(a)
    advance(s.schedule())
    b = req("b", list(range(12)) + [99, 98, 97], max_tokens=2)
    s.add(b)
    plan = s.schedule()
    (rb, n), = [(r, n) for r, n in plan.scheduled if r is b]
    assert (b.num_computed_tokens, n, b.num_cached_tokens) == (12, 3, 12), \
        "3 cached blocks: b starts at token 12 and computes the 3 after them"
    assert s.blocks.req_blocks["b"][:3] == s.blocks.req_blocks["a"][:3], "b adopts a's first 3 blocks"


@hole("Scheduler.schedule")
def test_schedule_shares_blocks_published_at_allocation_in_the_same_step():
    s = sched(block_size=4)
    a = req("a", range(20), max_tokens=2)
    b = req("b", list(range(16)) + [7], max_tokens=2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 20), ("b", 1)], \
        "a's blocks are published when allocated, so b (admitted later in the same step) adopts 4 of them"
    assert s.blocks.req_blocks["b"][:4] == s.blocks.req_blocks["a"][:4], \
        "b adopts a's 4 blocks published in this same step"


@hole("Scheduler.schedule")
def test_schedule_never_preempts_to_admit():
    s = sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = req("a", range(8), max_tokens=8)
    s.add(a)
    advance(s.schedule())  # a holds 2 blocks (8 tokens computed + 1 sampled)
    b = req("b", range(100, 112), max_tokens=1)  # needs 3 blocks, 2 are free
    s.add(b)
    for _ in range(3):  # a keeps decoding; b waits, however long
        plan = s.schedule()
        assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1)] and not plan.preempted, \
            "a waiting request that doesn't fit waits; running requests are never preempted to admit it"
        assert s.waiting == [b] and "b" not in s.blocks.req_blocks, "a failed admission holds no blocks"
        advance(plan)


@hole("Scheduler.schedule")
def test_schedule_admits_nothing_in_a_step_that_preempted():
    # priority policy, so the waiting newcomer c (priority 1) sits AHEAD of the victim b (priority 5)
    s = sched(num_blocks=4, block_size=4, max_num_seqs=2, policy="priority")
    a = req("a", range(8), max_tokens=8)
    b = req("b", range(100, 108), max_tokens=8)
    a.priority, a.arrival_time, b.priority, b.arrival_time = 0, 0.0, 5, 1.0
    s.add(a)
    s.add(b)
    advance(s.schedule())  # a and b hold 2 blocks each: the pool is full
    c = req("c", range(200, 202), max_tokens=2)
    c.priority, c.arrival_time = 1, 2.0
    s.add(c)
    plan = s.schedule()  # a's 9th token needs a block: b is preempted, which frees 2
    assert plan.preempted == [b], "the running request that doesn't fit is b, the last; it preempts itself"
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1)], \
        "a step that preempted admits no one, even a request that would fit in the freed blocks"


@hole("Scheduler.schedule")
def test_schedule_caps_a_running_prefill_at_the_threshold_every_step():
    s = sched(max_num_batched_tokens=100, long_prefill_token_threshold=16)
    a = req("a", range(40), max_tokens=2)
    s.add(a)
    assert first_chunk_sizes(s, 3) == [16, 16, 8], "the chunk cap applies to a running request's later chunks too"


@hole("Scheduler.schedule")
def test_schedule_inserts_an_admitted_request_into_running_in_order():
    s = sched(policy="priority", block_size=4)
    low = req("low", range(5), max_tokens=8)
    low.priority, low.arrival_time = 5, 0.0
    s.add(low)
    advance(s.schedule())
    high = req("high", range(100, 105), max_tokens=8)
    high.priority, high.arrival_time = 0, 1.0
    s.add(high)
    advance(s.schedule())  # low decodes, high is admitted
    assert s.running == [high, low], \
        "running stays sorted by order_key: insert an admitted request at its place (_insert_sorted), don't append"
    assert high.status is Status.RUNNING and high.admitted and high.num_cached_tokens == 0, \
        'on admission: status RUNNING, admitted set, num_cached_tokens recorded (0 here)'
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["high", "low"], "running requests go in rank order"


@hole("Scheduler.schedule")
def test_schedule_readmits_a_swapped_request_into_the_first_blocks_of_its_new_table():
    s, a, b, plan, _ = preempt_b("swap")
    assert plan.preempted == [b] and b.swapped_out and b.num_computed_tokens == 4, \
        'the pool is full: swap mode preempts b with its 4 computed tokens kept'
    s.finish(a, Status.FINISHED_LENGTH)
    plan = s.schedule()
    assert plan.swap_in == [(b, s.blocks.req_blocks["b"][:1])], \
        "the saved K/V of its 4 computed tokens go into the FIRST block of its new table"
    assert not b.swapped_out and b.status is Status.RUNNING and b.num_computed_tokens == 4, \
        "on readmission a swapped request keeps its computed tokens; clear swapped_out and set RUNNING"
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 1)] and s.running == [b], \
        'b resumes with its one pending token and is the only running request'


@hole("Scheduler.schedule")
def test_schedule_asks_nothing_of_a_request_at_max_tokens():
    s = sched()
    a = req("a", range(5), max_tokens=1)
    s.add(a)
    advance(s.schedule())
    assert a.num_output_tokens == 1, 'the whole prompt ran: one token sampled'
    assert s.schedule().scheduled == [], "a request whose output reached max_tokens asks for 0 tokens"


@hole("Scheduler._preempt")
def test_preempt_recompute_forgets_kv_and_requeues_at_the_front():
    s, a, b, plan, _ = preempt_b()
    assert plan.preempted == [b], "the LAST running request is the victim"
    assert b.status is Status.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1, \
        'recompute: PREEMPTED, nothing computed, one preemption counted on the request'
    assert "b" not in s.blocks.req_blocks and s.waiting[0] is b and b not in s.running, \
        'a preempted request holds no blocks, waits at the FRONT, and is no longer running'
    assert s.num_preemptions == 1, "the scheduler's num_preemptions counts every preemption (one here)"
    assert plan.swap_out == [], 'recompute mode copies nothing to the host'


@hole("Scheduler._preempt")
def test_preempt_swap_keeps_computed_tokens_and_lists_the_blocks():
    s, a, b, plan, b_blocks = preempt_b("swap")
    assert plan.swap_out == [(b, b_blocks)], "swap lists the victim's blocks covering its computed tokens"
    assert b.swapped_out and b.num_computed_tokens == 4 and "b" not in s.blocks.req_blocks, \
        'swap: swapped_out set, computed tokens kept, blocks freed'
    s.finish(a, Status.FINISHED_LENGTH)
    plan = s.schedule()
    assert plan.swap_in and plan.swap_in[0][0] is b and plan.swap_in[0][1] == s.blocks.req_blocks["b"][:1], \
        "on readmission the saved K/V go into the first blocks of its NEW table"
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 1)] and not b.swapped_out, \
        'b resumes with its pending token; swapped_out cleared on readmission'


@hole("Scheduler._preempt")
def test_preempt_swap_of_a_request_with_nothing_computed_keeps_nothing():
    s = sched(num_blocks=8, block_size=4, preemption_mode="swap")
    a = req("a", range(6), max_tokens=4)
    s.add(a)
    s.schedule()  # a is admitted and holds blocks, but its step never ran: nothing computed
    out = SchedulerOutput()
    s._preempt(a, out)
    assert out.swap_out == [] and not a.swapped_out and a.num_computed_tokens == 0, \
        "swap keeps K/V only for a request that has computed tokens; with none there is nothing to copy: " \
        "no swap_out entry and swapped_out stays False (it is readmitted like a recompute)"
    assert out.preempted == [a] and a.status is Status.PREEMPTED and s.waiting == [a] \
        and "a" not in s.blocks.req_blocks and s.num_preemptions == 1, \
        "it is still preempted: PREEMPTED, blocks freed, at the front of waiting, counted"


@hole("Scheduler._preempt")
def test_preempt_puts_the_victim_ahead_of_requests_already_waiting():
    c = req("c", range(20, 23), max_tokens=2)  # waits: max_num_seqs is 2
    s, a, b, plan, _ = preempt_b(extra=(c,), max_num_seqs=2)
    assert plan.preempted == [b], 'the last running request, b, is the victim'
    assert s.waiting == [b, c], "a preempted request goes back to the FRONT of the waiting queue"


@hole("Scheduler._preempt")
def test_preempt_priority_policy_picks_the_lowest_priority_and_requeues_by_priority():
    s = sched(num_blocks=3, block_size=4, policy="priority")
    a = req("a", range(3), max_tokens=8)  # 1 block
    b = req("b", range(10, 18), max_tokens=4)  # 2 full blocks
    a.priority, a.arrival_time, b.priority, b.arrival_time = 2, 0.0, 0, 1.0
    s.add(a)
    s.add(b)
    advance(s.schedule())
    mid, low = req("mid", range(30, 32), max_tokens=2), req("low", range(40, 42), max_tokens=2)
    mid.priority, mid.arrival_time, low.priority, low.arrival_time = 1, 2.0, 3, 0.5
    s.add(mid)
    s.add(low)
    plan = s.schedule()  # b's 9th token needs a third block: the pool is full
    assert plan.preempted == [a], \
        "the victim is the LOWEST-priority running request (a, priority 2), not the newest arrival (b)"
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 1)], 'b, the highest priority, keeps running'
    assert [r.request_id for r in s.waiting] == ["mid", "a", "low"], \
        "under the priority policy the victim is requeued at its (priority, arrival) place"


@pytest.mark.given  # trim, reset and add are given complete: no hole of yours runs here
def test_scheduler_add_rejects_requests_that_can_never_run():
    s = sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="exceeds the whole KV pool"):
        s.add(req("big", range(6), max_tokens=3))
    s.add(req("ok", range(4), max_tokens=4))
    with pytest.raises(ValueError, match="already"):
        s.add(req("ok", range(4), max_tokens=1))
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")


# ===================================================================== EngineCore
def core(config: EngineConfig | None = None, moe: bool = False, eos: int | None = None) -> EngineCore:
    return EngineCore(model64(moe), config or EngineConfig(), eos_token_id=eos)


@hole("EngineCore.check_stop")
def test_check_stop_rules():
    e = core(EngineConfig(max_model_len=12))
    def stop(tokens, prompt_len=4, eos=None, **p):
        r = req("r", tokens, prompt_len=prompt_len, **p)
        r.eos_token_id = eos
        status = e.check_stop(r)
        return status, r.stop_reason
    assert stop([1, 2, 3, 4, 9], eos=9) == (Status.FINISHED_STOPPED, None), \
        'EOS stops a request (with no stop_reason)'
    assert stop([1, 2, 3, 4, 9], eos=9, min_tokens=2) == (None, None), "EOS doesn't count before min_tokens"
    assert stop([1, 2, 3, 4, 9], eos=9, ignore_eos=True) == (None, None), 'ignore_eos: EOS is just a token'
    assert stop([1, 2, 3, 4, 5, 7], stop_token_ids=[7]) == (Status.FINISHED_STOPPED, 7), "stop_reason = the stop token"
    assert stop([1, 2, 3, 4, 7], stop_token_ids=[7], min_tokens=2) == (None, None), \
        "a stop token doesn't count before min_tokens"
    assert stop([1, 2, 3, 4, 5, 6], max_tokens=2) == (Status.FINISHED_LENGTH, None), \
        'max_tokens outputs -> FINISHED_LENGTH'
    assert stop([1, 2, 3, 4, 5], max_tokens=2) == (None, None), 'fewer than max_tokens outputs: not finished'
    assert stop(list(range(12)), prompt_len=10, max_tokens=50) == (Status.FINISHED_LENGTH, None), \
        "the context limit (max_model_len) ends a request too"


def stop_status(tokens, prompt_len=4, eos=None, max_model_len=12, **params):
    """check_stop on a request whose first ``prompt_len`` tokens are the prompt: (status, stop_reason)."""
    e = core(EngineConfig(max_model_len=max_model_len))
    r = req("r", tokens, prompt_len=prompt_len, **params)
    r.eos_token_id = eos
    return e.check_stop(r), r.stop_reason


@hole("EngineCore.check_stop")
def test_check_stop_min_tokens_boundary_is_inclusive():
    assert stop_status([1, 2, 3, 4, 5, 9], eos=9, min_tokens=2) == (Status.FINISHED_STOPPED, None), \
        "EOS as output number 2 with min_tokens=2: the output has at least min_tokens tokens, so it stops " \
        "(>= min_tokens, not > min_tokens)"
    assert stop_status([1, 2, 3, 4, 5, 7], stop_token_ids=[7], min_tokens=2) == (Status.FINISHED_STOPPED, 7), \
        "a stop token as output number 2 with min_tokens=2 stops (the boundary counts)"
    assert stop_status([1, 2, 3, 4, 7], stop_token_ids=[7], min_tokens=2) == (None, None), \
        "one output short of min_tokens=2: the stop token is just a token"


@hole("EngineCore.check_stop")
def test_check_stop_stop_rules_come_before_the_length_rules():
    assert stop_status([1, 2, 3, 4, 5, 7], stop_token_ids=[7], max_tokens=2) == (Status.FINISHED_STOPPED, 7), \
        "a stop token that is also the last token max_tokens allows finishes STOPPED with its stop_reason: " \
        "the docstring checks the stop rules before the length rules"
    assert stop_status([1, 2, 3, 4, 5, 9], eos=9, max_tokens=2) == (Status.FINISHED_STOPPED, None), \
        "EOS as the last token max_tokens allows finishes STOPPED, not LENGTH"
    assert stop_status(list(range(11)) + [7], prompt_len=10, stop_token_ids=[7], max_tokens=50) == \
        (Status.FINISHED_STOPPED, 7), "a stop token that reaches max_model_len finishes STOPPED too"


@hole("EngineCore.check_stop")
def test_check_stop_ignore_eos_keeps_stop_token_ids():
    assert stop_status([1, 2, 3, 4, 7], eos=9, stop_token_ids=[7], ignore_eos=True) == \
        (Status.FINISHED_STOPPED, 7), "ignore_eos switches off EOS only: stop_token_ids still stop the request"
    assert stop_status([1, 2, 3, 4, 9], eos=9, stop_token_ids=[7], ignore_eos=True) == (None, None), \
        "ignore_eos: EOS (not in stop_token_ids) is just a token"
    assert stop_status([1, 2, 3, 4, 9], eos=9, stop_token_ids=[9], ignore_eos=True) == \
        (Status.FINISHED_STOPPED, 9), "an EOS listed in stop_token_ids is a stop token, whatever ignore_eos says"
    assert stop_status([1, 2, 3, 4, 9], eos=9, stop_token_ids=[9]) == (Status.FINISHED_STOPPED, 9), \
        "stop_token_ids are checked before EOS: an EOS listed there sets stop_reason"


@hole("EngineCore.check_stop")
def test_check_stop_with_no_output_yet_finishes_nothing():
    assert stop_status([1, 2, 3, 9], eos=9) == (None, None), \
        "zero outputs: the prompt's last token is 9 (the EOS) but no output exists yet, so check_stop returns None"
    assert stop_status([1, 2, 3, 7], stop_token_ids=[7]) == (None, None), \
        "zero outputs: a prompt ending in a stop token finishes nothing"
    assert stop_status(list(range(12)), prompt_len=12) == (None, None), \
        "zero outputs: a prompt that fills max_model_len=12 finishes nothing either (check_stop returns None)"


@hole("EngineCore.check_stop")
def test_check_stop_eos_is_the_requests_own():
    e = core(EngineConfig(max_model_len=12), eos=5)  # the engine's default EOS: 5
    mine = req("r", [1, 2, 3, 4, 9], prompt_len=4)
    mine.eos_token_id = 9
    assert e.check_stop(mine) == Status.FINISHED_STOPPED, "the request's own eos_token_id (9) stops it"
    other = req("s", [1, 2, 3, 4, 5], prompt_len=4)
    other.eos_token_id = 9
    assert e.check_stop(other) is None, \
        "5 is the engine's default EOS, but this request's eos_token_id is 9: the EOS rule reads request.eos_token_id"


@hole("EngineCore.step")
def test_step_runs_one_forward_per_step_and_reports_only_produced_tokens():
    e = core(EngineConfig(max_num_batched_tokens=16, block_size=4))
    calls = []
    original = e.runner.flat.forward
    e.runner.flat.forward = lambda *a, **k: calls.append(a[0].shape[0]) or original(*a, **k)
    p = prompts([30], seed=8)[0]
    e.add_request("a", p, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    first = e.step()
    assert first == [], "a mid-prompt chunk reports nothing"
    assert calls == [16], "the first step runs one forward over the step's 16 tokens"
    e.step()
    out = e.step()
    assert len(calls) == 3, "one forward pass per step, whatever it holds"
    assert [o.request_id for o in out] == ["a"] and len(out[0].new_token_ids) == 1, \
        "the step that reaches the prompt's last token reports exactly one new token"
    rest = []
    for _ in range(4):  # 2 more tokens to sample; a few steps spare, never a loop that cannot end
        rest += e.step() if e.has_unfinished() else []
    assert rest and rest[-1].finished and rest[-1].finish_reason == "length", \
        "the output of the step in which a request finishes says so (finished, finish_reason 'length'): finish " \
        f"the request BEFORE building its output; got {rest[-1] if rest else None}"
    assert_same_tokens(rest[-1].output_token_ids, oracle(tuple(p), 3), "a", 30, 4)


@hole("EngineCore.step")
def test_step_with_an_empty_plan_returns_nothing_and_counts_no_step():
    e = core(EngineConfig(block_size=4))
    forwards = []
    original = e.runner.execute
    e.runner.execute = lambda batch: forwards.append(1) or original(batch)
    assert e.step() == [] and e.steps == 0, "an idle engine's step has an empty plan: it returns [] and counts no step"
    e.add_request("a", prompts([6], seed=17)[0], SamplingParams(max_tokens=2, **GREEDY))
    e.run_until_done()
    e.step()
    assert e.steps == len(forwards) == 2, \
        f"steps counts the steps that ran a forward pass (2 here), got {e.steps}: a step whose plan is empty " \
        "returns [] before the forward pass and is not counted"


@hole("EngineCore.step")
@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_step_that_fails_mid_forward_recovers_and_counts_no_step(fault):
    pa, pb = prompts([20, 9], seed=16)
    want = {"a": oracle(tuple(pa), 4), "b": oracle(tuple(pb), 4)}
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=12))
    for rid, p in (("a", pa), ("b", pb)):
        e.add_request(rid, p, SamplingParams(max_tokens=4, **GREEDY))
    e.step()  # a's first 12 tokens
    plans = []
    original = e.recover_failed_step
    e.recover_failed_step = lambda plan: plans.append(plan) or original(plan)

    def fail(module, args):
        raise fault("injected: the forward pass fails after layer 0 wrote its K/V")

    handle = e.model.model.layers[1].mlp.register_forward_pre_hook(fail)
    try:
        with pytest.raises(fault):
            e.step()
    finally:
        handle.remove()
    name = fault.__name__
    assert len(plans) == 1, \
        f"a {name} inside the forward pass must reach self.recover_failed_step(plan) before it propagates " \
        f"(called {len(plans)} times): catch BaseException, not Exception — Ctrl-C (KeyboardInterrupt) and " \
        "out-of-memory errors must leave the engine as if the step never ran"
    assert sorted(r.request_id for r, _ in plans[0].scheduled) == ["a", "b"], \
        "recover_failed_step gets the failed step's own plan (a's last 8 prompt tokens and b's first chunk)"
    assert e.steps == 1, f"a step that failed is not counted: steps must stay 1, got {e.steps}"
    done = run_checked(e, max_steps=60)
    for rid, p in (("a", pa), ("b", pb)):
        assert_same_tokens(done.get(rid, []), want[rid], rid, len(p), 4, f"after a failed step ({name}): ")


@hole("EngineCore.step")
def test_step_outputs_and_frees_finished_requests_at_once():
    p = prompts([9], seed=9)[0]
    want = oracle(tuple(p), 4)
    e = core(EngineConfig(block_size=4), eos=want[1])
    e.add_request("a", p, SamplingParams(max_tokens=4, temperature=0.0))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    last = outs[-1]
    assert (last.finished, last.finish_reason, last.output_token_ids) == (True, "stop", want[:2]), \
        "EOS ends the request (EOS included in the output)"
    assert last.num_cached_tokens == 0 and e.blocks.num_free == e.blocks.num_blocks, \
        'nothing came from the cache, and every block is free once the request finished'


@hole("EngineCore.step")
def test_step_n_children_share_the_prompt_blocks():
    p = prompts([40], seed=10)[0]
    e = core(EngineConfig(block_size=16))
    ids = e.add_request("p", p, SamplingParams(n=3, max_tokens=4, ignore_eos=True, temperature=0.0))
    assert ids == ["p:0", "p:1", "p:2"], 'n=3 becomes children p:0, p:1, p:2'
    e.step()
    tables = [e.blocks.req_blocks[i] for i in ids]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2], "children share the prompt's full blocks"
    assert e.blocks.ref_count[tables[0][0]] == 3, 'the three children hold the shared prompt block: ref_count 3'
    done = e.run_until_done()
    for i in ids:
        assert_same_tokens(done[i], oracle(tuple(p), 4), i, 40)


@hole("EngineCore.step")
def test_step_qwen3_moe_through_the_core():
    ps = prompts([7, 23, 35], seed=11)
    e = core(EngineConfig(block_size=8, max_num_batched_tokens=20), moe=True)
    for i, p in enumerate(ps):
        e.add_request(f"m{i}", p, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    done = e.run_until_done()
    for i, p in enumerate(ps):
        assert_same_tokens(done[f"m{i}"], oracle(tuple(p), 6, moe=True), f"m{i}", len(p), 8, "Qwen3-MoE: ")


@hole("EngineCore.step")
def test_step_abort_frees_everything():
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=8))
    e.add_request("a", prompts([20])[0], SamplingParams(max_tokens=5, seed=3, temperature=1.0))
    e.add_request("b", prompts([6], seed=2)[0], SamplingParams(max_tokens=5, temperature=0.0))
    e.step()
    e.abort_request("a")
    e.abort_request("nobody")  # harmless
    assert "a" not in e.blocks.req_blocks and "a" not in e.generators, \
        "an aborted request's blocks and generator are dropped at once"
    e.run_until_done()
    assert e.blocks.num_free == e.blocks.num_blocks and not e.scheduler.requests, \
        'at idle every block is free and no request is left'


@hole("EngineCore.step")
def test_step_prompt_logprobs_match_the_model():
    p = prompts([12], seed=12)[0]
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=5))
    e.add_request("a", p, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    outs = [o for _ in range(5) for o in e.step()]
    lp = outs[-1].prompt_logprobs
    with torch.no_grad():
        want = torch.log_softmax(model64()(torch.tensor(p)), -1)
    assert len(lp) == 11, 'a 12-token prompt has 11 prompt logprobs (one per token after the first)'
    for i, entry in enumerate(lp):
        assert math.isclose(entry[p[i + 1]], float(want[i, p[i + 1]]), abs_tol=1e-9), \
            'entry i is the log-probability of prompt token i + 1'


GREEDY = dict(ignore_eos=True, temperature=0.0)


@hole("EngineCore.step")
def test_step_takes_each_requests_tokens_from_its_own_sample_rows():
    # Step 1 runs a's first chunk (8 of 40 tokens: no sample row) AHEAD of b's and c's whole prompts
    # (one sample row each): the sampled tokens are [b's, c's] while b and c are requests 1 and 2.
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=20, long_prefill_token_threshold=8))
    pa, pb, pc = prompts([40, 5, 6], seed=13)
    for rid, p, m in (("a", pa, 3), ("b", pb, 6), ("c", pc, 6)):
        e.add_request(rid, p, SamplingParams(max_tokens=m, **{"temperature": 0.0, **GREEDY}))
    want = {"a": oracle(tuple(pa), 3), "b": oracle(tuple(pb), 6), "c": oracle(tuple(pc), 6)}
    first = {o.request_id: o.new_token_ids for o in e.step()}
    assert first == {"b": want["b"][:1], "c": want["c"][:1]}, (
        f"step 1 should report b's and c's first tokens {want['b'][:1]}, {want['c'][:1]}; got {first}. The sampler "
        "returns one token per SAMPLE ROW: request r takes the next sample_counts[r] tokens, not token number r "
        "(here a, first in the plan, is mid-prompt and has no sample row)")
    done = run_checked(e, max_steps=60)
    for rid, p in (("a", pa), ("b", pb), ("c", pc)):
        assert_same_tokens(done.get(rid, []), want[rid], rid, len(p), 4, "a decode behind a mid-prompt chunk: ")


@hole("EngineCore.step")
def test_step_prompt_logprobs_are_replaced_after_a_recompute_preemption():
    p = prompts([14], seed=14)[0]
    e = core(EngineConfig(block_size=4, num_blocks=6, max_num_batched_tokens=6))
    e.add_request("b", prompts([9], seed=15)[0], SamplingParams(max_tokens=14, **{"temperature": 0.0, **GREEDY}))
    e.add_request("a", p, SamplingParams(max_tokens=3, prompt_logprobs=0, **{"temperature": 0.0, **GREEDY}))
    final = {}
    while e.has_unfinished():
        final.update({o.request_id: o for o in e.step() if o.finished})
    assert e.preemptions >= 1, "the 6-block pool was meant to preempt a part-way through its prompt"
    lp = final["a"].prompt_logprobs
    assert len(lp) == len(p) - 1, \
        f"{len(lp)} prompt-logprob entries for a {len(p)}-token prompt: after a recompute preemption the prompt " \
        "runs again, and its entries must REPLACE the earlier ones (write from index c on), not be appended"
    with torch.no_grad():
        want = torch.log_softmax(model64()(torch.tensor(p)), -1)
    for i, entry in enumerate(lp):
        assert math.isclose(entry[p[i + 1]], float(want[i, p[i + 1]]), abs_tol=1e-9), f"entry {i} scores prompt token {i + 1}"


@hole("EngineCore.step")
def test_step_prompt_logprobs_of_a_one_token_prompt_is_an_empty_list():
    e = core(EngineConfig(block_size=4))
    e.add_request("a", [7], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
    (out,) = e.step()
    assert out.finished and out.prompt_logprobs == [], \
        "a one-token prompt has no prompt token to score: after its first step its prompt_logprobs is [] (asked " \
        f"for, nothing in it), not None; got {out.prompt_logprobs!r}"


@hole("EngineCore.step")
def test_step_runs_the_sampler_even_when_no_row_samples():
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=8))
    e.add_request("a", prompts([20], seed=9)[0], SamplingParams(max_tokens=1, **GREEDY))
    calls = []
    sampler = e.sampler
    e.sampler = lambda logits, reqs, generators: calls.append((logits.shape[0], list(reqs))) or \
        sampler(logits, reqs, generators)
    assert e.step() == [], "the first step runs 8 of 20 prompt tokens: no row samples, nothing to report"
    assert calls == [(0, [])], \
        f"the sampler runs in every step that ran a forward pass, with 0 rows when none samples; got calls {calls}"


# ===== gaps found by the bug corpus (course/quality/bug_corpus.py, docs/bug-corpus.md): bugs a learner made
# that once passed their hole's tests. Each test pins only what its hole's docstring states.
@hole("build_batch")
def test_build_batch_reads_a_mapping_of_any_type_and_order_by_request_id():
    import types

    scheduled, tables = worked_example()
    want = build_batch(scheduled, tables, 16)
    for other in ({rid: tables[rid] for rid in ("d", "c", "b", "a")},
                  types.MappingProxyType({rid: tables[rid] for rid in ("b", "d", "a", "c")})):
        got = build_batch(scheduled, other, 16)
        assert (got.meta.slot_mapping.tolist(), got.meta.block_table.tolist()) == \
            (want.meta.slot_mapping.tolist(), want.meta.block_table.tolist()), (
                f"block_tables given as a {type(other).__name__} in another order than the plan: a Mapping is "
                "looked up by request id (block_tables[req.request_id]), whatever its type or order")


@hole("write_kv")
def test_write_kv_slot_zero_is_a_real_slot():
    k_pool = torch.zeros(2 + 1, 4, 1, 2)  # 2 blocks + scratch, block_size 4
    v_pool = torch.zeros_like(k_pool)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    write_kv(k_pool, v_pool, k, -k, torch.tensor([0, PAD_SLOT]))
    assert torch.equal(k_pool[0, 0], k[0]) and torch.equal(v_pool[0, 0], -k[0]), \
        "slot 0 (block 0, offset 0) is a real slot: only PAD_SLOT (-1) marks a padding row"
    assert torch.equal(k_pool[2, 3], k[1]), "the padding row goes to the pool's very last slot"




@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_returns_the_blocks_the_cache_names():
    bm = BlockManager(16, 4)
    assert bm.allocate_slots(req("filler", range(500, 508)), 8), 'a filler takes blocks 0 and 1'
    ta = published(bm, req("a", range(12)), 12)
    assert ta == [2, 3, 4], "a's blocks are 2, 3, 4 (the free queue's front after the filler's)"
    assert bm.find_cached_prefix(req("b", range(10))) == [2, 3], \
        "the matched blocks are the ones the cache names for b's hashes (self.cached[h]), wherever they lie in the pool"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_failure_keeps_the_pending_lookup():
    bm = BlockManager(4, 4)
    published(bm, req("a", range(12)), 12)  # 3 of 4 blocks held
    b = req("b", list(range(8)) + list(range(50, 60)))  # 2 cached blocks + 3 new: does not fit
    cached = bm.find_cached_prefix(b)
    pending = dict(bm.pending_lookups)
    assert not bm.allocate_slots(b, 10, cached), 'b needs 3 new blocks and 1 is free'
    assert bm.pending_lookups == pending and "b" not in bm.req_blocks, \
        "a failed allocation changes nothing: b's pending lookup stays (only a SUCCESSFUL allocation drops it), " \
        "so b's next lookup replaces it instead of counting again"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_growth_keeps_num_published():
    bm = BlockManager(8, 4)
    r = req("r", range(9))
    published(bm, r, 8)  # 2 full blocks computed and published
    assert bm.num_published["r"] == 2, 'cache_full_blocks raised num_published to the 2 full blocks'
    assert bm.allocate_slots(r, 1) and len(bm.req_blocks["r"]) == 3, "token 8 opens block 2"
    assert bm.num_published["r"] == 2, \
        "only a request's FIRST allocation sets num_published[rid]; growing its table must leave it alone"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_counts_a_reused_blocks_old_hash_as_evicted():
    bm = BlockManager(2, 4)
    a = req("a", range(5))
    published(bm, a, 5)  # block 0 full and cached, block 1 partial (no hash)
    bm.free(a)
    assert bm.num_evicted == 0, 'freeing keeps the hash (cached-free): nothing evicted yet'
    assert bm.allocate_slots(req("b", range(100, 108)), 8), 'b takes both blocks'
    assert bm.num_evicted == 1 and not bm.cached, \
        "handing out a block that still had a hash evicts it through _evict, which counts it in num_evicted"


@hole("BlockManager.cache_full_blocks")
def test_cache_full_blocks_does_nothing_with_caching_off():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    r = req("r", range(10))
    assert bm.allocate_slots(r, 10), '10 tokens need 3 blocks out of 8'
    bm.cache_full_blocks(r, 10)
    assert not bm.cached and all(h is None for h in bm.block_hash), \
        "with prefix caching off, cache_full_blocks publishes nothing"


@hole("BlockManager.cache_full_blocks")
def test_cache_full_blocks_raises_num_published_and_starts_there():
    bm = BlockManager(8, 4)
    a, b = req("a", range(8)), req("b", range(8))
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 8), 'both fit (4 of 8 blocks)'
    bm.cache_full_blocks(a, 8)
    assert bm.num_published["a"] == 2, "num_published is raised to the number of full blocks published"
    bm.cache_full_blocks(b, 4)  # b's first block duplicates a's: it stays private
    assert bm.num_published["b"] == 1 and bm.block_hash[bm.req_blocks["b"][0]] is None, \
        'b offered its first block (a duplicate, kept private): num_published["b"] is 1'
    bm._evict(bm.req_blocks["a"][0])  # a's first block loses its hash (as if handed out again)
    bm.cache_full_blocks(b, 8)
    assert bm.block_hash[bm.req_blocks["b"][0]] is None and b.block_hashes[0] not in bm.cached, \
        "cache_full_blocks starts at num_published[rid]: a block already offered is not offered again"


@hole("BlockManager.free")
def test_free_releases_in_reverse_table_order_not_by_block_number():
    bm = BlockManager(4, 4)
    x = req("x", range(8))
    assert bm.allocate_slots(x, 8) and bm.allocate_slots(req("y", range(100, 104)), 4), 'x: 0, 1; y: 2'
    bm.free(x)  # queue: 3, 1, 0
    r = req("r", range(200, 212))
    assert bm.allocate_slots(r, 12) and bm.req_blocks["r"] == [3, 1, 0], "r takes the queue's front: 3, 1, 0"
    bm.free(r)
    assert list(bm.free_queue)[-3:] == [0, 1, 3], \
        "freed blocks join the back in REVERSE TABLE ORDER (table [3, 1, 0] -> 0, 1, 3), not by block number"


@hole("Scheduler.schedule")
def test_schedule_skips_a_running_request_with_nothing_to_compute():
    s = sched()
    a, b = req("a", range(5), max_tokens=1), req("b", range(10, 15), max_tokens=4)
    s.add(a)
    s.add(b)
    advance(s.schedule())  # both prompts ran: a reached max_tokens (still running here), b decodes
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("b", 1)], \
        "a asks for 0 tokens and is skipped (n == 0 is skipped); b, ranked after it, is still scheduled"





@hole("Scheduler.schedule")
def test_schedule_swap_in_lists_the_partly_filled_last_block_too():
    from engine.serve.scheduler import SchedulerOutput

    s = sched(num_blocks=8, block_size=4, preemption_mode="swap")
    r = req("r", range(6), max_tokens=4)
    s.add(r)
    advance(s.schedule())  # 6 computed: one full block and one partly filled
    out = SchedulerOutput()
    s._preempt(r, out)
    plan = s.schedule()
    assert plan.swap_in == [(r, s.blocks.req_blocks["r"][:2])] and r.num_computed_tokens == 6, \
        "the saved K/V of 6 computed tokens fill TWO blocks (the second partly): swap_in lists the first 2 blocks"


@hole("Scheduler.schedule")
def test_schedule_publishes_a_running_chunks_blocks_for_requests_admitted_in_the_same_step():
    s = sched(block_size=4, max_num_batched_tokens=100, long_prefill_token_threshold=8)
    a = req("a", range(20), max_tokens=2)
    s.add(a)
    advance(s.schedule())  # a's first chunk: tokens 0..7
    b = req("b", list(range(16)) + [99], max_tokens=2)
    s.add(b)
    s.schedule()  # a's second chunk (8..15) fills blocks 2, 3; b is admitted after it
    assert b.num_computed_tokens == 16 and s.blocks.req_blocks["b"][:4] == s.blocks.req_blocks["a"][:4], \
        "after allocating a running request's chunk, publish up to num_computed_tokens + n: b, admitted later in " \
        "the same step, adopts all 4 of a's blocks"


@hole("Scheduler.schedule")
def test_schedule_a_request_that_does_not_fit_stays_waiting():
    s = sched(num_blocks=4, block_size=4)
    a = req("a", range(8), max_tokens=8)
    s.add(a)
    advance(s.schedule())
    b = req("b", range(100, 112), max_tokens=1)  # 3 blocks, 2 free
    s.add(b)
    s.schedule()
    assert b.status is Status.WAITING and s.waiting == [b] and b not in s.running, \
        "status RUNNING is set on admission, i.e. only once its blocks were allocated"


@hole("Scheduler.schedule")
def test_schedule_a_request_that_preempted_itself_is_not_scheduled():
    s = sched(num_blocks=3, block_size=4)
    a, b = req("a", range(3), max_tokens=4), req("b", range(10, 18), max_tokens=4)
    s.add(a)
    s.add(b)
    advance(s.schedule())  # a: 1 block, b: 2 blocks, pool full
    plan = s.schedule()  # b's 9th token needs a third block: b, the last, preempts itself
    assert plan.preempted == [b] and [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1)], \
        "the request preempted itself: stop scheduling running requests; it must not be allocated or scheduled"
    assert "b" not in s.blocks.req_blocks and s.waiting == [b], 'b waits, holding no blocks'


@hole("Scheduler._preempt")
def test_preempt_counts_on_the_scheduler_too():
    s, a, b, plan, _ = preempt_b()
    assert plan.preempted == [b] and s.num_preemptions == 1 and b.num_preemptions == 1, \
        "a preemption adds one to the request's num_preemptions AND to the scheduler's num_preemptions"




class StepFault(Exception):
    """What the step-failure test raises inside a forward pass (not a RuntimeError, so that a stub's
    NotImplementedError is never mistaken for it)."""


@hole("EngineCore.step")
@pytest.mark.parametrize("fault", [StepFault, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_step_that_fails_calls_recover_failed_step_and_counts_no_step(fault):
    e = core(EngineConfig(block_size=4))
    p = prompts([10], seed=31)[0]
    e.add_request("a", p, SamplingParams(max_tokens=3, **GREEDY))
    recovered, recover, execute = [], e.recover_failed_step, e.runner.execute
    e.recover_failed_step = lambda plan: recovered.append(plan) or recover(plan)

    def failing(batch):
        e.runner.execute = execute  # fail once
        raise fault("injected by the test")

    e.runner.execute = failing
    with pytest.raises(fault):
        e.step()
    assert len(recovered) == 1 and e.steps == 0, \
        f"a step whose forward pass raised {fault.__name__} (any BaseException) must call recover_failed_step(plan) " \
        "before re-raising, and count no step"
    done = e.run_until_done()
    assert_same_tokens(done["a"], oracle(tuple(p), 3), "a", 10, 4, "after a failed step: ")
    assert e.steps == 3, "10-token prompt + 2 decodes: 3 steps counted, each one forward pass"



@hole("EngineCore.step")
def test_step_hands_the_sampler_each_sample_rows_own_request():
    # a (seeded, temperature 1) runs a mid-prompt chunk AHEAD of b (greedy): the one sample row is b's
    e = core(EngineConfig(block_size=4, max_num_batched_tokens=20, long_prefill_token_threshold=8))
    pa, pb = prompts([40, 5], seed=32)
    e.add_request("a", pa, SamplingParams(max_tokens=2, seed=5, temperature=1.0, ignore_eos=True))
    e.add_request("b", pb, SamplingParams(max_tokens=4, **GREEDY))
    done = e.run_until_done()
    assert_same_tokens(done["b"], oracle(tuple(pb), 4), "b", 5, 4,
                       "the sampler's reqs name each SAMPLE ROW's request (sample_counts[r] rows each): ")


@hole("EngineCore.step")
def test_step_seeded_requests_sample_from_their_own_generators():
    outs = []
    for engine_seed in (1, 2):
        e = core(EngineConfig(block_size=4, seed=engine_seed))
        e.add_request("a", prompts([6], seed=33)[0], SamplingParams(max_tokens=6, seed=11, temperature=1.0,
                                                                      ignore_eos=True))
        outs.append(e.run_until_done()["a"])
    assert outs[0] == outs[1], \
        "a request with a seed samples from its own generator (pass self.generators to the sampler): the engine's " \
        "seed must not change its tokens"


@hole("Scheduler.schedule")
def test_schedule_admits_nobody_once_the_budget_is_spent():
    s = sched(max_num_batched_tokens=10)
    a, b = req("a", range(10), max_tokens=2), req("b", range(100, 105), max_tokens=2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 10)] and s.waiting == [b], \
        "a takes the whole budget of 10: waiting requests are admitted only while budget remains"


@hole("EngineCore.step")
def test_step_leaves_prompt_logprobs_none_for_a_request_that_did_not_ask():
    e = core(EngineConfig(block_size=4))
    e.add_request("a", prompts([7], seed=34)[0], SamplingParams(max_tokens=2, **GREEDY))
    outs = [o for _ in range(3) for o in e.step()]
    assert outs[-1].finished and outs[-1].prompt_logprobs is None, \
        "only a request whose params.prompt_logprobs is set gets request.prompt_logprobs written (None otherwise)"


@hole("FlatModel.forward")
def test_flat_forward_uses_the_models_rope_theta():
    model = tiny_model(seed=0, dtype=torch.float64, rope_theta=1_000_000.0)  # Qwen3's theta, not the test model's
    prompt = prompts([13], seed=5)[0]
    (logits,), _, _ = run_flat(model, prompt, [13])
    assert torch.allclose(logits, model(torch.tensor(prompt)), atol=1e-9), \
        "the RoPE tables come from the model's own config: rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, ...)"


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_counts_a_request_too_short_to_match():
    bm = BlockManager(16, 4)
    published(bm, req("a", range(12)), 12)
    bm.num_queries = bm.num_hits = 0
    assert bm.find_cached_prefix(req("s", range(4))) == [], '4 tokens: the only block holds the last token'
    assert (bm.num_queries, bm.num_hits) == (4, 0), \
        "every lookup counts the request's tokens as queries, even one too short for any block to match"


@hole("hash_block")
def test_hash_block_encodes_the_cache_key_never_its_repr():
    class Tag(str):  # a str whose repr hides its value, as a truncated array's repr would
        def __repr__(self) -> str:
            return "Tag(...)"

    assert hash_block(None, [1, 2, 3, 4], (Tag("tenant-a"),)) != hash_block(None, [1, 2, 3, 4], (Tag("tenant-b"),)), \
        "two different cache keys with the same repr() must hash differently: hash encode_cache_key(extra), never a repr"


@hole("Scheduler.schedule")
def test_schedule_charges_an_admitted_request_only_the_tokens_it_got():
    s = sched(max_num_batched_tokens=40, long_prefill_token_threshold=16)
    for i in range(3):
        s.add(req(f"r{i}", range(i * 100, i * 100 + 40), max_tokens=2))
    plan = s.schedule()
    assert [n for _, n in plan.scheduled] == [16, 16, 8], \
        "each newcomer's chunk is capped at 16 and takes 16 from the budget of 40 (not the 40 it needs): 16, 16, 8"


@hole("EngineCore.check_stop")
def test_check_stop_looks_at_the_last_token_only():
    e = core(EngineConfig(max_model_len=20))
    r = req("r", [1, 2, 3, 4, 7, 5], prompt_len=4, stop_token_ids=[7])
    assert e.check_stop(r) is None and r.stop_reason is None, \
        "a stop token earlier in the output (7, then 5) no longer matters: only the LAST token is checked"


@hole("Scheduler.schedule")
def test_schedule_chunking_off_admits_a_prompt_whole_whatever_the_chunk_cap():
    s = sched(max_num_batched_tokens=100, enable_chunked_prefill=False, long_prefill_token_threshold=16)
    s.add(req("a", range(40), max_tokens=2))
    plan = s.schedule()
    assert [n for _, n in plan.scheduled] == [40], \
        "with chunked prefill off a prompt that fits the budget runs whole: long_prefill_token_threshold caps " \
        "chunks, and with chunking off there are none"


# ===== second round (issue 39): what a learner got wrong in the scheduler's arithmetic and that escaped
# every test. Each test pins one sentence of its hole's docstring.
@hole("build_batch")
def test_build_batch_positions_input_ids_and_logits_indices_are_int64():
    scheduled, tables = worked_example()
    batch = build_batch(scheduled, tables, 16)
    assert (batch.input_ids.dtype, batch.positions.dtype, batch.logits_indices.dtype) == \
        (torch.int64, torch.int64, torch.int64), \
        "input_ids, positions and logits_indices are int64 (Batch's comments): positions built as int32 " \
        "work here but break a kernel that reads them as int64"


@hole("BlockManager.find_cached_prefix")
def test_find_cached_prefix_cap_counts_outputs_too():
    bm = BlockManager(16, 4)
    published(bm, req("a", range(12)), 12)  # blocks of tokens 0..11, cached
    b = req("b", list(range(12)) + [5], prompt_len=4)  # a 4-token prompt and 9 outputs, nothing computed
    assert bm.find_cached_prefix(b) == bm.req_blocks["a"][:3], \
        "the cap is (num_tokens - 1) // block_size = 12 // 4 = 3 blocks, num_tokens counting prompt AND " \
        "outputs: a request readmitted after recompute adopts the blocks of its own outputs (a cap of " \
        "(num_prompt_tokens - 1) // block_size = 0 would adopt none)"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_adopting_a_held_block_raises_its_ref_count():
    bm = BlockManager(8, 4)
    ta = list(published(bm, req("a", range(12)), 12))  # a still holds its 3 blocks (ref 1 each)
    b = req("b", list(range(8)) + [50, 51])
    cached = bm.find_cached_prefix(b)
    assert cached == ta[:2], "setup: b's first two blocks are a's, still held by a"
    assert bm.allocate_slots(b, 2, cached)
    assert [bm.ref_count[x] for x in ta] == [2, 2, 1], \
        "adopting a block another request still holds raises its ref_count from 1 to 2 (shared), not only " \
        "adopting a cached-free one: else the first free() returns a block the other request still reads"
    assert bm.ref_count[bm.req_blocks["b"][2]] == 1, "b's new block: ref_count 1"


@hole("Scheduler.schedule")
def test_schedule_admits_with_a_single_token_of_budget_left():
    s = sched(max_num_batched_tokens=11)
    s.add(req("a", range(10), max_tokens=2))
    s.add(req("b", range(100, 105), max_tokens=2))
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 10), ("b", 1)], \
        "a takes 10 of the 11-token budget; the ONE token left still admits b with a chunk of 1 (admission " \
        "goes on while any budget remains: budget > 0, not budget > 1)"


@hole("Scheduler.schedule")
def test_schedule_a_cached_prefix_costs_the_budget_nothing():
    s = sched(block_size=4, max_num_batched_tokens=16)
    a = req("a", range(12), max_tokens=4)
    s.add(a)
    advance(s.schedule())  # a's 3 blocks are published; a now decodes
    b = req("b", list(range(8)) + [50, 51, 52], max_tokens=2)  # 11 tokens: 8 cached, 3 to compute
    c = req("c", range(200, 220), max_tokens=2)
    s.add(b)
    s.add(c)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 3), ("c", 12)], \
        "budget 16: a's decode takes 1, b computes 3 (its 8 cached tokens are not computed and cost the " \
        "budget nothing), so c gets the 12 left; charging b's cached tokens too would leave c only 4"


def resumed_with_cache_behind_a_newcomer():
    """Chunking off, budget 8, block_size 4, priority policy: a (prio 1) has an 11-token history, was
    preempted by recompute, and 8 of its tokens are still cached; c (prio 0, 6-token prompt) waits ahead of it."""
    s = sched(num_blocks=16, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False,
              policy="priority")
    a = req("a", range(6), max_tokens=10)
    a.priority, a.arrival_time = 1, 0.0
    s.add(a)
    for _ in range(5):  # the 6-token prompt, then 4 decodes: 11 tokens, 10 computed, blocks 0 and 1 published
        advance(s.schedule())
    s._preempt(a, SchedulerOutput())
    c = req("c", range(100, 106), max_tokens=2)
    c.priority, c.arrival_time = 0, 1.0
    s.add(c)
    return s, a, c


@hole("Scheduler.schedule")
def test_schedule_without_chunking_the_whole_budget_rule_looks_at_what_is_still_needed():
    s, a, c = resumed_with_cache_behind_a_newcomer()
    assert s.waiting == [c, a] and (a.num_tokens, a.num_computed_tokens) == (11, 0), "setup"
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("c", 6)] and s.waiting == [a], \
        "c takes 6 of the budget of 8; a's history is 11 tokens but 8 are cached, so it NEEDS 3: that fits the " \
        "whole budget, so with chunking off it waits for room for all 3 (the 'exceeds the whole budget' rule " \
        "looks at what it still needs after its cached prefix, not at num_tokens)"
    advance(plan)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("c", 1), ("a", 3)] and a.num_computed_tokens == 8, \
        "next step: c decodes, a resumes after its 8 cached tokens and computes its 3 in one piece"


@hole("Scheduler.schedule")
def test_schedule_without_chunking_a_prompt_exactly_the_budget_left_is_admitted():
    s = sched(max_num_batched_tokens=40, enable_chunked_prefill=False)
    s.add(req("a", range(30), max_tokens=2))
    s.add(req("b", range(100, 110), max_tokens=2))
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 30), ("b", 10)], \
        "a takes 30 of the 40; b needs 10, exactly the 10 left: it waits only if it needs MORE than the budget " \
        "left (need > budget), so it runs whole"


def recomputed_history_behind_a_newcomer(steps: int):
    """Chunking off, a budget of 8, the priority policy: request a (a 6-token prompt) runs ``steps``
    steps (its prompt, then decodes), is preempted by recompute (no prefix cache: its whole history
    must run again), and c (2 tokens, a better priority) arrives. Returns (scheduler, a, the plan)."""
    s = sched(num_blocks=16, block_size=4, caching=False, max_num_batched_tokens=8, enable_chunked_prefill=False,
              policy="priority")
    a = req("a", range(6), max_tokens=10)
    a.priority, a.arrival_time = 1, 0.0
    s.add(a)
    for _ in range(steps):
        advance(s.schedule())
    s._preempt(a, SchedulerOutput())
    c = req("c", range(100, 102), max_tokens=1)
    c.priority, c.arrival_time = 0, 1.0
    s.add(c)
    return s, a, s.schedule()


@hole("Scheduler.schedule")
def test_schedule_without_chunking_a_history_exactly_the_whole_budget_waits():
    s, a, plan = recomputed_history_behind_a_newcomer(2)  # the prompt, one decode: 8 tokens to run again
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("c", 2)] and s.waiting == [a], \
        "c takes 2 of the budget of 8; a needs 8, more than the 6 left but NOT more than the whole budget (8 = 8), " \
        "so with chunking off it waits for room for all of it rather than running in pieces"
    advance(plan)
    assert [(r.request_id, n) for r, n in s.schedule().scheduled] == [("a", 8)], \
        "next step c (at max_tokens) asks for nothing, and a runs its 8 tokens whole"


@hole("Scheduler._preempt")
def test_preempt_priority_requeues_ahead_of_later_arrivals_of_the_same_priority():
    s = sched(num_blocks=3, block_size=4, policy="priority", max_num_seqs=2)
    a, b = req("a", range(6), max_tokens=6), req("b", range(10, 14), max_tokens=8)
    c = req("c", range(20, 23), max_tokens=2)
    for r, t in ((a, 0.0), (b, 1.0), (c, 2.0)):
        r.priority, r.arrival_time = 0, t
        s.add(r)
    advance(s.schedule())  # a (2 blocks) and b (1 block) fill the pool; c waits (max_num_seqs=2)
    plan = s.schedule()  # b's 5th token needs a block: b, the last running, preempts itself
    assert plan.preempted == [b], "setup: b is preempted"
    assert s.waiting == [b, c], \
        "all three have priority 0; b arrived (1.0) before c (2.0), so the requeued b goes back AHEAD of c: at " \
        "its (priority, arrival) place (_insert_sorted), not behind every waiting request of its priority"


@hole("Scheduler._preempt")
def test_preempt_swap_lists_the_partly_filled_last_block_too():
    s = sched(num_blocks=8, block_size=4, preemption_mode="swap")
    a = req("a", range(6), max_tokens=4)
    s.add(a)
    advance(s.schedule())  # 6 computed tokens: block 0 full, block 1 holds 2
    table = list(s.blocks.req_blocks["a"])
    assert len(table) == 2, "setup: a holds 2 blocks"
    out = SchedulerOutput()
    s._preempt(a, out)
    assert out.swap_out == [(a, table)], \
        "the blocks that hold its 6 computed tokens are 2 (ceil(6 / 4)): the partly filled last block is saved " \
        "too, or its 2 tokens' K/V are lost (6 // 4 = 1 block would drop them)"


@pytest.mark.given  # record_lookup is given complete
def test_record_lookup_counts_each_admission_once():
    bm = BlockManager(4, 4)
    published(bm, req("a", range(12)), 12)  # 3 of 4 blocks held
    b = req("b", list(range(8)) + list(range(50, 60)))  # 18 tokens: 2 cached blocks + 3 new blocks
    for _ in range(3):  # the pool is too full: b is looked up again every step
        assert not bm.allocate_slots(b, 10, bm.find_cached_prefix(b)), 'the pool is too full for b'
    assert (bm.num_queries, bm.num_hits) == (18, 8), "a waiting request's repeated lookups count once"
    bm.free(b)
    assert not bm.pending_lookups, 'free() drops the pending lookup of a request that was never admitted'


# ===== the fresh walk-through (issue 39): bugs of a newcomer's that escaped every test. Each test pins only
# what its hole's docstring states.
@hole("Scheduler._preempt")
def test_preempt_leaves_admitted_and_num_cached_tokens_alone():
    s = sched(num_blocks=8, block_size=4)
    x = req("x", range(9), max_tokens=1)
    s.add(x)
    advance(s.schedule())  # x's prompt runs and publishes its 2 full blocks
    s.finish(x, Status.FINISHED_LENGTH)
    y = req("y", list(range(8)) + [50], max_tokens=8)
    s.add(y)
    advance(s.schedule())
    assert (y.admitted, y.num_cached_tokens) == (True, 8), "setup: y's admission adopted x's 2 blocks (8 tokens)"
    s._preempt(y, SchedulerOutput())  # recompute: its K/V is given up
    assert y.num_computed_tokens == 0, "setup: recompute forgets the computed tokens"
    assert y.admitted and y.num_cached_tokens == 8, \
        "a preemption leaves admitted (True) and num_cached_tokens (8) as they are: they describe the FIRST " \
        f"admission, which the output reports; got admitted={y.admitted}, num_cached_tokens={y.num_cached_tokens}"


@hole("Scheduler._preempt")
def test_preempt_the_output_reports_the_first_admissions_cached_tokens():
    e = core(EngineConfig(block_size=4, num_blocks=6, max_num_batched_tokens=64))
    p = prompts([9], seed=41)[0]
    e.add_request("x", p, SamplingParams(max_tokens=1, **GREEDY))
    e.run_until_done()  # x publishes the 2 full blocks of its prompt
    e.add_request("b", prompts([6], seed=42)[0], SamplingParams(max_tokens=8, **GREEDY))
    e.add_request("a", p[:8] + [5], SamplingParams(max_tokens=12, **GREEDY))  # adopts x's 8 tokens
    a = e.scheduler.requests["a"]
    outs = {}
    for _ in range(200):  # far more steps than the 20 tokens need; never a loop that cannot end
        for o in e.step() if e.has_unfinished() else []:
            outs.setdefault(o.request_id, []).append(o)
    assert not e.has_unfinished(), "setup: a and b finish within 200 steps"
    assert a.num_preemptions > 0, \
        "setup: 6 blocks of 4 can't hold a's 21 and b's 14 tokens: a, the last running, is preempted"
    got = [o.num_cached_tokens for o in outs["a"]]
    assert set(got) == {8}, \
        "a's outputs report the cached tokens of its FIRST admission (8) in every step, before and after a " \
        f"preemption: _preempt leaves admitted and num_cached_tokens alone; got {got}"


@hole("BlockManager.allocate_slots")
def test_allocate_slots_an_adopted_cached_free_block_stays_cached():
    bm = BlockManager(8, 4)
    a = req("a", range(9))
    ta = list(published(bm, a, 9))  # blocks 0 and 1 full and cached
    bm.free(a)  # cached-free
    b = req("b", list(range(8)) + [60])
    cached = bm.find_cached_prefix(b)
    assert cached == ta[:2], "setup: b's lookup finds a's 2 cached-free blocks"
    assert bm.allocate_slots(b, 1, cached)
    assert [bm.block_hash[x] for x in ta[:2]] == list(a.block_hashes[:2]) and bm.num_evicted == 0, \
        "an adopted block keeps its hash: adopting it is a hit, not an eviction (num_evicted stays 0)"
    c = req("c", list(range(8)) + [70])
    assert bm.find_cached_prefix(c) == ta[:2], \
        "so a later request with the same prefix finds the same 2 blocks in the cache"


@hole("Scheduler.schedule")
def test_schedule_without_chunking_a_history_over_the_whole_budget_gets_only_the_budget_left():
    s, a, plan = recomputed_history_behind_a_newcomer(4)  # the prompt, 3 decodes: 10 tokens to run again
    got = [(r.request_id, n) for r, n in plan.scheduled]
    assert got == [("c", 2), ("a", 6)], \
        "c takes 2 of the budget of 8; a needs 10, more than the WHOLE budget, so it runs in pieces of at most " \
        f"the budget LEFT (6), never the whole budget: the step would spend 10 of 8; got {got}"
    assert plan.num_scheduled_tokens <= 8, "a step never spends more than max_num_batched_tokens"


@hole("EngineCore.step")
def test_step_the_sampler_never_sees_the_prompt_logprob_rows():
    calls = []

    class Recording(SimpleSampler):
        def __call__(self, logits, reqs, generators):
            calls.append((logits.shape[0], [r.request_id for r in reqs]))
            return super().__call__(logits, reqs, generators)

    e = EngineCore(model64(), EngineConfig(block_size=4), sampler=Recording())
    pa, pb = prompts([5, 6], seed=43)
    e.add_request("a", pa, SamplingParams(max_tokens=2, **GREEDY))
    e.step()  # a's prompt: one sample row
    e.add_request("b", pb, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
    e.step()  # a decodes, b's whole prompt runs: 2 sample rows, and 5 prompt-logprob rows of b's
    assert calls[-1] == (2, ["a", "b"]), \
        "the sampler gets logits[:batch.num_sample_rows] only (one row per sample row, here a's and b's), " \
        f"never the prompt-logprob rows after them; got (rows, requests) {calls[-1]}"


# ===================================================================== the milestone
# The milestone runs on the reference backend: it is your ReferenceBackend.forward (faster backends
# are given code, tested against it in tests/test_backends.py).
MILESTONE_CONFIGS = {
    "small chunks, tight budget": EngineConfig(block_size=16, max_num_batched_tokens=24,
                                               long_prefill_token_threshold=10, attention_backend="reference"),
    "12-block pool, recompute": EngineConfig(block_size=16, num_blocks=12, preemption_mode="recompute",
                                             attention_backend="reference"),
    "12-block pool, swap": EngineConfig(block_size=16, num_blocks=12, preemption_mode="swap",
                                        attention_backend="reference"),
    "no prefix cache, 2 seqs": EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=2,
                                            attention_backend="reference"),
}


def milestone_requests():
    ps = prompts([9, 40, 57, 70, 23], seed=21)
    ps[3][:32] = ps[1][:32]  # request 3 shares its first two blocks with request 1
    ps[4] = ps[1][:32]  # request 4 is exactly those two blocks: its last token must still run
    return ps, [14, 30, 20, 26, 18]


@functools.lru_cache(maxsize=None)
def milestone_result(name: str) -> tuple[str, str]:
    """Serve the milestone's requests under one config, checking every invariant after each step.
    Returns (kind, message): kind "ok", or what went wrong — "crash" (the engine raised), "test"
    (the test's own code raised), "stuck", "invariant", "missing" (a request never finished),
    "wrong" (tokens differ from generate()), "counter" (preemptions happened but were not counted),
    "setup" (the config did not exercise what it is for), "leak" (something left at idle)."""
    ps, max_tokens = milestone_requests()
    e = core(MILESTONE_CONFIGS[name])
    preempted = []  # every request a plan preempted, from the plans themselves (not the counters)
    schedule = e.scheduler.schedule

    def watched_schedule():
        plan = schedule()
        preempted.extend(r.request_id for r in plan.preempted)
        return plan

    e.scheduler.schedule = watched_schedule
    try:
        for i, (p, m) in enumerate(zip(ps, max_tokens)):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=m, **{"temperature": 0.0, **GREEDY}))
        done = run_checked(e)
    except NotImplementedError:
        raise
    except InvariantError as exc:
        return "invariant", f"after step {e.steps}: {exc}"
    except AssertionError as exc:
        return "stuck", str(exc)
    except Exception as exc:
        whose, where = where_raised(exc)
        if whose in ("engine", "reference"):
            return "crash", f"{type(exc).__name__}: {exc} (at {'engine/' if whose == 'engine' else ''}{where})"
        return "test", (f"the test's own code raised {type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
                        + ", reading what the engine returned: not a crash inside your engine")
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        if f"r{i}" not in done:
            return "missing", f"request r{i} never finished (it is not among the finished outputs)"
        try:
            assert_same_tokens(done[f"r{i}"], oracle(tuple(p), m), f"r{i}", len(p), 16)
        except AssertionError as exc:
            return "wrong", str(exc)
    if "12-block" in name and e.preemptions < 1:
        if preempted:
            return "counter", (f"the plans preempted {len(preempted)} times (SchedulerOutput.preempted: "
                               f"{', '.join(sorted(set(preempted)))}) and every token is right, but the engine's "
                               f"preemptions (scheduler.num_preemptions) is {e.preemptions}: the counter was not "
                               "incremented")
        return "setup", ("no preemption happened: no plan listed a preempted request, although the 12-block pool "
                         "cannot hold every request at once (else this config tests nothing)")
    if name == "small chunks, tight budget" and not e.blocks.hit_rate > 0:
        return "setup", "request 3 should hit request 1's two shared blocks (hit rate 0)"
    try:
        check_idle(e)
    except InvariantError as exc:
        return "leak", str(exc)
    return "ok", ""


# What each hole can get wrong that shows up in the milestone (the holes every symptom could come from).
SUSPECTS = {
    "build_batch": "rows (token_ids + spec)[c:c+n] at positions c.., slots through the table, the sample rows "
                   "(k counts from num_tokens: 0 mid-prompt, 1 for a decode, a last chunk or a resumed history)",
    "write_kv": "each row's K/V to its slot, padding to the scratch slot",
    "ReferenceBackend.forward": "a request's queries are the LAST positions of its context, keys read through "
                                "its block table up to seq_len",
    "FlatModel.attention": "K/V written (after norm and RoPE) before attending; the model's sliding window",
    "FlatModel.forward": "RoPE by each row's position (not its row number), each layer its own pool",
    "EngineCore.step": "each request takes its own sample rows; num_computed_tokens += n; swap_out then swap_in "
                       "before the forward; finished requests freed at once",
    "EngineCore.check_stop": "min_tokens, stop tokens, EOS, max_tokens, max_model_len",
    "Scheduler._preempt": "the victim's blocks freed; recompute resets num_computed_tokens, swap keeps it and "
                          "lists the blocks of the computed tokens; the FRONT of waiting; both counters",
    "Scheduler.schedule": "preempt the LAST running request and stop when it preempts itself; a resumed request "
                          "(recompute) looks up its prefix again, a swapped one gets swap_in into the FIRST blocks "
                          "of its new table; chunk cap and budget for running and admitted requests; max_num_seqs",
    "BlockManager.find_cached_prefix": "stop at the first miss, never the last token's block",
    "BlockManager.allocate_slots": "all or nothing, adopted cached-free blocks count, a reused block loses its hash, "
                                   "a running request grows when its last block fills",
    "BlockManager.cache_full_blocks": "only full blocks, first writer wins, start at num_published",
    "BlockManager.free": "every block back (tail first), the request's entries dropped",
    "hash_block": "the parent digest and the cache key in the hash",
}
PATH_OF_EVERY_STEP = ("build_batch", "write_kv", "ReferenceBackend.forward", "FlatModel.attention",
                      "FlatModel.forward", "EngineCore.step", "EngineCore.check_stop")
PREEMPTION = ("Scheduler._preempt", "Scheduler.schedule", "build_batch", "BlockManager.free",
              "BlockManager.allocate_slots", "EngineCore.step")
PREFIX_CACHE = ("BlockManager.find_cached_prefix", "BlockManager.allocate_slots", "BlockManager.cache_full_blocks",
                "hash_block", "Scheduler.schedule", "build_batch")
BY_KIND = {"leak": ("BlockManager.free", "Scheduler._preempt", "EngineCore.step"),
           "counter": ("Scheduler._preempt",),
           "missing": ("EngineCore.check_stop", "EngineCore.step"),
           "stuck": ("EngineCore.step", "Scheduler.schedule", "BlockManager.allocate_slots", "EngineCore.check_stop")}


def milestone_hint(name: str, kind: str, kinds: dict[str, str]) -> str:
    """Where to look, from HOW this config failed and WHICH configs fail: every hole that can cause
    the symptom, most likely first, with what to check in each."""
    failing = sorted(n for n, k in kinds.items() if k not in ("ok", "test"))
    how = {"crash": "your code raised inside the engine; the location above is where",
           "test": "the engine did not raise; the test's own code failed on what it returned (the line above)",
           "stuck": "a request stopped making progress: did step() append a token for every request that "
                    "had a sample row, and does a finished request leave the scheduler?",
           "invariant": "the checker names the bookkeeping that disagrees; each hole's docstring says who keeps it",
           "missing": "a request never finished: check_stop, and step() reporting (and finishing) finished requests",
           "leak": "at idle something is still held: free() on finish, abort and preemption must return "
                   "every block and drop the request's entries",
           "counter": "preemption itself works; only the count is missing: _preempt adds one to the scheduler's "
                      "num_preemptions and to the request's",
           "setup": "this config did not do what it is for"}.get(kind, "")
    preempting = {"12-block pool, recompute", "12-block pool, swap"}
    if kind == "counter" or not failing:
        where, suspects = "", ()
    elif len(failing) == len(kinds):
        where = ("every configuration fails, so the bug is most likely on the path all of them share rather than "
                 "in preemption or the prefix cache")
        suspects = PATH_OF_EVERY_STEP
    elif set(failing) <= preempting:
        which = {"12-block pool, swap": "only swap mode fails", "12-block pool, recompute": "only recompute fails"}
        where = (which.get(failing[0]) if len(failing) == 1 else "only the configs that preempt fail") + \
            ": what differs there is preemption and resumption — a resumed request re-runs its history " \
            "(recompute) or gets its K/V copied back (swap)"
        suspects = PREEMPTION
    elif failing == ["small chunks, tight budget"]:
        where = ("only the tight budget with small chunks fails: chunked prefill — a mid-prompt chunk samples "
                 "nothing, each chunk starts at num_computed_tokens and reads the earlier chunks' K/V, the chunk "
                 "cap, a decode behind a chunk")
        suspects = ("Scheduler.schedule", "build_batch", "EngineCore.step", "FlatModel.forward",
                    "ReferenceBackend.forward")
    elif failing == ["no prefix cache, 2 seqs"]:
        where = "only the config without a prefix cache fails: max_num_seqs, and everything with caching off"
        suspects = ("Scheduler.schedule", "BlockManager.find_cached_prefix", "BlockManager.cache_full_blocks")
    elif "no prefix cache, 2 seqs" not in failing:
        where = "every config with the prefix cache fails and the one without passes: the prefix cache"
        suspects = PREFIX_CACHE
    else:
        where = f"failing: {', '.join(failing)}"
        suspects = PATH_OF_EVERY_STEP + PREEMPTION + PREFIX_CACHE
    ordered = list(dict.fromkeys(BY_KIND.get(kind, ()) + tuple(suspects)))
    look = ""
    if ordered:
        look = (" Holes that can cause this: " + "; ".join(f"{h} ({SUSPECTS[h]})" for h in ordered)
                + f". `pytest tests/test_ch31_engine_v2.py --hole {ordered[0]}` runs one hole's tests alone.")
    parts = [x for x in (how, where) if x]
    return ". ".join(parts) + "." + look


@pytest.mark.milestone
@pytest.mark.parametrize("name", list(MILESTONE_CONFIGS))
def test_milestone_every_config_equals_generate(name):
    """Five prompts under four set-ups, invariants checked after every step: every request's tokens
    equal generate() on its prompt alone, and the idle engine holds nothing."""
    kind, message = milestone_result(name)
    if kind != "ok":
        kinds = {n: milestone_result(n)[0] for n in MILESTONE_CONFIGS}
        pytest.fail(f"[{name}] {message}\nHint: {milestone_hint(name, kind, kinds)}", pytrace=False)
