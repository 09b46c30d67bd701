"""Write a tiny HF-format Qwen3 checkpoint (config, safetensors weights, tokenizer, generation
config) that both the course engine and vLLM can load; ``scripts/vllm_same_script.py`` and
``tests/test_vllm_surface.py`` run the same offline script on it.

    .venv/bin/python scripts/tiny_hf_checkpoint.py DIR

The tokenizer is a byte-level BPE trained on a few ASCII sentences with printable ASCII as its
alphabet, so every token decodes to plain text. The weights are drawn wide (norms 1 +- 0.1,
embedding and head N(0, 1)) so greedy choices are separated by whole logits: float32 on two
different engines picks the same tokens. head_dim 64 and a 512-token context fit vLLM's CPU
attention kernels.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, the engine serves many requests at once",
          "a paged cache holds keys and values in fixed blocks", "stop strings end a completion early",
          "prefill and decode are the same kind of work"] * 3


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(d: Path, vocab_size: int = 192) -> int:
    """tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    chars = _byte_chars()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=[chars[b] for b in range(32, 127)], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
        "pad_token": ENDOFTEXT, "chat_template": CHAT_TEMPLATE, "model_max_length": 512}, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def save_tiny_checkpoint(d: str | Path, seed: int = 0) -> Path:
    """The checkpoint in directory ``d`` (created); returns it."""
    import torch
    import transformers

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(d)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    redraw(model, 1000 + seed)
    model.save_pretrained(d)
    return d


def redraw(model, seed: int) -> None:
    """Norms ~ 1 +- 0.1, embedding and head ~ N(0, 1), the rest ~ N(0, 1/fan_in), in name order.

    HF's own init leaves norms at exactly 1 (a loader that skipped them would pass) and logits
    nearly uniform (greedy choices would be near-ties)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_hf_checkpoint.py DIR")
    print(save_tiny_checkpoint(sys.argv[1]))
