"""``python run.py serve``: the OpenAI-compatible server (``engine.entrypoints.openai_server``).

    python run.py serve                                   # models/qwen3-kjv-tiny on 127.0.0.1:8000
    python run.py serve --model ~/models/Qwen3-0.6B --port 8001 --max-num-seqs 32
    python run.py serve --block-size 32 --no-enable-prefix-caching     # vllm serve's flag names
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# the repository's shipped model (course/train/tiny.py's DEFAULT_MODEL; the engine never imports course/)
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "qwen3-kjv-tiny"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py serve", description="An OpenAI-compatible server on the chapter's core.")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: models/qwen3-kjv-tiny)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once (the scheduler's)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached prompt blocks (default on; --no-enable-prefix-caching: off), as vllm serve's flag")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step's token budget (the scheduler's)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="size the K/V pool to this many bytes (default: the engine's sizing)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most completions queued or running at once; past it the server answers 503 (default 256)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | float64 | auto (the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: the loader's)")
    p.add_argument("--impl", choices=("solution", "engine"), default="solution",
                   help="which chapter-31 engine core runs (run.py applies it before importing engine)")
    return p


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from engine.entrypoints.openai_server import build_app
    from engine.llm import LLM

    if not Path(args.model).expanduser().is_dir():
        raise ValueError(f"--model {args.model}: not a checkpoint directory")
    options = {k: getattr(args, k) for k in ("max_num_seqs", "block_size", "enable_prefix_caching",
                                             "max_num_batched_tokens") if getattr(args, k) is not None}
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              **options)
    name = args.served_model_name or Path(args.model).expanduser().resolve().name
    app = build_app(llm, name, capacity=args.max_queue)
    impl = os.environ.get("ENGINE_IMPL", "solution")
    print(f"serving {name} ({'the reference engine' if impl == 'solution' else 'your engine'}, ENGINE_IMPL={impl}) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
