"""Tenant isolation and the block hash.

The prefix cache hands one request's K/V to another whenever their block hashes match, so the hash
is a security boundary: requests with different ``cache_key`` (tenant salt, adapter, images) must
never share a block, even with identical prompts; equal keys should share. ``hash_block`` must be
the same in every process (never Python's salted ``hash()``) and change with any token, the
parent, or the key.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ch31_helpers import model64, oracle, run_checked
from engine.serve import BlockManager, EngineConfig, EngineCore, Request, SamplingParams, hash_block
from course.quality.invariants import check_idle

PROMPT = [(37 * i + 11) % 512 for i in range(21)]  # five full blocks of 4, and one token more
HSETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=200)


def _engine(**kw) -> EngineCore:
    return EngineCore(model64(), EngineConfig(**{**dict(block_size=4, num_blocks=40), **kw}))


def _run_pair(key_a: tuple, key_b: tuple, staggered: bool):
    """A and B, same prompt, keys key_a and key_b; B arrives after A's prefill (its blocks are then
    published) or in the same step. Returns (shared blocks seen while both ran, B's cached tokens)."""
    core = _engine()
    core.add_request("a", PROMPT, SamplingParams(max_tokens=6, temperature=0.0), cache_key=key_a)
    if staggered:
        core.step()
    core.add_request("b", PROMPT, SamplingParams(max_tokens=6, temperature=0.0), cache_key=key_b)
    b = core.scheduler.requests["b"]
    shared: set[int] = set()

    def note_shared(core: EngineCore) -> None:
        tables = core.blocks.req_blocks
        if "a" in tables and "b" in tables:
            shared.update(set(tables["a"]) & set(tables["b"]))

    out = run_checked(core, note_shared)
    want = oracle(tuple(PROMPT), 6)
    assert out == {"a": want, "b": want}, "the cache key must not change what the model computes"
    check_idle(core)
    return shared, b.num_cached_tokens


@pytest.mark.parametrize("staggered", [True, False], ids=["after-prefill", "same-step"])
@pytest.mark.parametrize("key_a, key_b", [
    (("tenant-a",), ("tenant-b",)),
    ((), ("tenant-a",)),
    (("adapter", 1), ("adapter", 2)),
    ((1,), ("1",)),
])
def test_different_cache_keys_never_share_a_block(key_a, key_b, staggered):
    shared, cached = _run_pair(key_a, key_b, staggered)
    assert not shared, f"cache keys {key_a} and {key_b} shared blocks {sorted(shared)}: one tenant read another's K/V"
    assert cached == 0, f"request with key {key_b} took {cached} tokens from the cache of key {key_a}"


@pytest.mark.parametrize("key", [(), ("tenant-a",), ("adapter", 3, b"img")])
def test_equal_cache_keys_share(key):
    shared, cached = _run_pair(key, key, staggered=True)
    assert cached == 20, f"an identical prompt with the same key should reuse its 5 full blocks, got {cached} tokens"
    assert len(shared) == 5


def test_isolation_holds_after_the_owner_finishes():
    """Cached-free blocks of tenant A are still findable, but only by A."""
    core = _engine()
    core.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), cache_key=("A",))
    core.run_until_done()
    a_blocks = {b for b, h in enumerate(core.blocks.block_hash) if h is not None}
    assert a_blocks, "tenant A's finished blocks should stay cached"
    core.add_request("b", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), cache_key=("B",))
    core.step()
    b = core.scheduler.requests["b"]
    assert b.num_cached_tokens == 0 and not set(core.blocks.req_blocks["b"]) & a_blocks
    core.run_until_done()
    core.add_request("a2", PROMPT, SamplingParams(max_tokens=2, temperature=0.0), cache_key=("A",))
    core.step()
    assert core.scheduler.requests["a2"].num_cached_tokens == 20
    core.run_until_done()
    check_idle(core)


def test_key_reaches_every_block_of_the_chain():
    bm = BlockManager(16, 4)
    plain, keyed = Request("p", PROMPT), Request("k", PROMPT, cache_key=("t",))
    bm.update_hashes(plain)
    bm.update_hashes(keyed)
    assert len(plain.block_hashes) == len(keyed.block_hashes) == 5
    assert all(x != y for x, y in zip(plain.block_hashes, keyed.block_hashes))


# ----- hash_block (its cross-process check is the chapter's: test_hash_block_is_the_same_in_every_process) --
def test_hash_block_shape():
    h = hash_block(None, [1, 2, 3])
    assert isinstance(h, bytes) and len(h) == 16, "a 16-byte BLAKE2b digest"
    assert hash_block(None, [1, 2, 3]) == h, "deterministic"
    assert hash_block(h, [1, 2, 3]) != h


tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=16)
# Parents are real digests (a block's parent is always hash_block's output, or None for the first
# block); arbitrary 16-byte strings could spell the root marker itself.
parent_st = st.one_of(st.none(), st.lists(st.integers(0, 511), min_size=1, max_size=4).map(lambda t: hash_block(None, t)))
key_st = st.tuples(st.one_of(st.text(max_size=6), st.integers(-5, 5), st.binary(max_size=4)))


@HSETTINGS
@given(parent=parent_st, tokens=tokens_st, data=st.data())
def test_hash_changes_with_any_token(parent, tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = data.draw(st.integers(0, 2**31 - 1).filter(lambda t: t != tokens[i]))
    changed = tokens[:i] + [other] + tokens[i + 1:]
    assert hash_block(parent, tokens) != hash_block(parent, changed), f"changing token {i} kept the hash"


@HSETTINGS
@given(tokens=tokens_st, a=parent_st, b=parent_st)
def test_hash_changes_with_the_parent(tokens, a, b):
    if a != b:
        assert hash_block(a, tokens) != hash_block(b, tokens), "a different parent must give a different hash"


@HSETTINGS
@given(parent=parent_st, tokens=tokens_st, a=key_st, b=key_st)
def test_hash_changes_with_the_key(parent, tokens, a, b):
    assert hash_block(parent, tokens, a) != hash_block(parent, tokens), "a cache key must change the hash"
    if a != b and repr(a) != repr(b):
        assert hash_block(parent, tokens, a) != hash_block(parent, tokens, b), f"keys {a!r} and {b!r} collide"


@HSETTINGS
@given(tokens=tokens_st)
def test_hash_depends_on_order_and_length(tokens):
    if tokens != tokens[::-1]:
        assert hash_block(None, tokens) != hash_block(None, tokens[::-1])
    assert hash_block(None, tokens) != hash_block(None, tokens + [0])
