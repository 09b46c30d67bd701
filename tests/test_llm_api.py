"""``LLM`` as a drop-in for vLLM's offline API: stop strings, outputs, options, sharing, text input.

The model is the 2-layer test model in float64 with a vocabulary the size of a small byte-level
BPE trained on ASCII text, so every token decodes to plain ASCII and greedy choices are exact.
Oracles: ``generate()`` (greedy tokens, one prompt alone), the tokenizer's ``decode`` of whole
token prefixes (where a stop string first appears), and a plain forward pass (prompt logprobs).

Run with the reference: ``pytest --impl solution tests/test_llm_api.py``.
"""
from __future__ import annotations

# greedy_rewrite: done (written for temperature 1.0 by default: greedy calls say temperature=0.0)

import random
import threading
import warnings

import pytest
import torch

from engine.generate import generate
from engine.llm import LLM
from engine.models.tiny import tiny_model
from engine.serve import SamplingParams
from engine.serve.params import FULL_SAMPLER_FIELDS, MIN_TEMPERATURE, SEED_MAX, UNSUPPORTED_FIELDS
from engine.tokenizer import Tokenizer
from pathload import ascii_tokenizer, load_by_path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_NEW = 24
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """The ASCII tokenizer, with a chat template that also shows ``bos_token``."""
    return ascii_tokenizer(tmp_path_factory.mktemp("tok"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(seed=5, dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=256)


@pytest.fixture
def llm(model, tok) -> LLM:
    return LLM(model, tok, block_size=4, num_blocks=128)


def _prompt(seed: int, tok: Tokenizer, n: int = 7) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, tok.vocab_size) for _ in range(n)]


def _oracle(model, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    return generate(model, prompt, n, eos_token_id=None)


def _first_prefix_with(tok: Tokenizer, tokens: list[int], stop: str) -> int:
    """The smallest k such that decode(tokens[:k]) contains ``stop`` (independent of any detokenizer)."""
    for k in range(1, len(tokens) + 1):
        if stop in tok.decode(tokens[:k]):
            return k
    raise AssertionError(f"{stop!r} never appears")


def _boundary_stop(tok: Tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A 2-character stop string made of the last character of one token's text and the first of the
    next one's, at the first boundary where it appears nowhere earlier; and that boundary."""
    for i in range(1, len(tokens)):
        left, right = tok.decode(tokens[:i]), tok.decode(tokens[i:i + 1])
        if left and right:
            stop = left[-1] + right[0]
            if stop not in left:
                return stop, i
    raise AssertionError("no token boundary with text on both sides")


# --------------------------------------------------------------------------- defaults and params


def test_default_temperature_is_vllms():
    p = SamplingParams()
    assert p.temperature == 1.0 and not p.greedy and p.max_tokens == 16 and p.top_k == 0
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(seed=-1).seed is None  # vLLM's spellings
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams().stop_token_ids == []


def test_seed_outside_the_generator_range_is_refused():
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=-2)  # -1 means no seed, as in vLLM; other negatives would alias 2**64 + seed
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=SEED_MAX, n=2)  # child 1 would use seed + 1
    assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX


def test_tiny_temperature_is_raised_to_the_documented_minimum(llm, model, tok):
    """A temperature that would overflow softmax samples at MIN_TEMPERATURE (as vLLM does): with
    logit gaps of several units that is the greedy token, every time."""
    with pytest.warns(UserWarning, match="below"):
        p = SamplingParams(temperature=1e-40, seed=3, max_tokens=MAX_NEW, ignore_eos=True)
    assert p.temperature == MIN_TEMPERATURE
    prompt = _prompt(1, tok)
    [out] = llm.generate({"prompt_token_ids": prompt}, p)
    assert out.outputs[0].token_ids == _oracle(model, prompt)


@pytest.mark.parametrize("name", sorted(FULL_SAMPLER_FIELDS))
def test_chapter34_fields_are_accepted_then_refused_at_add_request(llm, tok, name):
    value = {"logprob_token_ids": [4], "logit_bias": {4: 1.0}, "allowed_token_ids": [4, 5],
             "bad_words": ["fox"], "structured_outputs": {"regex": "a+"}, "thinking_token_budget": 8}[name]
    params = SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=rf"{name}=.* needs chapter 34's full sampler.*leave {name}="):
        llm.generate({"prompt_token_ids": _prompt(2, tok)}, params)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_by_name(name):
    value = {"prompt_logprob_token_ids": [4], "prompt_logprob_start": 1, "stream_interval": 2,
             "skip_reading_prefix_cache": True, "repetition_detection": object(), "trace_decode_token_ids": [4],
             "routed_experts_prompt_start": 1, "watermarking": object()}[name]
    with pytest.raises(ValueError, match=rf"{name}=.*not supported by the course engine"):
        SamplingParams(**{name: value})


# --------------------------------------------------------------------------- stop strings


def _boundary_case(model, tok: Tokenizer, seed: int):
    """(prompt, its greedy tokens, a stop string across a token boundary, how many tokens it takes
    for the text to contain it, that text)."""
    prompt = _prompt(seed, tok)
    tokens = _oracle(model, prompt)
    stop, _ = _boundary_stop(tok, tokens)
    k = _first_prefix_with(tok, tokens, stop)
    return prompt, tokens, stop, k, tok.decode(tokens[:k])


def test_stop_string_across_a_token_boundary(llm, model, tok):
    prompt, tokens, stop, k, full = _boundary_case(model, tok, 3)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop=[stop], **GREEDY))
    c = out.outputs[0]
    assert c.token_ids == tokens[:k], "the token that completes the stop string ends the completion"
    assert c.text == full[:full.find(stop)], "the stop string and what follows it are cut from the text"
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(stop=stop, include_stop_str_in_output=True, **GREEDY))
    assert out.outputs[0].text == full[:full.find(stop) + len(stop)]
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_prompt_logprobs_survive_a_stop_string(llm, model, tok):
    """A stop string ends the completion in the front end, which aborts the request in the core:
    the prompt logprobs must still come back, equal to those of a run that no stop string ends
    (for n > 1 too)."""
    prompt, tokens, stop, k, _ = _boundary_case(model, tok, 3)
    assert k < MAX_NEW
    [want] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(prompt_logprobs=3, **GREEDY))
    assert want.prompt_logprobs is not None and len(want.prompt_logprobs) == len(prompt)
    for n in (1, 2):
        [got] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop=[stop], prompt_logprobs=3, n=n, **GREEDY))
        assert [c.finish_reason for c in got.outputs] == ["stop"] * n
        assert got.prompt_logprobs is not None, f"prompt logprobs lost to a stop string (n={n})"
        assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):  # float64: batching moves the last bits
            assert list(g) == list(w) and [e.rank for e in g.values()] == [e.rank for e in w.values()]
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-9 for t in g)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_stop_string_inside_one_token_and_the_earliest_wins(llm, model, tok):
    """Two stop strings inside one token's text: the one that ends first wins, whatever its place
    in the list (vLLM's rule); the text is cut mid-token."""
    prompt = _prompt(4, tok)
    tokens = _oracle(model, prompt)
    word = next(w for w in (tok.decode([t]).strip() for t in tokens) if len(w) >= 3)
    stops = ["\x01never", word[1:3], word[0:2]]  # the last one ends first
    k = next(k for k in range(1, len(tokens) + 1) if any(s in tok.decode(tokens[:k]) for s in stops))
    full = tok.decode(tokens[:k])
    won = min((s for s in stops if s in full), key=lambda s: (full.find(s) + len(s), stops.index(s)))
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop=stops, **GREEDY))
    assert out.outputs[0].token_ids == tokens[:k]
    assert out.outputs[0].stop_reason == won and out.outputs[0].text == full[:full.find(won)]


def test_stop_strings_wait_for_min_tokens(llm, model, tok):
    prompt, tokens, stop, k, _ = _boundary_case(model, tok, 3)
    # text made by the first k tokens cannot stop a request with min_tokens=k: the next match counts
    later = next((j for j in range(k + 1, len(tokens) + 1)
                  if stop in tok.decode(tokens[:j])[len(tok.decode(tokens[:k])) - len(stop) + 1:]), None)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop=stop, min_tokens=k, **GREEDY))
    if later is None:
        assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"
    else:
        assert out.outputs[0].token_ids == tokens[:later] and out.outputs[0].stop_reason == stop


def test_stop_string_in_a_stream_never_shows_what_it_cuts(llm, model, tok):
    prompt, tokens, stop, k, full = _boundary_case(model, tok, 3)
    want = full[:full.find(stop)]
    deltas = list(llm.stream({"prompt_token_ids": prompt}, SamplingParams(stop=stop, **GREEDY)))
    shown = ""
    for d in deltas:
        shown += d.text
        assert want.startswith(shown), f"the stream showed {shown!r}, past the cut {want!r}"
    assert shown == want
    assert [t for d in deltas for t in d.token_ids] == tokens[:k]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_stop_token_text_is_left_out_unless_asked(llm, model, tok):
    prompt = _prompt(6, tok)
    tokens = _oracle(model, prompt)
    j = 5
    stop_id = tokens[j]
    j = tokens.index(stop_id)
    base = dict(GREEDY)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(stop_token_ids=[stop_id], **base))
    c = out.outputs[0]
    assert c.token_ids == tokens[:j + 1] and (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == tok.decode(tokens[:j]), "the stop token's text is not part of the output"
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True, **base))
    assert out.outputs[0].text == tok.decode(tokens[:j + 1])


def test_detokenize_off_and_special_tokens(llm, model, tok):
    prompt = _prompt(3, tok)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(detokenize=False, **GREEDY))
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == _oracle(model, prompt)
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
    # a prompt whose greedy output holds a special token (ids 0-2): shown only when asked
    for seed in range(40):
        prompt = _prompt(100 + seed, tok)
        tokens = _oracle(model, prompt)
        if any(t < 3 for t in tokens):
            break
    else:
        raise AssertionError("no prompt among 40 produced a special token; pick another model seed")
    [kept] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(skip_special_tokens=False, **GREEDY))
    [skipped] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**GREEDY))
    assert kept.outputs[0].text == tok.decode(tokens, skip_special_tokens=False)
    assert skipped.outputs[0].text == tok.decode(tokens)
    assert kept.outputs[0].text != skipped.outputs[0].text


# --------------------------------------------------------------------------- outputs


def test_outputs_carry_vllms_fields(llm, model, tok):
    prompt = _prompt(8, tok, n=9)
    [a] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(prompt_logprobs=2, **GREEDY))
    assert a.finished and a.outputs[0].finished() and a.outputs[0].cumulative_logprob is None
    assert a.outputs[0].logprobs is None and a.num_cached_tokens == 0  # None unless logprobs is asked for
    m = a.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time and m.num_generation_tokens == MAX_NEW
    # prompt logprobs against a plain forward pass
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor(prompt)).double(), dim=-1)  # [T, V]
    assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(a.prompt_logprobs[1:]):
        target = prompt[i + 1]
        assert abs(entry[target].logprob - float(lp[i, target])) < 1e-9
        top = torch.topk(lp[i], 2).indices.tolist()
        assert [t for t in entry if t != target] == [t for t in top if t != target]
        assert {entry[t].rank for t in top} == {1, 2}
    # the same prompt again: its full blocks come from the prefix cache
    [b] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**GREEDY))
    assert b.num_cached_tokens == 8 and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_max_tokens_none_runs_to_the_context_limit(model, tok):
    llm = LLM(model, tok, block_size=4, num_blocks=64, max_model_len=40)
    prompt = _prompt(9, tok)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))
    assert out.outputs[0].token_ids == _oracle(model, prompt, 40 - len(prompt))
    assert out.outputs[0].finish_reason == "length"


def test_prompt_truncation(llm, model, tok):
    prompt = _prompt(10, tok, n=12)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(truncate_prompt_tokens=5, **GREEDY))
    assert out.prompt_token_ids == prompt[-5:] and out.outputs[0].token_ids == _oracle(model, prompt[-5:])
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**GREEDY),
                         tokenization_kwargs={"truncate_prompt_tokens": 5, "truncation_side": "left"})
    assert out.prompt_token_ids == prompt[-5:]
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**GREEDY),
                         tokenization_kwargs={"truncate_prompt_tokens": 5})
    assert out.prompt_token_ids == prompt[:5]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(truncate_prompt_tokens=10_000, **GREEDY))
    assert not llm.engine.has_unfinished()


def test_default_params_and_n(llm, model, tok):
    """generate() without params samples at vLLM's default temperature 1.0; n completions."""
    assert llm.get_default_sampling_params() == SamplingParams()
    prompt = _prompt(11, tok)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, seed=4, max_tokens=6, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)


def test_seeded_sampling_matches_chapter_8(llm, model, tok):
    """temperature/top_k/top_p/seed: token by token, chapter 8's sample_token on a plain forward pass,
    drawing from a generator seeded like the request's, gives the engine's tokens."""
    from engine.sampling import sample_token

    prompt = _prompt(13, tok)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=77, max_tokens=10, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": prompt}, params)
    gen, seq, want = torch.Generator().manual_seed(77), list(prompt), []
    with torch.no_grad():
        for _ in range(10):
            t = sample_token(model(torch.tensor(seq))[-1], 0.9, 20, 0.9, gen)
            want.append(t)
            seq.append(t)
    assert out.outputs[0].token_ids == want


# --------------------------------------------------------------------------- constructor and methods


def test_constructor_takes_vllms_names(model, tok):
    llm = LLM(model, tok, block_size=4, num_gpu_blocks_override=24, scheduling_policy="priority",
              enforce_eager=True, trust_remote_code=True, tensor_parallel_size=1, disable_log_stats=True,
              swap_space=4, dtype="auto", hf_overrides={}, seed=0)
    assert llm.engine.blocks.num_blocks == 24 and llm.engine.config.scheduler.policy == "priority"
    from engine.serve.sizing import kv_bytes_per_block

    per_block = kv_bytes_per_block(2, model.cfg.num_key_value_heads, model.cfg.head_dim, 4, torch.float64)
    llm = LLM(model, tok, block_size=4, kv_cache_memory_bytes=10 * per_block + 1)
    assert llm.engine.blocks.num_blocks == 10
    for bad, match in [({"tensor_parallel_size": 2}, "tensor_parallel_size=2 is not supported.*chapter 41"),
                       ({"quantization": "awq"}, "quantization='awq' is not supported"),
                       ({"spec_method": "ngram"}, "speculative decoding is chapter 37"),
                       ({"max_loras": 2}, "unknown LLM option 'max_loras'"),
                       ({"num_blockz": 4}, "unknown LLM option 'num_blockz'"),
                       ({"num_blocks": 4, "kv_cache_memory_bytes": 10**6}, "not both")]:
        with pytest.raises(ValueError, match=match):
            LLM(model, tok, **bad)



def test_the_default_configuration_is_the_fastest_and_a_named_one_wins(model, tok, monkeypatch):
    """Without attention_backend/flat_model, LLM serves with the fastest configuration
    (choose.fastest_options: the "cpu" backend and the "fused" flat model on a CPU with a C++
    compiler, as the fast tests here need) and its tokens equal generate()'s; a named piece wins
    over the default; where the cpu kernel cannot be built, the "torch" backend serves instead."""
    from engine.fast import choose
    from engine.fast import cpu_attention

    prompt = _prompt(41, tok)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    fast = LLM(model, tok, block_size=4, num_blocks=64)
    assert (fast.engine.config.attention_backend, fast.engine.config.flat_model) == ("cpu", "fused"), \
        "LLM's default should be choose.fastest_options() for the model's device and dtype"
    assert type(fast.engine.flat).__name__ == "FusedFlatModel"
    assert list(fast.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids) == _oracle(model, prompt)
    plain = LLM(model, tok, block_size=4, num_blocks=64, attention_backend="reference", flat_model="flat")
    assert (plain.engine.config.attention_backend, plain.engine.config.flat_model) == ("reference", "flat")
    half = LLM(model, tok, block_size=4, num_blocks=64, flat_model="flat")  # one named, the other the fastest
    assert (half.engine.config.attention_backend, half.engine.config.flat_model) == ("cpu", "flat")

    def no_compiler():
        raise ValueError("no C++ compiler")

    monkeypatch.setattr(cpu_attention, "load_kernel", no_compiler)
    assert choose.fastest_options("cpu", torch.float64) == {"attention_backend": "torch", "flat_model": "fused"}
    assert choose.fastest_options("cpu", torch.float16)["attention_backend"] == "torch"  # no float16 kernel

def test_methods(llm, model, tok):
    prompt = _prompt(12, tok, n=9)
    params = SamplingParams(**GREEDY)
    llm.generate({"prompt_token_ids": prompt}, params)
    assert llm.reset_prefix_cache() is True
    [again] = llm.generate({"prompt_token_ids": prompt}, params)
    assert again.num_cached_tokens == 0, "reset_prefix_cache forgot the cached blocks"
    assert llm.get_tokenizer() is tok and llm.get_world_size() == 1
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:prefix_cache_queries"] > 0
    assert llm.llm_engine.get_num_unfinished_requests() == 0 and not llm.llm_engine.has_unfinished_requests()
    ids = llm.enqueue([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}], params)
    assert llm.llm_engine.get_num_unfinished_requests() == 2
    outs = llm.wait_for_completion()
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == [_oracle(model, prompt), _oracle(model, prompt[:5])]
    for name in ("encode", "embed", "score", "beam_search", "sleep", "collective_rpc", "update_weights"):
        with pytest.raises(ValueError, match=rf"LLM.{name}: "):
            getattr(llm, name)("x")


HOSTILE_TEMPLATES = {  # template: what the one-line ValueError must say
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x": "lines of template code",
    "{{ 'a' * 2**40 }}": "repeats a str of 1 items",
    "{{ (range(1000)|list) * 10**8 }}": "repeats a list",
    "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}":
        "would build",
    "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}":
        "it built a str",
    "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}": "a replace\\(\\) would build",
    "{{ 'a'|center(2**40) }}": "to a filter or method",
    "{{ '%999999999d' % 1 }}": "width of millions",
    "{{ '{:>9999999999}'.format(1) }}": "width of millions",
    "{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}": "rendered more than",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}": "recursed too deeply",
    "{{ raise_exception('roles must alternate') }}": "failed: TemplateError: roles must alternate",
    "{{ 1 / 0 }}": "failed: ZeroDivisionError",
}


def test_chat_templates_are_bounded(llm, tok, monkeypatch):
    """A template is code from a download: whatever it does, chat() answers with one ValueError in
    bounded time and memory (no hang, no MemoryError), and the LLM serves normally afterwards."""
    from engine import chat_template

    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_STEPS", 200_000)  # the default's 5M takes ~2 s to reach
    params = SamplingParams(**GREEDY)
    convo = [{"role": "user", "content": "hello world"}]
    for template, match in HOSTILE_TEMPLATES.items():
        with pytest.raises(ValueError, match=match):
            llm.chat(convo, params, chat_template=template)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128
    [out] = llm.chat(convo, params, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(convo) and len(out.outputs[0].token_ids) == MAX_NEW


def test_chat_content_parts_become_their_text(llm, tok):
    """OpenAI-style content parts reach the template as their text (joined by newlines), as in
    vLLM's "string" content format; never as a Python repr. Other part types are refused by name."""
    params = SamplingParams(**GREEDY)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "hello\nworld"}]
    [a] = llm.chat(parts, params, use_tqdm=False)
    [b] = llm.chat(plain, params, use_tqdm=False)
    assert a.prompt == b.prompt == tok.apply_chat_template(plain) and "{" not in a.prompt
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert parts[0]["content"][0] == {"type": "text", "text": "hello"}, "the caller's messages must not change"
    for content, match in [([{"type": "image_url", "image_url": {"url": "x"}}], "'image_url' is not supported"),
                           ([{"text": "no type"}], "expected \\{'type': 'text'"), (42, "content must be a string")]:
        with pytest.raises(ValueError, match=match):
            llm.chat([{"role": "user", "content": content}], params)
    assert not llm.engine.has_unfinished()


def test_chat_options(llm, tok):
    convo = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick"}]
    params = SamplingParams(max_tokens=3, **{k: v for k, v in GREEDY.items() if k != "max_tokens"})
    [out] = llm.chat(convo, params, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nthe quick"), out.prompt
    [out] = llm.chat(convo[:1], params, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert out.prompt == "[hello world]"
    [out] = llm.chat(convo[:1], params, chat_template_kwargs={"bos_token": "<|endoftext|>"})
    assert out.prompt.startswith("<|endoftext|><|im_start|>user"), "template kwargs override special tokens"
    with pytest.raises(ValueError, match="choose one"):
        llm.chat(convo, params, continue_final_message=True)
    with pytest.raises(ValueError, match="no conversation"):
        llm.chat([], params)


# --------------------------------------------------------------------------- text input


def test_text_input_is_checked(llm, tok):
    params = SamplingParams(**GREEDY)
    for bad, match in [("caf\udce9", "not valid text: surrogates not allowed"),
                       (b"caf\xe9", "is bytes; decode it"),
                       ("", "prompt 0 is empty"),
                       ([], "no prompts given"),
                       ({"prompt_token_ids": []}, "prompt 0 is empty \\(no token ids\\)")]:
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, params)
    with pytest.raises(ValueError, match="not valid text"):
        llm.chat([{"role": "user", "content": "\ud800"}], params)
    with pytest.raises(ValueError, match="stop string is not valid text"):
        SamplingParams(stop=["\udc80"])
    assert not llm.engine.has_unfinished()


def test_cache_salt_keeps_tenants_apart(llm, model, tok):
    """vLLM's ``cache_salt``: prompts of different salts (or salt and none) never share a cached
    block, so ``num_cached_tokens`` never tells one tenant what another sent; the same salt shares."""
    p = _prompt(50, tok, n=13)
    params = SamplingParams(**GREEDY)

    def cached(prompt) -> int:
        [out] = llm.generate(prompt, params, use_tqdm=False)
        assert out.outputs[0].token_ids == _oracle(model, out.prompt_token_ids)
        return out.num_cached_tokens

    assert cached({"prompt_token_ids": p, "cache_salt": "tenant-a"}) == 0
    assert cached({"prompt_token_ids": p, "cache_salt": "tenant-b"}) == 0, "tenant b adopted tenant a's blocks"
    assert cached({"prompt_token_ids": p}) == 0, "an unsalted prompt adopted a salted tenant's blocks"
    assert cached({"prompt_token_ids": p, "cache_salt": "tenant-a"}) == 12, "the same salt must share"
    text = tok.decode(p)
    assert cached({"prompt": text, "cache_salt": "tenant-c"}) == 0
    for salt, match in [("", "cache_salt must be a non-empty string"), (7, "cache_salt must be a non-empty string"),
                        ("\udc80", "not valid text")]:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_token_ids": p, "cache_salt": salt}, params)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_unknown_dict_prompt_keys_are_refused_by_name(llm, tok):
    p = _prompt(51, tok)
    params = SamplingParams(**GREEDY)
    for extra, match in [({"multi_modal_data": {"image": None}}, "'multi_modal_data' is not supported"),
                         ({"mm_processor_kwargs": {}}, "'mm_processor_kwargs' is not supported"),
                         ({"prompt_tokens_ids": [1]}, "unknown dict-prompt key 'prompt_tokens_ids'")]:
        for prompt in ({"prompt_token_ids": p, **extra}, {"prompt": "hello", **extra}):
            with pytest.raises(ValueError, match=match):
                llm.generate([{"prompt_token_ids": p}, prompt], params)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_n_set_to_zero_after_construction_is_refused(llm, tok):
    """SamplingParams checks n at construction; a later ``params.n = 0`` must be refused when the
    request is added, not queue nothing (EngineCore) or end in an IndexError (LLM.generate)."""
    params = SamplingParams(**GREEDY)
    params.n = 0
    with pytest.raises(ValueError, match="n must be an integer >= 1 .*got 0"):
        llm.generate({"prompt_token_ids": _prompt(52, tok)}, params)
    with pytest.raises(ValueError, match="n must be an integer >= 1 .*got 0"):
        llm.engine.add_request("x", _prompt(52, tok), params)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        list(llm.stream(_prompt(52, tok), params))
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_red_team_vllm_surface_refusals(llm, tok):
    """Second round's own findings: each a one-line ValueError that leaves the LLM untouched."""
    params = SamplingParams(**GREEDY)
    convo = [{"role": "user", "content": "hi"}]
    for call, match in [
        (lambda: llm.chat(convo, params, chat_template_kwargs=5), "chat_template_kwargs must be a dict"),
        (lambda: llm.chat(convo, params, chat_template_kwargs={"messages": []}), "chat\\(\\)'s own arguments"),
        (lambda: llm.chat(convo, params, tools=5), "tools must be a list of tool schemas"),
        (lambda: llm.generate({"prompt_token_ids": "abc"}, params), "prompt_token_ids must be a list of token ids"),
        (lambda: llm.generate("hi", SamplingParams(n=10**9)), "n must be an integer >= 1 \\(at most 4096\\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_params_changed_after_construction_are_checked_and_copied(llm, model, tok):
    """A field set after construction is checked (and normalised) as at construction, on a copy:
    ``params.stop = "x"`` is one stop string, not one per character; a change after generate()
    queued the request does not reach it."""
    prompt, tokens, stop, k, full = _boundary_case(model, tok, 3)
    params = SamplingParams(**GREEDY)
    params.stop = stop  # a str, not the list construction would have made of it
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert out.outputs[0].text == full[:full.find(stop)] and out.outputs[0].stop_reason == stop
    assert params.stop == stop, "the caller's object must be left as it was"
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_stream_of_an_empty_prompt_says_so(llm):
    params = SamplingParams(**GREEDY)
    for bad, match in [([], "the prompt is empty \\(no token ids\\)"), ("", "the prompt is empty"),
                       ({"prompt_token_ids": []}, "prompt 0 is empty"), ({"prompt": ""}, "prompt 0 is empty")]:
        with pytest.raises(ValueError, match=match):
            next(llm.stream(bad, params))
    with pytest.raises(ValueError, match="not a list"):
        next(llm.stream([[1, 2], [3]], params))
    assert not llm.engine.has_unfinished()


# --------------------------------------------------------------------------- sharing one LLM


def test_two_threads_share_one_llm(llm, model, tok):
    prompts = {name: [_prompt(20 + i * 7 + j, tok) for j in range(3)] for i, name in enumerate("ab")}
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(name):
        try:
            barrier.wait()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[name]], SamplingParams(**GREEDY))
            results[name] = [o.outputs[0].token_ids for o in outs]
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in "ab":
        assert results[name] == [_oracle(model, p) for p in prompts[name]], f"thread {name} got others' tokens"
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_interleaved_streams_and_generate_inside_a_stream(llm, model, tok):
    p1, p2, p3 = _prompt(31, tok), _prompt(32, tok), _prompt(33, tok)
    s1 = llm.stream({"prompt_token_ids": p1}, SamplingParams(**GREEDY))
    s2 = llm.stream({"prompt_token_ids": p2}, SamplingParams(**GREEDY))
    got1, got2, inner = [], [], None
    for d1 in s1:
        got1 += d1.token_ids
        d2 = next(s2, None)
        if d2 is not None:
            got2 += d2.token_ids
        if inner is None:  # a generate() in the middle of both streams
            [inner] = llm.generate({"prompt_token_ids": p3}, SamplingParams(**GREEDY))
    got2 += [t for d in s2 for t in d.token_ids]
    assert got1 == _oracle(model, p1) and got2 == _oracle(model, p2), "a stream lost tokens"
    assert inner.outputs[0].token_ids == _oracle(model, p3)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


def test_a_stream_closed_early_leaves_nothing_behind(llm, tok):
    with warnings.catch_warnings():
        s = llm.stream({"prompt_token_ids": _prompt(40, tok)}, SamplingParams(**GREEDY))
        next(s)
        s.close()
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128


# --------------------------------------------------------------------------- a checkpoint directory


def test_defaults_from_generation_config_and_template_files(tmp_path):
    """generate() without params uses generation_config.json's sampling fields, as vLLM does;
    generation_config="vllm" ignores them. chat_template= takes a file; a non-UTF-8 one is refused."""
    import json

    tiny = load_by_path("tiny_hf_checkpoint", "scripts/tiny_hf_checkpoint.py")
    d = tiny.save_tiny_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update(temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=7, do_sample=True)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    llm = LLM(d, block_size=4, num_blocks=32, chat_template=str(template))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=7)
    [out] = llm.generate("hello world", use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 7
    [out] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=2))
    assert out.prompt == "<hi>"
    plain = LLM(d, block_size=4, num_blocks=32, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    template.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        LLM(d, block_size=4, num_blocks=32, chat_template=str(template))


def test_a_request_aborted_in_the_core_ends_as_abort(llm, tok):
    """Someone aborts our request in the core directly: generate() returns it as aborted instead of
    waiting for an output that will never come."""
    s = llm.stream({"prompt_token_ids": _prompt(41, tok)}, SamplingParams(**GREEDY))
    first = next(s)
    llm.engine.abort_request(next(iter(llm._live)))
    rest = list(s)
    assert first.token_ids and rest[-1].finish_reason == "abort"
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 128
