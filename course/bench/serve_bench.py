"""``python run.py bench-serve``: load an OpenAI-compatible server the way ``vllm bench serve`` does.

    python run.py bench-serve                                  # starts run.py serve's app in-process (shipped model)
    python run.py bench-serve --max-concurrency 8 --num-prompts 64
    python run.py bench-serve --request-rate 4 --base-url http://127.0.0.1:8000 --served-model-name qwen3

The workload is fixed by ``--seed``: ``--num-prompts`` random token-id prompts of ``--input-len``
tokens, each asking for exactly ``--output-len`` tokens (greedy, ``ignore_eos``), so two servers
on the same model get the same work. Requests arrive as a Poisson process at ``--request-rate``
per second (seeded; ``inf``: all at once), at most ``--max-concurrency`` at a time. Each is a
streamed completion with ``stream_options.include_usage``; from the client's side it measures:
TTFT (send to first text), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (the gaps between
streamed chunks), and the request and output-token throughput over the run. It prints the CPU
too: a figure without the machine it came from means little. Against ``vllm serve``, point
``--base-url`` at it (same model, same flags: the same prompts reach both).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Result:
    """One request as the client saw it (seconds, ``time.perf_counter``)."""

    ok: bool
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def workload(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps of mean 1/rate (0 for rate inf)."""
    r = random.Random(seed + 1)
    return [0.0 if math.isinf(rate) else r.expovariate(rate) for _ in range(num)]


async def _one(client, url: str, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = Result(ok=False), None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0 and last is not None
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   concurrency: int | None, seed: int) -> tuple[list[Result], float]:
    """Send every prompt (Poisson arrivals, bounded concurrency); the results and the wall time."""
    import httpx

    limit = asyncio.Semaphore(concurrency or len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts))) as client:
        async def limited(prompt):
            async with limit:
                return await _one(client, url, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), rate, seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan for no values."""
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall,
           "request_throughput": len(ok) / wall, "output_throughput": sum(r.output_tokens for r in ok) / wall}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl)):
        out[f"mean_{name}_ms"] = 1000 * (sum(values) / len(values)) if values else math.nan
        for q in (50, 90, 99):
            out[f"p{q}_{name}_ms"] = 1000 * percentile(values, q)
    return out


def table(summary: dict[str, float]) -> str:
    lines = [f"{'requests completed / failed':<30} {summary['completed']} / {summary['failed']}",
             f"{'duration (s)':<30} {summary['duration_s']:.2f}",
             f"{'request throughput (req/s)':<30} {summary['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<30} {summary['output_throughput']:.1f}",
             "", f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl"):
        lines.append(f"{name.upper():<8}" + "".join(f"{summary[f'{k}_{name}_ms']:>10.1f}"
                                                   for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


class LocalServer:
    """``run.py serve``'s app on a free 127.0.0.1 port, in a thread of this process."""

    def __init__(self, model_dir: str, name: str, capacity: int) -> None:
        import uvicorn

        from engine.entrypoints.openai_server import build_app
        from engine.llm import LLM

        self.llm = LLM(model_dir)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.llm, name, capacity=capacity), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(3000):  # bounded: 30 s
            if self.server.started or not self.thread.is_alive():
                break
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the in-process server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def bench_serve_main(argv: list[str]) -> int:
    from course.bench.machine import cpu_model_and_flags
    from course.train.tiny import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="run.py bench-serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start run.py serve's app here)")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint for the in-process server")
    p.add_argument("--served-model-name", default=None, help="the model name to ask for (default: the directory's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this (default: the model's)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("solution", "engine"), default="solution")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    name = args.served_model_name or Path(args.model).expanduser().resolve().name
    server = None
    if args.base_url is None:
        server = LocalServer(args.model, name, capacity=max(256, args.num_prompts))
        url, vocab = server.url, server.llm.model.cfg.vocab_size
    else:
        url, vocab = args.base_url.rstrip("/"), args.vocab_size or 1000
    try:
        prompts = workload(args.num_prompts, args.input_len, args.vocab_size or vocab, args.seed)
        results, wall = asyncio.run(run_load(url, name, prompts, args.output_len, args.request_rate,
                                             args.max_concurrency, args.seed))
    finally:
        if server is not None:
            server.close()
    cpu, _ = cpu_model_and_flags()
    print(f"server {url} ({'in-process run.py serve' if server else 'given'}), model {name}, CPU {cpu}")
    print(f"{args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out; request rate "
          f"{args.request_rate}, max concurrency {args.max_concurrency or 'unlimited'}, seed {args.seed}")
    print(table(summarize(results, wall)))
    errors = sorted({r.error for r in results if r.error})
    for e in errors[:3]:
        print(f"failed: {e}", file=sys.stderr)
    return 0 if not errors else 1
