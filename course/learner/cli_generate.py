"""``python run.py generate``: stream one completion from a real checkpoint to the terminal.

    python run.py generate --prompt "And God said"        # the shipped models/qwen3-kjv-tiny
    python run.py generate --model ~/models/Qwen3-0.6B --prompt "The capital of France is"
    python run.py generate --model ~/models/Qwen3-0.6B --chat --prompt "Name three rivers." \\
        --max-tokens 200 --temperature 0.7 --seed 1

Without ``--model`` it runs the repository's own small real model, ``models/qwen3-kjv-tiny``
(a Qwen3 trained on the King James Bible by ``course/train/tiny.py``); any other checkpoint must
already be on disk (this engine never downloads). Text is printed as it is
produced, through the incremental detokenizer, so a character split across tokens appears
whole. Statistics (tokens, time, finish reason) go to stderr, keeping stdout for the text.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from course.train.tiny import DEFAULT_MODEL
from engine._impl import add_impl_argument


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py generate",
        description="Generate text from a local HF-format Qwen3 / Qwen3-MoE checkpoint directory.")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json); default: the "
                        "repository's small model trained on the King James Bible (models/qwen3-kjv-tiny)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the checkpoint's chat template")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: pass enable_thinking=False to the template (Qwen3 skips its <think> block)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = no nucleus cut (default)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: none)")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 | float64 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV-cache block size (default: the engine's, engine.serve.config.DEFAULT_BLOCK_SIZE)")
    add_impl_argument(p)  # run.py applies it (engine._impl.apply_impl) before importing engine
    return p


MAX_BLOCK_SIZE = 1024  # tokens per KV block; real engines use 16-256


def _device(name: str | None) -> str:
    """The --device to run on ("cpu", "cuda" or "cuda:N"), checked against this machine."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"--device {name!r} is not usable here: use cpu, cuda or cuda:N")
    if dev.type == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for, but this PyTorch sees no CUDA GPU; use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return str(dev)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


def generate_main(argv: list[str] | None = None) -> int:
    """Entry point of ``run.py generate``; returns the process exit status.

    A bad argument or checkpoint prints one line naming the problem and returns 2.
    """
    args = build_parser().parse_args(argv)
    from jinja2 import TemplateError

    from engine.llm import LLM
    from engine.models.hf_config import checkpoint_dir, read_config
    from engine.models.loader import load_model
    from engine.serve import SamplingParams
    from engine.serve.config import DEFAULT_BLOCK_SIZE
    from engine.tokenizer import Tokenizer

    streaming = False
    try:
        if not args.prompt:
            raise ValueError("--prompt is empty; give at least one character")
        device = _device(args.device)
        block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"--block-size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        t0 = time.perf_counter()
        checkpoint_dir(args.model)  # a missing directory is named as such before anything else
        tok = Tokenizer.from_pretrained(args.model)
        if args.chat:
            kwargs = {"enable_thinking": False} if args.no_thinking else {}
            text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], **kwargs)
            prompt_ids = tok.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tok.encode(args.prompt)
        if not prompt_ids:
            raise ValueError(f"--prompt {args.prompt[:20]!r} encodes to no tokens")
        _, cfg, _ = read_config(args.model)  # before any memory is sized: does the request fit at all?
        if len(prompt_ids) + args.max_tokens > cfg.max_position_embeddings:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the "
                             f"model's {cfg.max_position_embeddings} positions; lower --max-tokens")
        model = load_model(args.model, dtype=args.dtype, device=device)
        options: dict = {"block_size": block_size}
        if device == "cpu":
            # One request: size the pool to it instead of the default CPU memory budget.
            options["num_blocks"] = math.ceil((len(prompt_ids) + args.max_tokens) / block_size) + 1
        llm = LLM(model, tok, **options)
        numerics = getattr(llm.engine.flat, "numerics", None)  # a 16-bit model computed in float32 here
        print(f"[loaded {args.model} ({next(model.parameters()).dtype}) in "
              f"{time.perf_counter() - t0:.1f}s on {device}; prompt {len(prompt_ids)} tokens]", file=sys.stderr)
        if numerics:  # the README's one exception to "equals generate()"
            print(f"[numerics: {numerics}]", file=sys.stderr)
        streaming = True
        if not args.chat:
            sys.stdout.write(args.prompt)
        t1 = time.perf_counter()
        first = None
        n = 0
        reason = None
        for delta in llm.stream(prompt_ids, params):
            first = first or time.perf_counter()
            n += len(delta.token_ids)
            reason = delta.finish_reason or reason
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except (ValueError, OSError, TemplateError) as e:  # the user's input or files: one line, no traceback
        if streaming:
            sys.stdout.write("\n")
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C mid-stream: stream() has already aborted the request
        sys.stdout.write("\n")
        return 130
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t1
    ttft = (first or time.perf_counter()) - t1
    print(f"[{n} tokens in {elapsed:.2f}s ({n / max(elapsed, 1e-9):.1f} tok/s); time to first "
          f"token {ttft:.2f}s; finish_reason={reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(generate_main())
