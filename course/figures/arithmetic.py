"""``python -m course.figures.arithmetic``: every back-of-envelope figure the chapter and its docs quote.

Each figure is worked out here from a model's published shape (layers, widths, heads, vocabulary)
and a few stated hardware assumptions, and printed with the arithmetic that produced it, so a
reader can check it and change an assumption (``--pcie-gb-s``, ``--tflop-s``, ...). Nothing is
measured and nothing is downloaded: the shapes below are copied from the models' config.json.

    python -m course.figures.arithmetic                 # every section
    python -m course.figures.arithmetic kv swap         # only the named sections
    python -m course.figures.arithmetic --json          # the same numbers, one JSON object

Sections: weights (bytes and one pass's read time), lm-head (the cost of logits for a whole
prefill), kv (bytes of K/V per token), pool (what fits on one GPU), swap (swap against recompute
per token, for three models), keys (chapter 25's prefix keys against chained digests).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape, as in its config.json (matrices only: norms are a rounding error)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)  # q, k, v, o
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attn + mlp) + embed

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V


QWEN3_8B = Shape("Qwen3-8B", layers=36, hidden=4096, intermediate=12288, q_heads=32, kv_heads=8, head_dim=128,
                 vocab=151936, tied_embeddings=False)
QWEN3_06B = Shape("Qwen3-0.6B", layers=28, hidden=1024, intermediate=3072, q_heads=16, kv_heads=8, head_dim=128,
                  vocab=151936, tied_embeddings=True)
# DeepSeek-V3 caches one latent per token and layer (multi-head latent attention): kv_lora_rank 512
# plus the 64-dim shared RoPE key; 37 B parameters are active per token (of 671 B).
DSV3_LAYERS, DSV3_LATENT, DSV3_ROPE, DSV3_ACTIVE = 61, 512, 64, 37e9

G = 1e9


def weights(a: argparse.Namespace) -> dict:
    m = QWEN3_8B
    wbytes = m.params * 2
    pass_s = wbytes / (a.hbm_tb_s * 1e12)
    saved = (a.requests - 1) * pass_s
    print(f"{m.name}: {m.params / G:.2f} B parameters x 2 bytes (BF16) = {wbytes / G:.1f} GB of weights")
    print(f"  one pass reads them all: {wbytes / G:.1f} GB / {a.hbm_tb_s} TB/s = {pass_s * 1e3:.1f} ms")
    print(f"  {a.requests} decodes in one pass instead of {a.requests}: saves {a.requests - 1} x "
          f"{pass_s * 1e3:.1f} ms = {saved * 1e3:.0f} ms per step")
    qs = QWEN3_06B
    print(f"{qs.name}: {qs.params / G:.2f} B parameters = {qs.params * 2 / G:.1f} GB in BF16, "
          f"{qs.params * 4 / G:.1f} GB in FP32")
    return {"qwen3_8b_params": m.params, "qwen3_8b_weight_bytes": wbytes, "pass_ms": pass_s * 1e3,
            "saved_ms": saved * 1e3, "qwen3_06b_bf16_gb": qs.params * 2 / G, "qwen3_06b_fp32_gb": qs.params * 4 / G}


def lm_head(a: argparse.Namespace) -> dict:
    m, n = QWEN3_8B, a.prompt
    flop = 2 * n * m.hidden * m.vocab
    logits = n * m.vocab * 4
    print(f"{m.name} LM head over a {n:,}-token prefill: 2 x {n:,} x {m.hidden:,} x {m.vocab:,} = "
          f"{flop / 1e12:.2f} TFLOP; float32 logits {n:,} x {m.vocab:,} x 4 B = {logits / G:.2f} GB "
          f"(one row is needed: {m.vocab * 4 / 1024:.0f} KiB)")
    return {"lm_head_tflop": flop / 1e12, "logits_gb": logits / G}


def kv(a: argparse.Namespace) -> dict:
    out = {}
    for m in (QWEN3_8B, QWEN3_06B):
        b = m.kv_bytes_per_token()
        print(f"{m.name} K/V per token, BF16: 2 x {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} x 2 B "
              f"= {b:,} B ({b / 1024:.0f} KiB)")
        out[m.name] = b
    return {"kv_bytes_per_token": out}


def pool(a: argparse.Namespace) -> dict:
    m = QWEN3_8B
    budget = a.gpu_gb * a.utilization
    left = budget - m.params * 2 / G - a.activations_gb
    per_token = m.kv_bytes_per_token()
    tokens = left * G / per_token
    row_gb = a.static_row * per_token / G
    print(f"{m.name} on a {a.gpu_gb:.0f} GB GPU at {a.utilization:.0%}: {budget:.1f} GB - "
          f"{m.params * 2 / G:.1f} GB weights - {a.activations_gb:.0f} GB activations = {left:.1f} GB for K/V")
    print(f"  {left:.1f} GB / {per_token:,} B = {tokens:,.0f} tokens = {tokens / a.prompt:.0f} requests of "
          f"{a.prompt:,} tokens")
    print(f"  static rows of {a.static_row:,} tokens ({row_gb:.2f} GB each): {int(left / row_gb)} requests")
    return {"kv_gb": left, "pool_tokens": tokens, "paged_requests": tokens / a.prompt,
            "static_row_gb": row_gb, "static_requests": int(left / row_gb)}


def _swap_vs_recompute(name: str, kv_bytes: float, params: float, a: argparse.Namespace) -> dict:
    swap_s = 2 * kv_bytes / (a.pcie_gb_s * G)  # out and back in
    recompute_s = 2 * params / (a.tflop_s * 1e12)  # 2 FLOPs per parameter per token
    ratio = recompute_s / swap_s
    cheaper = "swap" if ratio > 1 else "recompute"
    print(f"{name}: swap 2 x {kv_bytes:,.0f} B / {a.pcie_gb_s:g} GB/s = {swap_s * 1e6:.1f} us; recompute "
          f"2 x {params / G:.2f} G FLOP / {a.tflop_s:g} TFLOP/s = {recompute_s * 1e6:.1f} us; "
          f"{cheaper} cheaper by {max(ratio, 1 / ratio):.1f}x")
    return {"swap_us": swap_s * 1e6, "recompute_us": recompute_s * 1e6, "recompute_over_swap": ratio}


def swap(a: argparse.Namespace) -> dict:
    print(f"per token, PCIe {a.pcie_gb_s:g} GB/s each way, compute {a.tflop_s:g} TFLOP/s "
          f"(--pcie-gb-s, --tflop-s):")
    out = {QWEN3_8B.name: _swap_vs_recompute(QWEN3_8B.name, QWEN3_8B.kv_bytes_per_token(), QWEN3_8B.params, a)}
    dsv3_kv = DSV3_LAYERS * (DSV3_LATENT + DSV3_ROPE) * 2
    print(f"DeepSeek-V3 latent per token: {DSV3_LAYERS} layers x ({DSV3_LATENT} + {DSV3_ROPE}) x 2 B = {dsv3_kv:,} B")
    out["DeepSeek-V3"] = _swap_vs_recompute("DeepSeek-V3", dsv3_kv, DSV3_ACTIVE, a)
    out[QWEN3_06B.name] = _swap_vs_recompute(QWEN3_06B.name, QWEN3_06B.kv_bytes_per_token(), QWEN3_06B.params, a)
    return out


def keys(a: argparse.Namespace) -> dict:
    block, n = 16, a.prompt
    blocks = n // block
    ids = sum(block * (k + 1) for k in range(blocks))
    print(f"a {n:,}-token prompt in blocks of {block}: {blocks} blocks; prefix-tuple keys hold "
          f"{ids:,} token ids between them, chained digests {blocks} x 16 B = {blocks * 16:,} B")
    return {"blocks": blocks, "key_token_ids": ids}


SECTIONS = {"weights": weights, "lm-head": lm_head, "kv": kv, "pool": pool, "swap": swap, "keys": keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.figures.arithmetic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", choices=[*SECTIONS, []], metavar="SECTION",
                    help=f"which to print (default all): {', '.join(SECTIONS)}")
    ap.add_argument("--hbm-tb-s", type=float, default=3.35, help="GPU memory bandwidth, TB/s (H100 SXM: 3.35)")
    ap.add_argument("--pcie-gb-s", type=float, default=50.0,
                    help="host<->GPU copy rate each way, GB/s (default 50: PCIe 5.0 x16 in practice)")
    ap.add_argument("--tflop-s", type=float, default=600.0,
                    help="achieved BF16 TFLOP/s of a large prefill (default 600: ~60%% of an H100's peak)")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, GB (default 80)")
    ap.add_argument("--utilization", type=float, default=0.9, help="gpu_memory_utilization (default 0.9)")
    ap.add_argument("--activations-gb", type=float, default=2.0, help="peak activations of one step, GB (default 2)")
    ap.add_argument("--requests", type=int, default=16, help="decodes batched into one pass (default 16)")
    ap.add_argument("--prompt", type=int, default=2000, help="prompt length for lm-head, pool, keys (default 2000)")
    ap.add_argument("--static-row", type=int, default=16384, help="chapter 24's row per request, tokens (default 16384)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args(argv)
    results = {}
    for name in args.sections or SECTIONS:
        print(f"== {name}")
        results[name] = SECTIONS[name](args)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
