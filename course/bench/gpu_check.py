"""GPU check (``make gpu-check``): the Triton backend compiled on CUDA, and the bench on a Qwen3-0.6B shape.

Three parts, each printed as it finishes (and all of it written with ``--json PATH``):
1. Correctness: the compiled Triton kernel against the reference and torch backends on random
   ragged batches (GQA, windows, padding, several block sizes) in float32 and bfloat16, and the
   engine end to end (greedy tokens on the Triton backend equal the torch backend's).
2. Kernel bandwidth: decode batches on a Qwen3-0.6B attention shape (16 query / 8 kv heads of
   128, bfloat16); K/V bytes read per call / kernel time, for the Triton and torch backends.
3. ``run.py bench`` on a randomly initialised model with Qwen3-0.6B's shapes (hidden 1024, 28
   layers, vocab 151,936) in bfloat16: engines side by side and the scaling table.

Needs a CUDA device and triton; without them it says so and exits with status 1.
    python -m course.bench.gpu_check [--quick] [--json PATH] [--skip-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("ENGINE_IMPL", "solution")  # the reference implementation of chapter 31's holes

import torch  # noqa: E402


def require_gpu() -> torch.device:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("gpu_check: unset TRITON_INTERPRET; this script runs the COMPILED kernel on a GPU")
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device found (torch.cuda.is_available() is False). This check needs an "
                 "NVIDIA GPU and a CUDA build of torch; on a CPU run `make test-triton` instead.")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("gpu_check: triton is not installed: pip install -e .[triton]")
    return torch.device("cuda")


# ----- 1. correctness -------------------------------------------------------------------------
def check_kernel(device: torch.device) -> list[dict]:
    from test_backends import CASES, random_paged_batch

    from engine.serve.attention import ReferenceBackend
    from engine.fast.torch_attention import TorchBackend
    from engine.fast.triton_attention import TritonBackend

    rows = []
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for seed, block_size, hq, hkv, window in CASES:
            q, (k, v), meta = random_paged_batch(seed, block_size, hq, hkv, head_dim=64, dtype=dtype)
            q, cache = q.to(device), (k.to(device), v.to(device))
            meta = type(meta)(**{f: (getattr(meta, f).to(device) if f in ("query_start_loc", "seq_lens",
                                                                             "block_table", "slot_mapping")
                                     else getattr(meta, f)) for f in meta.__dataclass_fields__})
            want = ReferenceBackend().forward(q.float(), (cache[0].float(), cache[1].float()), meta, window=window)
            for name, backend in (("triton", TritonBackend()), ("torch", TorchBackend())):
                got = backend.forward(q, cache, meta, window=window).float()
                err = (got - want).abs().max().item()
                rows.append({"backend": name, "dtype": str(dtype)[6:], "case": [seed, block_size, hq, hkv, window],
                             "max_err": err, "ok": err < tol})
    bad = [r for r in rows if not r["ok"]]
    print(f"[1] kernel vs reference: {len(rows) - len(bad)}/{len(rows)} cases within tolerance"
          + ("" if not bad else f"; FAILED: {bad}"))
    return rows


def check_engine(device: torch.device) -> dict:
    from engine.models.tiny import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams

    model = tiny_model(seed=2).to(device)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (21, 5, 40, 13, 77)]
    prompts[3] = prompts[2][:16] + prompts[3]
    outs = {}
    for backend in ("torch", "triton"):
        # Explicit pool sizes: a profiled pool would claim most of the GPU for a 2-layer model.
        for name, extra in (("ample", dict(num_blocks=256)), ("chunked", dict(num_blocks=256, max_num_batched_tokens=12)),
                            ("preempt", dict(num_blocks=12, block_size=8))):
            core = EngineCore(model, EngineConfig(attention_backend=backend, **extra))
            for i, p in enumerate(prompts):
                core.add_request(f"r{i}", p, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
            outs[backend, name] = core.run_until_done()
            assert name != "preempt" or core.preemptions > 0, "the 12-block pool was meant to preempt"
    same = {name: outs["triton", name] == outs["torch", name] for name in ("ample", "chunked", "preempt")}
    print(f"[1] engine greedy tokens, triton == torch backend: {same}")
    return same


# ----- 2. kernel bandwidth --------------------------------------------------------------------
def decode_batch(num_reqs: int, context: int, device: torch.device, block_size: int = 16, hq: int = 16,
                 hkv: int = 8, head_dim: int = 128, dtype=torch.bfloat16):
    """num_reqs decodes at ``context`` tokens each, blocks shuffled through a pool."""
    from engine.serve.batch import BatchMeta

    per = -(-context // block_size)
    perm = torch.randperm(num_reqs * per + 1)[: num_reqs * per].view(num_reqs, per)
    shape = (num_reqs * per + 2, block_size, hkv, head_dim)
    k = torch.randn(shape, dtype=dtype, device=device)
    v = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(num_reqs, hq, head_dim, dtype=dtype, device=device)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq = torch.full((num_reqs,), context, dtype=torch.int32)
    pos = context - 1
    slots = (perm[:, pos // block_size] * block_size + pos % block_size).long()
    meta = BatchMeta(query_start_loc=qsl.to(device), seq_lens=seq.to(device),
                     block_table=perm.to(torch.int32).to(device), slot_mapping=slots.to(device),
                     block_size=block_size, query_start_loc_cpu=qsl, seq_lens_cpu=seq,
                     max_query_len=1, max_seq_len=context)
    kv_bytes = 2 * num_reqs * context * hkv * head_dim * k.element_size()
    return q, (k, v), meta, kv_bytes


def time_cuda(fn, iters: int = 50) -> float:
    """Median milliseconds of fn() by CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bandwidth(device: torch.device, quick: bool) -> list[dict]:
    from engine.fast.torch_attention import TorchBackend
    from engine.fast.triton_attention import TritonBackend

    rows = []
    shapes = ((64, 1024), (256, 512)) if quick else ((16, 4096), (64, 1024), (256, 512), (256, 2048))
    for num_reqs, context in shapes:
        q, cache, meta, kv_bytes = decode_batch(num_reqs, context, device)
        for name, backend in (("triton", TritonBackend()), ("torch", TorchBackend())):
            ms = time_cuda(lambda: backend.forward(q, cache, meta))
            rows.append({"backend": name, "requests": num_reqs, "context": context, "ms": round(ms, 4),
                         "kv_MB": round(kv_bytes / 1e6, 1), "GB_s": round(kv_bytes / ms / 1e6, 1)})
            print(f"[2] {name:6s} decode {num_reqs:4d} x {context:5d} tokens: {ms:8.3f} ms, "
                  f"{rows[-1]['GB_s']:8.1f} GB/s of K/V read")
        del cache
        torch.cuda.empty_cache()
    return rows


# ----- 3. the bench on a Qwen3-0.6B shape ------------------------------------------------------
def qwen3_06b_shaped(device: torch.device):
    """A randomly initialised model with Qwen3-0.6B's shapes, bfloat16, on ``device``."""
    from engine.models import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                      max_position_embeddings=40960, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer bandwidth shapes, smaller bench, no scaling at 256")
    ap.add_argument("--skip-bench", action="store_true", help="only the kernel checks and bandwidth")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    device = require_gpu()
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    report: dict = {"device": torch.cuda.get_device_name(device)}
    start = time.perf_counter()
    report["kernel"] = check_kernel(device)
    report["engine_agrees"] = check_engine(device)
    report["bandwidth"] = bandwidth(device, args.quick)
    if not args.skip_bench:
        from course.bench.compare import run_bench

        model = qwen3_06b_shaped(device)
        print("[3] bench on a Qwen3-0.6B-shaped random model (bfloat16)")
        bench = run_bench(model, ["shared", "random", "chat"], ["ch24", "reference", "fast", "hf"],
                          fast_backend="triton", scaling=(16, 64) if args.quick else (16, 64, 256),
                          scaling_backends=("torch", "triton") if args.quick else ("reference", "torch", "triton"),
                          scaling_steps=10, scale=0.5 if args.quick else 1.0)
        bench.pop("_results")
        report["bench"] = bench
    ok = all(r["ok"] for r in report["kernel"]) and all(report["engine_agrees"].values())
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
