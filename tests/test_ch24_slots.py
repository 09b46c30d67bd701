"""Chapter 24's slot engine (``engine/slots.py``), the baseline of chapter 31's benchmark.

Every greedy output is compared with ``generate()`` on the same prompt alone. The models are in
float64 so that a batched pass and the one-prompt oracle cannot disagree on a near-tie.
"""
from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.models.tiny import tiny_model
from engine.slots import SlotEngine, SlotOutput

PROMPT_LENS = (1, 5, 13, 17, 30, 2, 9)
MAX_TOKENS = (12, 7, 15, 3, 10, 20, 1)


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def case(request):
    """(model, prompts, greedy outputs of generate()) for the dense and the MoE test model."""
    model = tiny_model(seed=1, moe=request.param, dtype=torch.float64)
    prompts = _prompts()
    expected = [generate(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    return model, prompts, expected


def _check_against_generate(out: dict[str, list[int]], expected: list[list[int]], what: str) -> None:
    for i, want in enumerate(expected):
        got = out.get(f"r{i}")
        assert got is not None, f"{what}: request r{i} never reported output"
        if got != want:
            j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            pytest.fail(
                f"{what}: request r{i} (prompt of {PROMPT_LENS[i]} tokens) differs from generate() "
                f"at output token {j}: got {got}, expected {want}. A mismatch at token 0 points at "
                f"prefill (chunk positions, logits row); a later one at decode (cache write position, "
                f"per-row length mask, a reused slot's leftovers).")


@pytest.mark.parametrize("prefill_chunk", [None, 4], ids=["whole-prompt", "chunk4"])
def test_greedy_matches_generate_with_slot_reuse(case, prefill_chunk):
    model, prompts, expected = case
    engine = SlotEngine(model, num_slots=3, max_len=64, prefill_chunk=prefill_chunk)
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        engine.add_request(f"r{i}", p, n)
    out = engine.run_to_completion()
    _check_against_generate(out, expected, f"SlotEngine(num_slots=3, prefill_chunk={prefill_chunk})")
    assert not engine.has_unfinished()
    assert engine.num_free_slots == engine.num_slots, "a finished request kept its slot"
    # Seven requests through three slots: every slot was reused, and each step did at most one
    # pass per prefilling request plus one for all decodes.
    assert engine.steps >= max(MAX_TOKENS)
    assert engine.forward_calls >= engine.steps


def test_requests_added_while_others_decode(case):
    """Continuous batching: a request arriving mid-run joins the batch at the next step."""
    model, prompts, expected = case
    engine = SlotEngine(model, num_slots=4, max_len=64, prefill_chunk=8)
    out: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, MAX_TOKENS)))
    while pending or engine.has_unfinished():
        if pending:  # one new request every step
            i, (p, n) = pending.pop(0)
            engine.add_request(f"r{i}", p, n)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    _check_against_generate(out, expected, "SlotEngine with staggered arrivals")
    assert engine.num_free_slots == 4


def test_one_forward_per_prefill_plus_one_batched_decode():
    model = tiny_model(seed=2, dtype=torch.float64)
    engine = SlotEngine(model, num_slots=4, max_len=32)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (3 + i), max_tokens=4)
    first = engine.step()
    assert engine.forward_calls == 3, "step 1: each of the 3 prompts runs in its own pass"
    assert [o.request_id for o in first] == ["r0", "r1", "r2"]
    assert all(isinstance(o, SlotOutput) and len(o.new_token_ids) == 1 and not o.finished for o in first)
    engine.step()
    assert engine.forward_calls == 4, "step 2: the three decodes share ONE batched pass"
    engine.add_request("late", [7, 8], max_tokens=2)
    engine.step()
    assert engine.forward_calls == 6, "step 3: one pass for the new prompt + one for the decodes"
    assert engine.steps == 3


def test_prefill_chunks_report_nothing_until_the_prompt_ends():
    model = tiny_model(seed=2, dtype=torch.float64)
    prompt = list(range(10, 20))  # 10 tokens in chunks of 4: 4 + 4 + 2
    engine = SlotEngine(model, num_slots=1, max_len=16, prefill_chunk=4)
    engine.add_request("a", prompt, max_tokens=3)
    assert engine.step() == [] and engine.step() == [], "a mid-prompt chunk must not sample"
    third = engine.step()
    assert len(third) == 1 and third[0].new_token_ids == generate(model, prompt, 1)
    assert engine.forward_calls == 3
    rest = engine.run_to_completion()
    assert third[0].new_token_ids + rest["a"] == generate(model, prompt, 3)


def test_eos_stops_a_request_unless_ignore_eos():
    model = tiny_model(seed=3, dtype=torch.float64)
    prompt = [3, 14, 15, 92, 65]
    free_run = generate(model, prompt, 12)
    eos = free_run[3]
    expected = generate(model, prompt, 12, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) < 12, "test setup: EOS must stop generate() early"

    engine = SlotEngine(model, num_slots=2, max_len=32, eos_token_id=eos)
    engine.add_request("stops", prompt, max_tokens=12)
    engine.add_request("ignores", prompt, max_tokens=12, ignore_eos=True)
    outputs: dict[str, list[SlotOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    stops, ignores = outputs["stops"], outputs["ignores"]
    assert [t for o in stops for t in o.new_token_ids] == expected, "output must end at the EOS, EOS included"
    assert stops[-1].finished and stops[-1].finish_reason == "stop"
    assert stops[-1].output_token_ids == expected
    assert not any(o.finished for o in stops[:-1])
    assert [t for o in ignores for t in o.new_token_ids] == free_run
    assert ignores[-1].finish_reason == "length"
    assert engine.num_free_slots == 2


def test_seeded_sampling_is_reproducible():
    model = tiny_model(seed=4, dtype=torch.float64)
    prompt = [1, 2, 3, 4]

    def run(seed: int) -> list[int]:
        engine = SlotEngine(model, num_slots=2, max_len=32)
        engine.add_request("s", prompt, max_tokens=10, temperature=1.5, seed=seed, top_k=50)
        engine.add_request("g", prompt, max_tokens=10)  # a greedy neighbour in the same batch
        return engine.run_to_completion()["s"]

    assert run(7) == run(7), "same seed must give the same samples"
    assert run(7) != run(8), "different seeds gave identical 10-token samples at temperature 1.5"


def test_idle_engine_has_every_slot_free():
    model = tiny_model(seed=2, dtype=torch.float64)
    engine = SlotEngine(model, num_slots=3, max_len=20)
    assert engine.kv_slots == 60
    assert engine.num_free_slots == 3 and not engine.has_unfinished()
    assert engine.step() == [] and engine.steps == 0, "an idle step does no work and is not counted"
    engine.add_request("a", [1, 2, 3], max_tokens=2)
    engine.add_request("b", [4, 5], max_tokens=1)
    engine.step()
    assert engine.num_free_slots == 2, "b finished at its first token and must release its slot at once"
    engine.add_request("c", [6], max_tokens=5)
    engine.abort_request("c")
    engine.run_to_completion()
    assert engine.num_free_slots == 3 and not engine.has_unfinished()
    engine.add_request("a", [1], max_tokens=1)  # a finished id may be used again


def test_add_request_rejects_bad_requests():
    model = tiny_model(seed=2, dtype=torch.float64)
    engine = SlotEngine(model, num_slots=2, max_len=16)
    engine.add_request("dup", [1, 2], max_tokens=2)
    cases = [
        (dict(request_id="e", prompt_token_ids=[], max_tokens=2), "empty"),
        (dict(request_id="l", prompt_token_ids=[1] * 10, max_tokens=7), "max_len"),
        (dict(request_id="dup", prompt_token_ids=[3], max_tokens=1), "already"),
        (dict(request_id="v", prompt_token_ids=[1, 512], max_tokens=1), "vocabulary"),
        (dict(request_id="n", prompt_token_ids=[-1], max_tokens=1), "vocabulary"),
        (dict(request_id="z", prompt_token_ids=[1], max_tokens=0), "max_tokens"),
        (dict(request_id="t", prompt_token_ids=[1], max_tokens=1, temperature=-1.0), "temperature"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            engine.add_request(**kwargs)
    engine.add_request("fits", [1] * 10, max_tokens=6)  # exactly max_len is fine
    with pytest.raises(ValueError, match="prefill_chunk"):
        SlotEngine(model, prefill_chunk=0)
    with pytest.raises(ValueError, match="num_slots"):
        SlotEngine(model, num_slots=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SlotEngine(model, max_len=model.cfg.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="no waiting or running"):
        engine.abort_request("missing")
