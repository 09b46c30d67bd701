"""Bad input, nothing lost: every rejected input raises ValueError saying what to change, and the
engine it was sent to is left exactly as it was — it then serves a normal request correctly and
ends idle with no blocks, queue entries, generators or swapped K/V left over.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from ch31_helpers import model64, oracle, run_checked
from engine.serve import BlockManager, EngineConfig, EngineCore, SamplingParams
from engine.serve.blocks import encode_cache_key, hash_block
from course.quality.invariants import check_engine_invariants, check_idle

PROMPT = [5, 17, 99, 3, 250, 42, 7]
SP = SamplingParams
BASE = dict(block_size=4, num_blocks=16, max_model_len=100)  # a 64-token pool, a 100-token context




@dataclass
class Case:
    """One rejected call: ``call(core)`` must raise ValueError whose message contains ``fragment``.
    ``setup(core)`` puts state in the engine first (it must survive the rejection untouched)."""

    call: Callable
    fragment: str
    config: dict = field(default_factory=dict)
    setup: Callable | None = None


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def _nested(depth: int) -> tuple:
    key: tuple = ("leaf",)
    for _ in range(depth):
        key = (key,)
    return key


def _add(*args, **kwargs) -> Callable:
    return lambda core: core.add_request(*args, **kwargs)


def _existing(*ids: str, n: int = 1) -> Callable:
    def setup(core):
        for rid in ids:
            core.add_request(rid, PROMPT, SP(max_tokens=3, n=n, seed=11, temperature=0.7))
    return setup


def _existing_then_abort(parent: str, child: str, n: int) -> Callable:
    def setup(core):
        _existing(parent, n=n)(core)
        core.abort_request(child)
    return setup


REQUEST_CASES = {
    # the prompt
    "empty prompt": Case(_add("a", []), "prompt_token_ids is empty"),
    "prompt is None": Case(_add("a", None), "must be a list of token ids"),
    "prompt is text": Case(_add("a", "hello"), "tokenize text first"),
    "token id negative": Case(_add("a", [1, -1, 2]), "outside the vocabulary [0, 512)"),
    "token id past vocab": Case(_add("a", [1, 512]), "outside the vocabulary [0, 512)"),
    "token id float": Case(_add("a", [1, 2.0]), "token ids must be ints"),
    "token id str": Case(_add("a", [1, "2"]), "token ids must be ints"),
    "token id bool": Case(_add("a", [True, 2]), "token ids must be ints"),
    "token id tensor": Case(_add("a", torch.tensor([1, 2])), "token ids must be ints"),
    # sampling parameters
    "max_tokens 0": Case(lambda core: core.add_request("a", PROMPT, SP(max_tokens=0, temperature=0.0)), "max_tokens must be an integer >= 1"),
    "max_tokens float": Case(lambda core: core.add_request("a", PROMPT, SP(max_tokens=2.5, temperature=0.0)), "max_tokens must be an integer"),
    "n 0": Case(lambda core: core.add_request("a", PROMPT, SP(n=0, temperature=0.0)), "n must be an integer >= 1"),
    "negative temperature": Case(lambda core: core.add_request("a", PROMPT, SP(temperature=-0.1)), "temperature must be >= 0"),
    "nan temperature": Case(lambda core: core.add_request("a", PROMPT, SP(temperature=float("nan"))), "temperature must be >= 0"),
    "top_p 0": Case(lambda core: core.add_request("a", PROMPT, SP(top_p=0.0, temperature=0.0)), "top_p must be in (0, 1]"),
    "top_p above 1": Case(lambda core: core.add_request("a", PROMPT, SP(top_p=1.5, temperature=0.0)), "top_p must be in (0, 1]"),
    "top_k negative": Case(lambda core: core.add_request("a", PROMPT, SP(top_k=-2, temperature=0.0)), "top_k must be an integer >= 0"),
    "top_k float": Case(lambda core: core.add_request("a", PROMPT, SP(top_k=2.5, temperature=0.0)), "top_k must be an integer >= 0"),
    "min_tokens > max_tokens": Case(lambda core: core.add_request("a", PROMPT, SP(min_tokens=5, max_tokens=4, temperature=0.0)),
                                    "must not exceed max_tokens"),
    "negative stop token": Case(lambda core: core.add_request("a", PROMPT, SP(stop_token_ids=[-3], temperature=0.0)),
                                "stop_token_ids must be a list of non-negative integers"),
    "stop tokens not a list": Case(lambda core: core.add_request("a", PROMPT, SP(stop_token_ids=7, temperature=0.0)),
                                   "stop_token_ids must be a list"),
    "seed not an int": Case(lambda core: core.add_request("a", PROMPT, SP(seed="7", temperature=0.0)), "seed must be an integer or None"),
    "logit_bias (full sampler)": Case(lambda core: core.add_request("a", PROMPT, SP(logit_bias={4: 1.0}, temperature=0.0)),
                                      "leave logit_bias=None"),
    "logprobs beyond the vocabulary": Case(_add("a", PROMPT, SP(logprobs=513, temperature=0.0)),
                                           "logprobs=513 asks for more alternatives"),
    "repetition penalty zero": Case(lambda core: core.add_request("a", PROMPT, SP(repetition_penalty=0.0, temperature=0.0)),
                                    "repetition_penalty must be > 0"),
    "seed negative": Case(lambda core: core.add_request("a", PROMPT, SP(seed=-2, temperature=0.5)), "seed"),  # -1: None
    "seed past 2**64": Case(lambda core: core.add_request("a", PROMPT, SP(seed=2**64, temperature=0.5)), "seed",
                            setup=_existing("b")),
    "children's seeds past 2**64": Case(lambda core: core.add_request("a", PROMPT, SP(seed=2**64 - 1, n=2, temperature=0.5)),
                                        "seed",
                                        setup=_existing("b")),
    "prompt_logprobs beyond the vocabulary": Case(_add("a", PROMPT, SP(prompt_logprobs=513, temperature=0.0)),
                                                  "more alternatives than the vocabulary has (512)"),
    "params not SamplingParams": Case(_add("a", PROMPT, {"max_tokens": 3}), "params must be a SamplingParams"),
    # identity, ordering and tenancy
    "request id empty": Case(_add("", PROMPT), "request_id must be a non-empty string"),
    "request id not a string": Case(_add(7, PROMPT), "request_id must be a non-empty string"),
    "duplicate id": Case(_add("dup", PROMPT), "already in use", setup=_existing("dup")),
    "duplicate id of a child": Case(_add("p:1", PROMPT), "already in use", setup=_existing("p", n=2)),
    "n > 1 colliding with a live id": Case(_add("x", PROMPT, SP(n=3, seed=1, temperature=0.5)), "already in use",
                                          setup=_existing("x:2")),
    "n > 1 reusing a live parent id": Case(_add("p", PROMPT, SP(n=2, temperature=0.0)), "already in use", setup=_existing("p", n=2)),
    "id of an aborted child whose sibling runs": Case(_add("p:0", PROMPT), "by n > 1 request 'p', which is still running",
                                                      setup=_existing_then_abort("p", "p:0", n=3)),
    "parent id of a child id in use": Case(_add("p:1", PROMPT, SP(n=2, temperature=0.0)), "already in use",
                                           setup=_existing_then_abort("p", "p:0", n=2)),
    "priority not an int": Case(_add("a", PROMPT, priority="high"), "priority must be an int",
                                config=dict(policy="priority"), setup=_existing("b")),
    "arrival_time not a number": Case(_add("a", PROMPT, arrival_time="now"), "arrival_time must be a finite number",
                                      setup=_existing("b")),
    "arrival_time nan": Case(_add("a", PROMPT, arrival_time=float("nan")), "arrival_time must be a finite number"),
    "cache_key not a tuple": Case(_add("a", PROMPT, cache_key=["tenant"]), "cache_key must be a tuple"),
    "cache_key holds a numpy array": Case(_add("a", PROMPT, cache_key=("img", np.arange(2000))), "pass a digest"),
    "cache_key holds a tensor": Case(_add("a", PROMPT, cache_key=(torch.arange(3),)), "pass a digest"),
    "cache_key holds a float": Case(_add("a", PROMPT, cache_key=(0.5,)), "must be str, int, bytes, bool, None"),
    "cache_key holds a list": Case(_add("a", PROMPT, cache_key=(("a", ["b"]),)), "must be str, int, bytes, bool"),
    "cache_key item whose repr raises": Case(_add("a", PROMPT, cache_key=(_Unprintable(),)),
                                             "must be str, int, bytes, bool, None"),
    "cache_key nested too deep": Case(_add("a", PROMPT, cache_key=_nested(40)), "nests tuples more than"),
    # sizes
    "prompt beyond the context": Case(_add("a", [1] * 90, SP(max_tokens=11, temperature=0.0)), "exceeds max_model_len=100"),
    "request larger than the pool": Case(_add("a", [1] * 40, SP(max_tokens=30, temperature=0.0)), "exceeds the whole KV pool",
                                         setup=_existing("b")),
    "n > 1 each larger than the pool": Case(_add("a", [1] * 60, SP(max_tokens=10, n=3, seed=4, temperature=0.5)),
                                            "exceeds the whole KV pool"),
    "prompt over the budget, chunking off": Case(_add("a", [1] * 20), "enable chunked prefill or raise the budget",
                                                 config=dict(enable_chunked_prefill=False, max_num_batched_tokens=16)),
}


def _snapshot(core) -> dict:
    s, b = core.scheduler, core.blocks
    return dict(requests=sorted(s.requests), waiting=[r.request_id for r in s.waiting],
                running=[r.request_id for r in s.running], generators=sorted(core.generators),
                children={k: list(v) for k, v in core.children.items()}, swapped=sorted(core.runner.swapped),
                free=list(b.free_queue), tables={k: list(v) for k, v in b.req_blocks.items()})


def _serve_normally(core) -> None:
    """Whatever was queued before plus one new greedy request all finish, the new one equal to generate()."""
    core.add_request("normal", PROMPT, SP(max_tokens=6, temperature=0.0))
    out = run_checked(core)
    assert out["normal"] == oracle(tuple(PROMPT), 6), "after a rejected input the engine answers wrongly"
    check_idle(core)


@pytest.mark.parametrize("name", list(REQUEST_CASES))
def test_rejected_request_changes_nothing(name):
    case = REQUEST_CASES[name]
    core = EngineCore(model64(), EngineConfig(**{**BASE, **case.config}))
    if case.setup:
        case.setup(core)
    before = _snapshot(core)
    with pytest.raises(ValueError) as err:
        case.call(core)
    assert case.fragment in str(err.value), f"{name}: the message should say what to change, got {str(err.value)!r}"
    assert _snapshot(core) == before, f"{name}: the rejected request left state behind"
    check_engine_invariants(core)
    _serve_normally(core)


CONFIG_CASES = {
    "block_size 0": (dict(block_size=0), "block_size must be an integer >= 1"),
    "block_size float": (dict(block_size=2.0), "block_size must be an integer >= 1"),
    "num_blocks 0": (dict(num_blocks=0), "num_blocks must be an integer >= 1"),
    "kv_cache_bytes 0": (dict(kv_cache_bytes=0), "kv_cache_bytes must be an integer >= 1"),
    "kv_cache_bytes below one block": (dict(kv_cache_bytes=100, num_blocks=None), "give the KV cache more memory"),
    "budget 0": (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    "budget bool": (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer >= 1"),
    "max_num_seqs 0": (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    "negative threshold": (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be an integer >= 0"),
    "chunking flag not a bool": (dict(enable_chunked_prefill="no"), "enable_chunked_prefill must be True or False"),
    "caching flag not a bool": (dict(enable_prefix_caching=None), "enable_prefix_caching must be True or False"),
    "gpu_memory_utilization 0": (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in (0, 1]"),
    "gpu_memory_utilization above 1": (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1]"),
    "gpu_memory_utilization text": (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be in (0, 1]"),
    "max_model_len 0": (dict(max_model_len=0), "max_model_len must be an integer >= 1"),
    "max_model_len past the model": (dict(max_model_len=10**6), "exceeds the model's 8192 positions"),
    "seed not an int": (dict(seed="0"), "seed must be an integer"),
    "seed negative": (dict(seed=-1), "seed must be an integer in [0, 2**64)"),
    "seed past 2**64": (dict(seed=2**64), "seed must be an integer in [0, 2**64)"),
    "unknown policy": (dict(policy="lifo"), "unknown policy 'lifo': choose one of"),
    "unknown preemption mode": (dict(preemption_mode="drop"), "unknown preemption_mode 'drop': choose one of"),
    "unknown backend": (dict(attention_backend="flash9"), "unknown attention backend 'flash9': choose one of"),
    "unknown sampler": (dict(sampler="fancy"), "unknown sampler 'fancy': choose one of"),
    "full sampler (later chapter)": (dict(sampler="full"), "use 'simple'"),
}


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_rejected_config(name):
    overrides, fragment = CONFIG_CASES[name]
    with pytest.raises(ValueError) as err:
        EngineCore(model64(), EngineConfig(**{**BASE, **overrides}))
    assert fragment in str(err.value), f"{name}: the message should say what to change, got {str(err.value)!r}"


def test_valid_config_still_serves_after_rejections():
    for overrides, _ in CONFIG_CASES.values():
        with pytest.raises(ValueError):
            EngineCore(model64(), EngineConfig(**{**BASE, **overrides}))
    _serve_normally(EngineCore(model64(), EngineConfig(**BASE)))


@pytest.mark.parametrize("args, fragment", [
    ((0, 4), "num_blocks must be an integer >= 1"),
    ((4, 0), "block_size must be an integer >= 1"),
    ((4.0, 4), "num_blocks must be an integer >= 1"),
])
def test_block_manager_rejects_bad_sizes(args, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        BlockManager(*args)


def test_abort_unknown_finished_and_twice_is_harmless_and_ids_are_reusable():
    core = EngineCore(model64(), EngineConfig(**BASE))
    core.abort_request("nobody")
    core.add_request("a", PROMPT, SP(max_tokens=2, seed=3, temperature=0.5))
    core.add_request("b", PROMPT, SP(max_tokens=2, n=2, temperature=0.0))
    core.abort_request("a")
    core.abort_request("a")  # twice
    core.abort_request("b")  # the parent: both children go
    check_idle(core)
    core.add_request("a", PROMPT, SP(max_tokens=4, temperature=0.0))  # aborted ids can be reused ...
    assert core.run_until_done() == {"a": oracle(tuple(PROMPT), 4)}
    core.abort_request("a")  # ... aborting a finished one changes nothing ...
    core.add_request("a", PROMPT, SP(max_tokens=2, n=2, temperature=0.0))  # ... and finished ids too, even as a parent
    assert core.run_until_done() == {"a:0": oracle(tuple(PROMPT), 2), "a:1": oracle(tuple(PROMPT), 2)}
    check_idle(core)


class _Impostor(str):
    """A str whose repr() and str() pretend to be another tenant's name."""

    def __repr__(self) -> str:
        return "'tenant-a'"

    def __str__(self) -> str:
        return "tenant-a"


def test_cache_keys_are_encoded_losslessly():
    """Different keys never share a digest (True vs 1, nesting, bytes vs str, None vs "None"), and a
    key is hashed by its value, not by what its repr() claims."""
    keys = [(1,), (True,), (0,), (False,), (None,), ("None",), ("ab",), ("a", "b"), (("a",),), ("a",),
            (b"a",), (-1,), (2**70,), (2**70 + 1,), ((), ()), ((),), ("\ud800",), ("é",)]
    digests = [hash_block(None, [1, 2], k) for k in keys]
    assert len(set(digests)) == len(keys), "two different cache keys hash alike"
    assert len({encode_cache_key(k) for k in keys}) == len(keys)
    assert hash_block(None, [1, 2], (_Impostor("tenant-b"),)) == hash_block(None, [1, 2], ("tenant-b",))
    assert hash_block(None, [1, 2], (_Impostor("tenant-b"),)) != hash_block(None, [1, 2], ("tenant-a",)), \
        "a str whose repr() claims another tenant's name took that tenant's hash"


def test_tenants_never_share_blocks_through_a_forged_key():
    core = EngineCore(model64(), EngineConfig(**BASE))
    core.add_request("a", PROMPT * 3, SP(max_tokens=2, temperature=0.0), cache_key=("tenant-a",))
    run_checked(core)
    core.add_request("b", PROMPT * 3, SP(max_tokens=2, temperature=0.0), cache_key=(_Impostor("tenant-b"),))
    core.step()
    assert core.scheduler.requests["b"].num_cached_tokens == 0, "tenant b adopted tenant a's blocks"
    run_checked(core)
    check_idle(core)


def test_aborting_a_parent_never_touches_another_request():
    core = EngineCore(model64(), EngineConfig(**BASE))
    core.add_request("p", PROMPT, SP(max_tokens=3, n=2, seed=5, temperature=0.7))
    core.abort_request("p:0")
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("p:0", PROMPT, SP(max_tokens=3, temperature=0.0))
    core.add_request("p:00", PROMPT, SP(max_tokens=3, temperature=0.0))
    core.abort_request("p")  # p:1 goes; p:00 is not p's
    assert sorted(core.scheduler.requests) == ["p:00"]
    check_engine_invariants(core)
    assert run_checked(core) == {"p:00": oracle(tuple(PROMPT), 3)}
    core.add_request("p:0", PROMPT, SP(max_tokens=2, temperature=0.0))  # p is gone: its ids are free again
    assert run_checked(core) == {"p:0": oracle(tuple(PROMPT), 2)}
    check_idle(core)


def _python_calls(fn) -> int:
    """How many Python and C function calls ``fn()`` makes: a deterministic measure of work."""
    import sys

    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_adding_and_aborting_many_children_is_linear(policy):
    """n children added and aborted (by parent, then one by one) cost O(n) calls, not O(n^2):
    four times the children may cost at most about four times the calls."""
    def work(n: int) -> Callable:
        core = EngineCore(model64(), EngineConfig(block_size=4, num_blocks=16, policy=policy))

        def run():
            core.add_request("many", PROMPT, SP(max_tokens=2, n=n, temperature=0.0), priority=1)
            core.add_request("one", PROMPT, SP(max_tokens=2, n=n, temperature=0.0), priority=0)
            core.abort_request("many")
            for i in range(n):
                core.abort_request(f"one:{i}")
        return run

    small, large = _python_calls(work(300)), _python_calls(work(1200))
    assert large < 5 * small, f"4x the children cost {large / small:.1f}x the calls: quadratic bookkeeping"
