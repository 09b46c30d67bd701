"""vLLM's sampling features on the chapter's core: penalties, min_p, min_tokens, logprobs, seed.

Every feature is checked against an oracle written here in plain PyTorch float64: a full forward
pass of the float64 test model over prompt + output so far, then the feature computed by hand
(loops over token ids, not the engine's tensor code). The float64 model makes greedy choices
exact, so token sequences are compared for equality.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from ch31_helpers import model64, oracle, prompts
from engine.generate import generate
from engine.llm import LLM
from engine.models import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.serve.request import Request
from engine.serve.sampler import SimpleSampler

pytestmark = pytest.mark.given  # the sampler and its processors are given code; holes run the reference

VOCAB = 512


@functools.lru_cache(maxsize=None)
def soft_model():
    """The float64 test model with its LM head scaled by 0.1: logits ~3 apart, not ~30, so the
    penalties' [-2, 2] range can change its greedy choices."""
    m = tiny_model(seed=0, dtype=torch.float64)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.1)
    return m


def _core(eos: int | None = None, model=None) -> EngineCore:
    return EngineCore(model or model64(), EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=64),
                      eos_token_id=eos)


def _run(core: EngineCore) -> dict[str, list[int]]:
    return core.run_until_done(max_steps=500)


@torch.no_grad()
def _last_logits(tokens: list[int], model=None) -> torch.Tensor:
    """The oracle's logits [V] for the token after ``tokens`` (float64, one sequence alone)."""
    return (model or model64())(torch.tensor(tokens)).double()[-1]


def _penalised(logits: torch.Tensor, prompt: list[int], out: list[int], rep: float, pres: float,
               freq: float) -> torch.Tensor:
    """vLLM's penalties, by hand, one token id at a time."""
    logits = logits.clone()
    for t in set(prompt) | set(out):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t, c in Counter(out).items():
        logits[t] -= freq * c + pres
    return logits


# End to end on values that bite within the first few prompts (a random model seldom repeats a
# token, so a penalty on repeats seldom changes its run); every sign is checked on the logits above.
PENALTIES = {"repetition": dict(repetition_penalty=1.5), "presence": dict(presence_penalty=-1.0),
             "all three": dict(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=0.5)}


def test_penalised_logits_match_the_oracle():
    [p] = prompts([12], seed=30)
    prompt, out = p[:8], p[8:] + p[8:10] + p[2:3]  # output tokens repeated, one also in the prompt
    logits = _last_logits(p)
    for kw in (dict(repetition_penalty=1.3), dict(repetition_penalty=0.6), dict(presence_penalty=0.7),
               dict(frequency_penalty=-0.4), dict(repetition_penalty=1.2, presence_penalty=1.5, frequency_penalty=2.0)):
        req = Request("r", prompt, SamplingParams(**kw))
        req.token_ids += out
        got = SimpleSampler.shaped_logits(logits, req)
        want = _penalised(logits, prompt, out, kw.get("repetition_penalty", 1.0), kw.get("presence_penalty", 0.0),
                          kw.get("frequency_penalty", 0.0))
        assert not torch.equal(want, logits)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"{kw}: penalised logits")


def _penalised_run(model, prompt: list[int], kw: dict, max_tokens: int) -> list[int]:
    """The oracle: greedy, each step's logits from a fresh float64 forward pass, penalised by hand."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = _penalised(_last_logits(prompt + out, model), prompt, out, kw.get("repetition_penalty", 1.0),
                            kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0))
        out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_penalties_match_a_float64_oracle(name):
    kw, model = PENALTIES[name], soft_model()
    # A random model seldom repeats a token, so a penalty on repeats seldom bites: take the first
    # of these prompts whose greedy run the oracle's penalty changes (deterministic; none -> fail).
    for seed in range(100, 160):
        [p] = prompts([16], seed=seed)
        want, plain = _penalised_run(model, p, kw, 12), generate(model, p, 12)
        if want != plain:
            break
    assert want != plain, "no prompt here whose greedy run the penalty changes (the test would prove nothing)"
    [other] = prompts([6], seed=31)
    core = _core(model=model)
    core.add_request("pen", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw))
    core.add_request("plain", other, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    done = _run(core)
    assert done["pen"] == want, f"{name}: penalised greedy tokens differ from the float64 oracle (prompt seed {seed})"
    assert done["plain"] == generate(model, other, 12), "a batch-mate with default params must stay generate()'s"


def test_min_tokens_masks_eos_and_stop_ids():
    [p] = prompts([7], seed=32)
    first_two = oracle(tuple(p), 2)
    eos, stop = first_two[0], 100 if first_two[0] != 100 else 101  # EOS is the unmasked greedy choice
    core = _core(eos)
    core.add_request("early", p, SamplingParams(temperature=0.0, max_tokens=8))
    core.add_request("late", p, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[stop]))
    done = _run(core)
    assert done["early"] == [eos], "without min_tokens the request stops at its first token, the EOS"
    want: list[int] = []
    while len(want) < 8:
        logits = _last_logits(p + want)
        if len(want) < 4:
            logits[eos] = logits[stop] = float("-inf")
        want.append(int(torch.argmax(logits)))
        if len(want) >= 4 and want[-1] in (eos, stop):
            break
    got = done["late"]
    assert got == want, f"min_tokens=4: got {got}, the oracle (EOS and stop id masked below 4) gives {want}"
    assert len(got) >= 4 and eos not in got[:4] and stop not in got[:4]


def _allowed_by_min_p(logits: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return {t for t in range(probs.shape[0]) if probs[t] >= min_p * probs.max()}


def test_min_p_draws_from_the_oracles_distribution():
    # unit level: 4000 draws from one row against the oracle's renormalised distribution
    logits = torch.randn(32, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    req = Request("r", [1, 2], SamplingParams(temperature=0.7, min_p=0.2, seed=5))
    probs = torch.softmax(logits / 0.7, dim=-1)
    keep = probs >= 0.2 * probs.max()
    want = torch.where(keep, probs, torch.zeros_like(probs))
    want /= want.sum()
    assert 1 < int(keep.sum()) < 32, "min_p=0.2 should keep some tokens and drop others here"
    sampler, gen = SimpleSampler(), torch.Generator().manual_seed(5)
    draws = [sampler(logits[None], [req], {"r": gen})[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=32).double() / len(draws)
    assert all(keep[t] for t in draws), "a token below min_p * max probability was drawn"
    assert float((counts - want).abs().max()) < 0.03, f"draw frequencies {counts} vs the oracle's {want}"
    # end to end: every sampled token is one the oracle's min_p keeps at its position
    [p] = prompts([6], seed=33)
    core = _core()
    core.add_request("m", p, SamplingParams(temperature=1.5, min_p=0.3, seed=11, max_tokens=12, ignore_eos=True))
    out = _run(core)["m"]
    for i, t in enumerate(out):
        allowed = _allowed_by_min_p(_last_logits(p + out[:i]), 1.5, 0.3)
        assert t in allowed, f"output token {i} ({t}) is outside the min_p set {sorted(allowed)}"


def test_logprobs_match_a_float64_forward_pass():
    [p] = prompts([8], seed=34)
    llm = LLM(model64(), None, block_size=4, num_blocks=64)
    [a] = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=6,
                                                                 ignore_eos=True, logprobs=3, prompt_logprobs=1),
                       use_tqdm=False)
    c = a.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    total = 0.0
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        lp = torch.log_softmax(_last_logits(p + c.token_ids[:i]), dim=-1)
        assert list(entry)[0] == t, "the sampled token comes first"
        assert abs(entry[t].logprob - float(lp[t])) < 1e-9, f"token {i}: logprob of the sampled token"
        assert entry[t].rank == int((lp >= lp[t]).sum()), f"token {i}: rank of the sampled token"
        top = torch.topk(lp, 3).indices.tolist()
        assert set(entry) == {t} | set(top)
        for r, u in enumerate(top, start=1):
            assert abs(entry[u].logprob - float(lp[u])) < 1e-9 and (u == t or entry[u].rank == r)
        total += float(lp[t])
    assert abs(c.cumulative_logprob - total) < 1e-9
    # the prompt tokens' ranks, among the whole vocabulary
    with torch.no_grad():
        plp = torch.log_softmax(model64()(torch.tensor(p)).double(), dim=-1)
    for i, entry in enumerate(a.prompt_logprobs[1:]):
        t = p[i + 1]
        assert entry[t].rank == int((plp[i] >= plp[i, t]).sum()), f"prompt token {i + 1}: rank"
    # logprobs=0: the sampled token alone; -1: the whole vocabulary; None: nothing, as in vLLM
    [b] = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=2, logprobs=0), use_tqdm=False)
    assert [list(e) for e in b.outputs[0].logprobs] == [[t] for t in b.outputs[0].token_ids]
    assert b.outputs[0].token_ids == oracle(tuple(p), 2), "logprobs do not change the greedy tokens"
    [d] = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1), use_tqdm=False)
    assert len(d.outputs[0].logprobs[0]) == VOCAB and sorted(e.rank for e in d.outputs[0].logprobs[0].values()) == \
        list(range(1, VOCAB + 1))
    [e] = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert e.outputs[0].logprobs is None and e.outputs[0].cumulative_logprob is None
    # a stream carries each delta's entries
    deltas = list(llm.stream({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)))
    streamed = [e for dl in deltas for e in dl.logprobs]
    assert [list(e)[0] for e in streamed] == oracle(tuple(p), 3)


SEEDED = dict(temperature=1.0, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=1234, max_tokens=10, ignore_eos=True)


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched():
    p, x, y, z = prompts([7, 30, 5, 9], seed=35)
    alone = _core()
    alone.add_request("s", p, SamplingParams(**SEEDED))
    want = _run(alone)["s"]
    crowd = _core()
    crowd.add_request("x", x, SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True))  # unseeded: shares the engine's generator
    crowd.add_request("y", y, SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True))
    crowd.step()  # the others get ahead first
    crowd.add_request("s", p, SamplingParams(**SEEDED))
    crowd.add_request("z", z, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    done = _run(crowd)
    assert done["s"] == want, "a seeded request's tokens must not depend on its batch-mates"
    assert done["z"] == oracle(tuple(z), 5)
    again = _core()
    again.add_request("s", p, SamplingParams(**{**SEEDED, "seed": 1235}))
    assert _run(again)["s"] != want, "another seed should give other tokens (else the test proves nothing)"


BAD = {
    "repetition_penalty": [0.0, -1.0, float("inf"), float("nan"), "1.2"],
    "presence_penalty": [2.5, -2.1, float("nan"), True],
    "frequency_penalty": [3.0, float("-inf")],
    "min_p": [-0.1, 1.5, float("nan")],
    "min_tokens": [-1, 1.5],
    "logprobs": [-2, 1.5, "3"],
    "seed": [1.5, 2**64],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_values_raise_one_line_and_leave_the_engine_unchanged(name):
    core = _core()
    [p] = prompts([5], seed=36)
    free = core.blocks.num_free
    for value in BAD[name]:
        with pytest.raises(ValueError, match=name) as e:
            SamplingParams(**{name: value})
        assert "\n" not in str(e.value)
        params = SamplingParams(max_tokens=4)
        setattr(params, name, value)  # set after construction: add_request checks again
        with pytest.raises(ValueError, match=name) as e:
            core.add_request("a", p, params)
        assert "\n" not in str(e.value)
        assert not core.scheduler.requests and not core.has_unfinished() and core.blocks.num_free == free
        assert not core.generators
    with pytest.raises(ValueError, match="logprobs=513"):
        core.add_request("a", p, SamplingParams(logprobs=VOCAB + 1))
    core.add_request("a", p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # the id is still free
    assert _run(core)["a"] == oracle(tuple(p), 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_tokens_are_argmax_first_on_a_tie(dtype):
    """The sampler's batched greedy reduction (``max(dim=-1).indices``, fast on 16-bit rows) picks
    what argmax of the exact float64 values picks, the first index on a tie."""
    from engine.serve.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen).to(dtype)
    logits[1, [7, 500, 999]] = 30.0  # a three-way tie: 7
    logits[2] = 0.0  # every entry tied: 0
    logits[3, 999] = 30.0  # the last entry alone
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.tolist() == torch.argmax(logits.double(), dim=-1).tolist()
    assert got.tolist()[1:4] == [7, 0, 999]
