"""HF transformers' ``generate`` on our weights: the outside baseline of ``run.py bench``.

Our Qwen3 uses HF's parameter names, so the same state dict loads into transformers'
``Qwen3ForCausalLM`` unchanged. ``generate`` then serves requests the way a plain library does:
static batches, left-padded to the longest prompt, every row decoding until the batch's longest
answer is done. transformers is an optional dependency: ``to_hf`` raises ImportError with the
install command when it is missing.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

PAD_TOKEN_ID = 0  # left padding; masked out by the attention mask, so its value does not matter


def to_hf(model: nn.Module):
    """A transformers ``Qwen3ForCausalLM`` holding ``model``'s weights (same dtype and device), in eval mode."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the HF baseline needs transformers: pip install -e .[dev]") from exc
    cfg = model.cfg
    if cfg.is_moe:
        raise ValueError("the HF baseline converts dense Qwen3 models only; bench an MoE model without it")
    transformers.logging.set_verbosity_error()
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False,
        use_sliding_window=cfg.sliding_window > 0, sliding_window=cfg.sliding_window or None,
        max_window_layers=cfg.num_hidden_layers if cfg.sliding_window else 0,
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD_TOKEN_ID)
    weight = model.model.embed_tokens.weight
    with torch.device(weight.device):  # built in place: a 0.6B model is not first built on the host
        hf = transformers.Qwen3ForCausalLM(hf_cfg).to(weight.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto transformers' Qwen3: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None  # benchmark rows decode their full length (ignore_eos)
    hf.generation_config.pad_token_id = PAD_TOKEN_ID
    return hf.eval()


@torch.inference_mode()
def generate_static_batch(hf, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    """Greedy answers for one static batch: prompts left-padded to the longest, every row decoded
    ``max(max_tokens)`` steps; row i's answer is cut to its own ``max_tokens[i]``."""
    if not prompts or len(prompts) != len(max_tokens):
        raise ValueError("give one max_tokens per prompt, and at least one prompt")
    device = hf.model.embed_tokens.weight.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    steps = max(max_tokens)
    out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                      do_sample=False, pad_token_id=PAD_TOKEN_ID)
    new = out[:, width:].tolist()  # [B, steps]
    return [row[:m] for row, m in zip(new, max_tokens)]
