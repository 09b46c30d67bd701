"""``run.py serve``'s server, driven over HTTP on a loopback port by the real ``openai`` client.

The model is test_llm_api's: the 2-layer test model in float64 with a small byte-level BPE over
ASCII, so greedy choices are exact. Oracle: ``LLM.generate`` / ``LLM.chat`` of a second LLM on
the same model and configuration (run while the server is idle). Every wait is a bounded loop.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.openai_server import build_app
from engine.llm import LLM
from engine.models.tiny import tiny_model
from engine.serve import SamplingParams
from engine.tokenizer import Tokenizer
from pathload import ascii_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_NEW = 12
NAME = "tiny"
ENGINE = dict(block_size=4, num_blocks=256, max_num_seqs=16)
GREEDY = {"temperature": 0.0, "max_tokens": MAX_NEW, "extra_body": {"ignore_eos": True}}
WAIT_STEPS = 2000  # bounded waits: at most this many 10 ms naps


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return ascii_tokenizer(tmp_path_factory.mktemp("tok"), CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(seed=5, dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=256)


@pytest.fixture(scope="module")
def oracle(model, tok) -> LLM:
    return LLM(model, tok, **ENGINE)


class Served:
    """A uvicorn server in a thread on 127.0.0.1's free port, serving ``build_app(llm, ...)``."""

    def __init__(self, llm: LLM, capacity: int) -> None:
        self.llm = llm
        self.app = build_app(llm, NAME, capacity=capacity)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(WAIT_STEPS):
            if self.server.started or not self.thread.is_alive():
                break
            time.sleep(0.01)
        assert self.server.started, "the server did not start"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_idle(self) -> dict[str, float]:
        """/metrics once no request runs or waits and every block is free (bounded)."""
        for _ in range(WAIT_STEPS):
            m = self.metrics()
            if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0:
                return m
            time.sleep(0.01)
        raise AssertionError(f"the server never went idle: {m}")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def served(model, tok):
    s = Served(LLM(model, tok, **ENGINE), capacity=256)
    yield s
    s.close()


def _prompts(tok: Tokenizer, k: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    words = ["the", "fox", "and", "river", "light", "said", "over", "stone", "green", "seven"]
    return [" ".join(r.choice(words) for _ in range(r.randrange(2, 6))) for _ in range(k)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)


def test_completions_equal_generate(served, oracle, tok):
    prompts = _prompts(tok, 3)
    expected = oracle.generate(prompts, _greedy(), use_tqdm=False)
    r = served.client.completions.create(model=NAME, prompt=prompts, **GREEDY)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in expected]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * MAX_NEW
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    ids = expected[0].prompt_token_ids  # a token-id prompt: the same completion
    r = served.client.completions.create(model=NAME, prompt=ids, **GREEDY)
    assert r.choices[0].text == expected[0].outputs[0].text


def test_streamed_completion_concatenates_to_the_whole(served, oracle, tok):
    prompts = _prompts(tok, 2, seed=1)
    expected = [o.outputs[0].text for o in oracle.generate(prompts, _greedy(), use_tqdm=False)]
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in served.client.completions.create(model=NAME, prompt=prompts, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == expected and finish == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 2 * MAX_NEW


def test_chat_streamed_and_not_equal_llm_chat(served, oracle):
    convo = [{"role": "user", "content": "the fox said"}]
    [expected] = oracle.chat(convo, _greedy(), use_tqdm=False)
    r = served.client.chat.completions.create(model=NAME, messages=convo, **GREEDY)
    assert r.choices[0].message.content == expected.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       served.client.chat.completions.create(model=NAME, messages=convo, stream=True, **GREEDY)
                       if c.choices)
    assert streamed == expected.outputs[0].text


def test_n_seed_and_stop_match_generate(served, oracle, tok):
    [prompt] = _prompts(tok, 1, seed=2)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
    [expected] = oracle.generate(prompt, params, use_tqdm=False)
    r = served.client.completions.create(model=NAME, prompt=prompt, n=3, temperature=1.0, seed=11,
                                         max_tokens=MAX_NEW, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [c.text for c in expected.outputs]
    whole = oracle.generate(prompt, _greedy(), use_tqdm=False)[0].outputs[0].text
    stop = whole[4:6]  # two characters from inside the greedy text
    [cut] = oracle.generate(prompt, _greedy(stop=[stop]), use_tqdm=False)
    r = served.client.completions.create(model=NAME, prompt=prompt, stop=stop, **GREEDY)
    assert r.choices[0].text == cut.outputs[0].text == whole[:whole.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own(served, oracle, tok):
    prompts = _prompts(tok, 64, seed=3)
    expected = [o.outputs[0].text for o in oracle.generate(prompts, _greedy(), use_tqdm=False)]

    def one(i: int) -> str:
        if i % 2:
            return "".join(c.choices[0].text for c in served.client.completions.create(
                model=NAME, prompt=prompts[i], stream=True, **GREEDY) if c.choices)
        return served.client.completions.create(model=NAME, prompt=prompts[i], **GREEDY).choices[0].text

    with ThreadPoolExecutor(64) as pool:  # 64 clients at once (the engine runs 16, the rest wait)
        got = list(pool.map(one, range(len(prompts))))
    assert got == expected
    m = served.wait_idle()
    assert m["vllm:prefix_cache_queries_total"] > 0 and m["vllm:time_to_first_token_seconds_count"] >= 64


BAD = [({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
       ({"max_tokens": 0}, "max_tokens"), ({"extra_body": {"top_k": -5}}, "top_k"), ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
       ({"max_tokens": 10_000}, "max_tokens"), ({"extra_body": {"stop_token_ids": ["x"]}}, "stop_token_ids"),
       ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
       ({"extra_body": {"structured_outputs": {"json": {}}}}, "structured_outputs"),
       ({"extra_body": {"detokenize": False}}, "detokenize"),
       ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats")]


@pytest.mark.parametrize("kw,name", BAD, ids=[n for _, n in BAD])
def test_bad_parameters_get_a_400_naming_them(served, kw, name):
    body = {"temperature": 0.0, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=NAME, prompt="the fox", **body)
    err = info.value
    assert err.status_code == 400 and name in err.message and "\n" not in err.message
    assert "Traceback" not in err.response.text and err.body["type"] == "BadRequestError"
    assert served.client.completions.create(model=NAME, prompt="the fox", max_tokens=2).usage.completion_tokens >= 1


def test_other_refusals(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": NAME, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert [m.id for m in served.client.models.list().data] == [NAME]
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    ids = httpx.post(served.url + "/tokenize", json={"prompt": "the fox"}, timeout=30).json()["tokens"]
    assert httpx.post(served.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"] == "the fox"


def test_full_queue_answers_503_and_a_closed_stream_frees_its_blocks(tok):
    """capacity=1: a second request while a stream runs gets 503; closing the stream aborts it long
    before its 4000 tokens (the pool is free, and far fewer tokens were made)."""
    long_model = tiny_model(seed=5, dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=4096)
    s = Served(LLM(long_model, tok, block_size=4, num_blocks=1100), capacity=1)
    try:
        body = {"model": NAME, "prompt": "the fox", "max_tokens": 4000, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", s.url + "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
                r = client.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert "full" in r.json()["error"]["message"]
            m = s.wait_idle()  # the closed stream's request was aborted and its blocks freed
            assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:generation_tokens_total"] < 4000
            r = client.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        s.close()


def test_serve_defaults_to_the_shipped_model():
    from course.train.tiny import DEFAULT_MODEL
    from engine.entrypoints import cli

    args = cli.build_parser().parse_args([])
    assert cli.DEFAULT_MODEL == DEFAULT_MODEL and args.host == "127.0.0.1" and args.model == str(DEFAULT_MODEL)


def test_bench_serve_measures_every_request(served):
    """run.py bench-serve's client against the server: every request completes with exactly its
    output length; the percentiles are numpy's (linear interpolation)."""
    import asyncio
    import math

    import numpy as np

    from course.bench import serve_bench as sb

    prompts = sb.workload(6, 5, 160, seed=0)
    results, wall = asyncio.run(sb.run_load(served.url, NAME, prompts, 4, math.inf, 3, seed=0))
    assert all(r.ok and r.output_tokens == 4 for r in results), [r.error for r in results]
    summary = sb.summarize(results, wall)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_throughput"] == 24 / wall
    ttft = [r.ttft for r in results]
    for q in (50, 90, 99):
        assert math.isclose(summary[f"p{q}_ttft_ms"], 1000 * float(np.percentile(ttft, q)), rel_tol=1e-9)
    assert "TTFT" in sb.table(summary)


def test_logprobs_equal_the_engines_own(served, oracle, tok):
    """Completions' parallel lists and chat's entries carry the offline engine's logprobs: the sampled
    token's and its top-k, under the tokens' texts; streamed chunks carry the same per token."""
    prompt = _prompts(tok, 1, seed=3)[0]
    expected = oracle.generate([prompt], _greedy(logprobs=2), use_tqdm=False)[0].outputs[0]
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    want = [{text(k): v.logprob for k, v in e.items()} for e in expected.logprobs]
    sampled = [e[t].logprob for t, e in zip(expected.token_ids, expected.logprobs)]
    r = served.client.completions.create(model=NAME, prompt=prompt, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp.tokens == [text(t) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx(sampled, abs=1e-9)
    assert [dict(d) for d in lp.top_logprobs] == [pytest.approx(w, abs=1e-9) for w in want]
    chunks = served.client.completions.create(model=NAME, prompt=prompt, logprobs=2, stream=True, **GREEDY)
    streamed = [x for c in chunks for x in (c.choices[0].logprobs.token_logprobs if c.choices and c.choices[0].logprobs else [])]
    assert streamed == pytest.approx(sampled, abs=1e-9)
    assert r.choices[0].text == expected.text
    plain = served.client.completions.create(model=NAME, prompt=prompt, **GREEDY)
    assert plain.choices[0].logprobs is None, "no logprobs unless asked for"


def test_chat_logprobs_name_the_sampled_token_and_its_alternatives(served, oracle):
    messages = [{"role": "user", "content": "the river said"}]
    expected = oracle.chat(messages, _greedy(logprobs=2), use_tqdm=False)[0].outputs[0]
    r = served.client.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, t, e in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(e[t].logprob, abs=1e-9)
        assert bytes(entry.bytes).decode() == entry.token
        best = sorted((v.logprob for v in e.values()), reverse=True)[:2]  # the 2 most likely, the sampled one or not
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(best, abs=1e-9)


def test_a_plain_request_whose_client_disconnects_is_aborted(tok):
    """A non-streamed request of 4000 tokens whose client goes away mid-request is aborted in the
    engine (its blocks freed, far fewer than 4000 tokens made); a stream running beside it is
    unaffected (the oracle's greedy text), and the server takes the next request."""
    import asyncio

    long_model = tiny_model(seed=5, dtype=torch.float64, vocab_size=tok.vocab_size, max_position_embeddings=4096)
    engine = dict(block_size=4, num_blocks=1100)
    other_prompt, other_tokens = "the river", 40
    [expected] = LLM(long_model, tok, **engine).generate(
        other_prompt, SamplingParams(temperature=0.0, max_tokens=other_tokens, ignore_eos=True), use_tqdm=False)
    s = Served(LLM(long_model, tok, **engine), capacity=4)
    body = {"model": NAME, "prompt": "the fox", "max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}

    async def scenario() -> tuple[str, dict[str, float]]:
        async with httpx.AsyncClient(timeout=60) as doomed_client, httpx.AsyncClient(timeout=60) as client:
            doomed = asyncio.ensure_future(doomed_client.post(s.url + "/v1/completions", json=body))
            other = {**body, "prompt": other_prompt, "max_tokens": other_tokens, "stream": True}
            async with client.stream("POST", s.url + "/v1/completions", json=other) as stream:
                lines = stream.aiter_lines()
                texts = []
                async for line in lines:  # the stream's first token: it runs
                    if line.startswith("data: "):
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
                        break
                for _ in range(WAIT_STEPS):  # until the doomed request runs beside it
                    if (await asyncio.to_thread(s.metrics))["vllm:num_requests_running"] == 2:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the plain request never ran")
                doomed.cancel()  # the client goes away mid-request: its connection closes
                await asyncio.gather(doomed, return_exceptions=True)
                await doomed_client.aclose()
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(texts), await asyncio.to_thread(s.wait_idle)

    try:
        text, m = asyncio.run(scenario())
        assert text == expected.outputs[0].text  # the stream beside it: untouched
        assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
        assert m["vllm:generation_tokens_total"] < 4000  # aborted, not run to its end
        r = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        s.close()


def test_bench_serve_race_gives_both_servers_the_same_settings():
    """--peer vllm: both command lines carry the same checkpoint, dtype, block size, batch limits,
    prefix-cache policy and thread count; the table's figures are the rounds' medians and their ratio."""
    import argparse
    from pathlib import Path

    from course.bench import serve_bench as sb

    args = argparse.Namespace(threads=2, dtype="float32", block_size=32, max_num_seqs=64, max_num_batched_tokens=1024,
                              enable_prefix_caching=False, model="/m/tiny", impl="solution", num_prompts=8)
    (ours, ours_env), (vllm, vllm_env) = sb.race_commands(args, "tiny", Path("/p/bin/python"), 1001, 1002)

    def flags(argv: list[str]) -> dict[str, str]:
        out = {}
        for i, a in enumerate(argv):
            if a.startswith("--"):
                out[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        return out

    a, b = flags(ours), flags(vllm)
    for key in ("--model", "--dtype", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                "--no-enable-prefix-caching", "--host", "--served-model-name"):
        assert a[key] == b[key], key
    assert "--enable-prefix-caching" not in a and "--enable-prefix-caching" not in b
    assert ours_env["OMP_NUM_THREADS"] == vllm_env["OMP_NUM_THREADS"] == "2"
    assert a["--kv-cache-memory-bytes"] == str(int(vllm_env["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    rounds = {"x": [{k: v for k, _, _ in sb.RACE_METRICS} for v in (1.0, 3.0, 2.0)],
              "y": [{k: v for k, _, _ in sb.RACE_METRICS} for v in (4.0, 4.0, 8.0)]}
    row = sb.race_table(rounds, ("x", "y")).splitlines()[1].split()
    assert row[-3:] == ["2.00", "4.00", "0.50"]
