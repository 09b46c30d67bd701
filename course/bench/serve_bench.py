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
too: a figure without the machine it came from means little. Against a server already running,
point ``--base-url`` at it.

``--peer vllm`` races ``vllm serve`` (from ``.venv-peers``, which ``make -o .venv/.installed
.venv-peers/.installed`` builds; ``--vllm-python`` for another) against ``run.py serve`` in one
sitting, fairly by construction:

- both are separate processes on 127.0.0.1 started here on the same checkpoint directory (the
  shipped model by default), the same dtype, block size (32: vLLM-CPU wants a multiple of 32),
  ``max_num_seqs``, step token budget, 1 GiB K/V pool, OpenMP thread count and prefix-cache
  policy (on for both, or ``--no-enable-prefix-caching`` for both);
- the same requests: greedy, ``ignore_eos``, the same token-id prompts and ``max_tokens``; round
  r's prompts are drawn with seed ``--seed + r`` and sent to both, so no round hits the blocks
  of another (and an untimed warm-up round on other prompts pays each server's first-request costs);
- ``--rounds`` interleaved rounds (ours then vLLM's, then the other way round, ...), so a slow
  spell of a shared machine lands on both; the table gives each metric's median over the rounds
  and the ratio, and how many of the requests' greedy texts differ between the two.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
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
    text: str = ""  # the streamed completion, whole


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
                res.text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
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


ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEER_BLOCK_SIZE = 32  # vLLM-CPU's attention wants a multiple of 32; both servers get it
KV_CACHE_GIB = 1  # both servers' K/V pool (vLLM-CPU: VLLM_CPU_KVCACHE_SPACE)
RACE_METRICS = (("request_throughput", "req/s", True), ("output_throughput", "output tok/s", True),
                ("p50_ttft_ms", "TTFT p50 (ms)", False), ("p99_ttft_ms", "TTFT p99 (ms)", False),
                ("p50_tpot_ms", "TPOT p50 (ms)", False), ("p50_itl_ms", "ITL p50 (ms)", False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in its own process group on 127.0.0.1 (``argv`` with ``env`` added), its output in
    ``log``; ``wait_ready`` polls ``/health`` (bounded by ``timeout`` seconds), ``close`` sends
    SIGINT to the group, then SIGKILL if it has not ended in 30 s."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.label, self.url, self.log_path = label, f"http://127.0.0.1:{port}", log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")
        self.argv = argv
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        self.startup_s = math.nan

    def wait_ready(self, timeout: float) -> None:
        import httpx

        start = time.perf_counter()
        for _ in range(int(timeout / 0.5) + 1):
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"{self.label} exited with status {self.proc.returncode} before serving: "
                                   + " | ".join(tail))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.startup_s = time.perf_counter() - start
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.label} did not answer /health within {timeout:.0f} s (its log: {self.log_path})")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def race_commands(args, name: str, vllm_python: Path, ours_port: int, peer_port: int
                  ) -> tuple[tuple[list[str], dict[str, str]], tuple[list[str], dict[str, str]]]:
    """The two servers' command lines and environments: the same checkpoint and settings for both."""
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    common = ["--host", "127.0.0.1", "--served-model-name", name, "--dtype", args.dtype,
              "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]
    ours = [sys.executable, str(ROOT / "run.py"), "serve", "--model", args.model, "--port", str(ours_port),
            "--kv-cache-memory-bytes", str(KV_CACHE_GIB * 2**30), "--impl", args.impl, *common,
            "--max-queue", str(max(256, args.num_prompts))]
    # vllm serve's own server, started as a module: vllm-cpu 0.32.0's `vllm` command fails before parsing
    # (importlib.metadata.version("vllm"): the distribution is named vllm-cpu), its API server module does not
    vllm = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(peer_port),
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
            "--seed", "0", *common]
    vllm_env = {**threads, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return (ours, threads), (vllm, vllm_env)


def race_table(rounds: dict[str, list[dict[str, float]]], labels: tuple[str, str]) -> str:
    """Each metric's median over the rounds for both servers, and ours / theirs."""
    a, b = labels
    lines = [f"{'median of ' + str(len(rounds[a])) + ' rounds':<22}{a:>15}{b:>15}{a + ' / ' + b:>28}"]
    for key, title, _ in RACE_METRICS:
        x = statistics.median(r[key] for r in rounds[a])
        y = statistics.median(r[key] for r in rounds[b])
        lines.append(f"{title:<22}{x:>15.2f}{y:>15.2f}{x / y if y else math.nan:>28.2f}")
    return "\n".join(lines)


async def first_divergence(urls: tuple[str, str], model: str, prompt: list[int], output_len: int) -> dict:
    """Ask both servers for ``prompt``'s greedy completion once more with the top 2 logprobs per
    token (untimed), and describe the first token where they part: its position, each server's
    choice, and each server's gap between its two most likely tokens there (a gap near 0 is a
    near-tie, where float rounding in either engine's kernels may pick either), and the two
    texts asked alone (``alone``: which server's batched text was not its own answer alone)."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 2}
    async with httpx.AsyncClient(timeout=600) as client:
        choices = [(await client.post(url + "/v1/completions", json=body)).json()["choices"][0] for url in urls]
    a, b = (c["logprobs"] for c in choices)
    alone = [c["text"] for c in choices]
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x != y:
            gaps = []
            for lp in (a, b):
                top = sorted(lp["top_logprobs"][i].values(), reverse=True)
                gaps.append(top[0] - top[1] if len(top) > 1 else math.nan)
            return {"position": i, "tokens": [x, y], "top2_gaps": gaps, "alone": alone}
    return {"position": None, "tokens": None, "top2_gaps": None, "alone": alone}  # equal when asked alone


def race_main(args, name: str) -> int:
    """``--peer vllm``: run.py serve against vllm serve, interleaved rounds (see the module's docstring)."""
    from course.bench.machine import machine_line

    vllm_python = Path(args.vllm_python) if args.vllm_python else PEERS_PYTHON
    if not vllm_python.exists():
        raise ValueError(f"no vLLM-CPU interpreter at {vllm_python}: run `make -o .venv/.installed "
                         f".venv-peers/.installed` or pass --vllm-python PATH")
    if not Path(args.model).expanduser().is_dir():
        raise ValueError(f"--model {args.model}: not a checkpoint directory (vllm serve needs one)")
    vocab = args.vocab_size or json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ours_port, peer_port = free_port(), free_port()
    (ours_argv, ours_env), (vllm_argv, vllm_env) = race_commands(args, name, vllm_python, ours_port, peer_port)
    logs = ROOT / "bench_results" / "serve"
    labels = ("run.py serve", "vllm serve")
    print(f"machine: {machine_line(args.threads)} (shared with other jobs: figures move with their load)")
    for label, argv, env in ((labels[0], ours_argv, ours_env), (labels[1], vllm_argv, vllm_env)):
        print(f"{label}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(argv)}")
    servers: list[ServerProcess] = []
    try:
        for label, argv, env, port, log in ((labels[0], ours_argv, ours_env, ours_port, logs / "ours.log"),
                                            (labels[1], vllm_argv, vllm_env, peer_port, logs / "vllm.log")):
            server = ServerProcess(label, argv, env, port, log)
            servers.append(server)
            server.wait_ready(args.startup_timeout)
            print(f"{label} ready in {server.startup_s:.1f} s (not timed with the rounds; its log: {log})")
        load = lambda srv, prompts: asyncio.run(run_load(srv.url, name, prompts, args.output_len,  # noqa: E731
                                                         args.request_rate, args.max_concurrency, args.seed))
        warm = workload(args.num_prompts, args.input_len, vocab, seed=10_000 + args.seed)
        for server in servers:  # untimed, the rounds' shapes on other prompts: each server's first-request costs
            load(server, warm)
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
        differ, failed, total, parted = 0, 0, 0, []
        for r in range(args.rounds):
            prompts = workload(args.num_prompts, args.input_len, vocab, args.seed + r)
            texts: dict[str, list[str]] = {}
            for server in (servers if r % 2 == 0 else servers[::-1]):
                results, wall = load(server, prompts)
                rounds[server.label].append(summarize(results, wall))
                failed += sum(not x.ok for x in results)
                texts[server.label] = [x.text if x.ok else None for x in results]
                print(f"round {r + 1} {server.label:<13} {rounds[server.label][-1]['output_throughput']:8.1f} "
                      f"output tok/s, {wall:.2f} s", flush=True)
            for i, (x, y) in enumerate(zip(texts[labels[0]], texts[labels[1]])):
                if x != y and x is not None and y is not None:
                    differ += 1
                    parted.append({"round": r + 1, "request": i, "prompt": prompts[i], "texts": [x, y]})
            total += len(prompts)
        for item in parted:  # untimed: where and why the greedy texts part
            item.update(asyncio.run(first_divergence((servers[0].url, servers[1].url), name, item["prompt"],
                                                     args.output_len)))
    finally:
        for server in servers[::-1]:
            server.close()
    print(f"\n{args.num_prompts} prompts x {args.input_len} random token ids in, {args.output_len} out (greedy, "
          f"ignore_eos); request rate {args.request_rate}, max concurrency {args.max_concurrency or 'unlimited'}; "
          f"dtype {args.dtype}, block size {args.block_size}, max_num_seqs {args.max_num_seqs}, prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'} (both)")
    print(race_table(rounds, labels))
    print(f"greedy texts: {differ} of {total} requests differ between the two servers; {failed} requests failed")
    for item in parted:
        gaps = item["top2_gaps"]
        kept = [label for label, text, solo in zip(labels, item["texts"], item["alone"]) if text == solo]
        where = (f"the same tokens on both (their logprobs' tokens agree), different texts: a detokenization "
                 f"difference (batched text equal to its own alone: {', '.join(kept) or 'neither'})"
                 if item["position"] is None else
                 f"part at output token {item['position']}: {item['tokens'][0]!r} vs {item['tokens'][1]!r}, top-2 "
                 f"logprob gap there {gaps[0]:.2e} ({labels[0]}) / {gaps[1]:.2e} ({labels[1]})")
        print(f"  round {item['round']} request {item['request']}: {where}")
    report = logs / "race.json"
    report.write_text(json.dumps({"machine": machine_line(args.threads), "commands": [ours_argv, vllm_argv],
                                  "rounds": rounds, "differ": differ, "total": total, "parted": parted}, indent=1))
    print(f"(rounds, commands and the parted texts: {report})")
    return 0 if failed == 0 else 1


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
    race = p.add_argument_group("--peer vllm: race vllm serve (both servers started here, same settings)")
    race.add_argument("--peer", choices=("vllm",), default=None, help="race this peer's server against run.py serve")
    race.add_argument("--vllm-python", default=None, help="vLLM-CPU's interpreter (default: .venv-peers/bin/python)")
    race.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the table gives medians")
    race.add_argument("--threads", type=int, default=1,
                      help="OpenMP threads per server (default 1: on a shared machine more threads spin-wait on each other)")
    race.add_argument("--dtype", default="float32")
    race.add_argument("--block-size", type=int, default=PEER_BLOCK_SIZE)
    race.add_argument("--max-num-seqs", type=int, default=256)
    race.add_argument("--max-num-batched-tokens", type=int, default=2048)
    race.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                      help="the prefix-cache policy of both servers (default on)")
    race.add_argument("--startup-timeout", type=float, default=900, help="seconds each server may take to start")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    name = args.served_model_name or Path(args.model).expanduser().resolve().name
    if args.peer is not None:
        if args.base_url is not None:
            raise ValueError("--peer starts both servers itself: leave out --base-url")
        if args.rounds < 1 or args.threads < 1:
            raise ValueError("--rounds and --threads must be at least 1")
        return race_main(args, name)
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
