"""Train the course's small real model: a Qwen3 on the King James Bible, written as an HF checkpoint.

    make train-tiny                                   # installs the text if needed, then trains
    .venv/bin/python -m course.train.tiny --out DIR   # the same, when the text is installed

Every model the course can build without a download has random weights; this one writes
sentences. The text is Debian's ``bible-kjv-text`` package (read through its ``bible`` program,
package ``bible-kjv``): the King James Version of 1611, public domain (see the model card for the
one exception). The steps, all seeded:

1. read the 31,102 verses and hold out every 25th chapter (the held-out split);
2. train a byte-level BPE tokenizer (HF ``tokenizers``) on the training verses, with
   ``<|endoftext|>`` (EOS, id 0), ``<|im_start|>`` and ``<|im_end|>`` as special tokens;
3. lay the verses out as one token stream, each verse followed by EOS, with one chat-formatted
   pair (a verse as the user's message, the next verse as the answer) after every 20th verse, so
   that EOS and ``<|im_end|>`` end generations on their own;
4. train the course's own ``engine.models.Qwen3ForCausalLM`` (HF weight names) on windows that
   start at a verse, in float32 on ``--threads`` CPU threads, with AdamW and a cosine schedule;
5. write ``config.json``, ``model.safetensors`` (bfloat16, tied embedding), the tokenizer files,
   ``generation_config.json``, ``training.json`` (every figure below), ``loss.png`` and the model
   card ``README.md`` with greedy continuations produced by ``engine.generate``.

The held-out loss is the mean next-token cross-entropy (nats) over the held-out chapters, cut into
consecutive windows of the training length. Runs with the same seed, steps and thread count
compute the same numbers; the model card records what this run measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "qwen3-kjv-tiny"  # the shipped checkpoint: run.py generate's default
BIBLE = "bible"  # the reader program of Debian's bible-kjv (its text: bible-kjv-text)
VERSE_SPEC = "Gen1:1-Rev22:21"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen writes it: one block per message, then the assistant's header when asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
HELD_OUT_EVERY = 25  # chapter k is held out when k % 25 == 12
CHAT_EVERY = 20  # one chat-formatted verse pair after every 20th training verse
CARD_PROMPTS = ("In the beginning", "And the LORD said unto Moses,", "Blessed are the",
                "The LORD is my shepherd;", "And Jesus answered and said")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights (recorded in training.json)."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    seq_len: int = 128  # training window (tokens); config.json allows 512 positions
    max_position_embeddings: int = 512
    batch_size: int = 8
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    threads: int = 2


# ----- the text -----------------------------------------------------------------------------------
def read_kjv() -> list[tuple[int, str]]:
    """(chapter index, verse text) for every verse, in order, from Debian's ``bible`` program."""
    if shutil.which(BIBLE) is None:
        raise SystemExit("the King James text is not installed: run `make train-tiny` (it installs Debian's "
                         "bible-kjv and bible-kjv-text when it can), or `sudo apt-get install bible-kjv`")
    text = subprocess.run([BIBLE, "-l", "100000", VERSE_SPEC], capture_output=True, text=True, check=True).stdout
    verses: list[tuple[int, str]] = []
    chapter = -1
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):  # "Genesis 1": a new chapter
            chapter += 1
            continue
        number, _, verse = line.strip().partition(" ")
        if not number.isdigit() or not verse:
            raise ValueError(f"unexpected line in the bible output: {line[:80]!r}")
        verses.append((chapter, verse.strip()))
    return verses


def split_verses(verses: list[tuple[int, str]]) -> tuple[list[str], list[str]]:
    """(training verses, held-out verses): every ``HELD_OUT_EVERY``-th chapter is held out whole."""
    train = [v for c, v in verses if c % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    held = [v for c, v in verses if c % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    return train, held


def chat_text(user: str, answer: str) -> str:
    """A verse pair laid out exactly as ``CHAT_TEMPLATE`` renders [user, assistant]."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


# ----- the tokenizer ------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's byte alphabet, so any text encodes) with the three special tokens
    first: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok, verses: list[str], chat_every: int = 0) -> tuple[list[int], list[int]]:
    """(token ids, the offsets where a verse or chat pair starts): each verse then EOS; with
    ``chat_every``, a chat pair (this verse -> the next) after every ``chat_every``-th verse."""
    eos = tok.token_to_id(ENDOFTEXT)
    docs: list[str] = []
    for i, verse in enumerate(verses):
        docs.append(verse)
        if chat_every and i % chat_every == chat_every - 1 and i + 1 < len(verses):
            docs.append(chat_text(verse, verses[i + 1]))
    stream: list[int] = []
    starts: list[int] = []
    for doc, enc in zip(docs, tok.encode_batch(docs, add_special_tokens=False)):
        starts.append(len(stream))
        stream.extend(enc.ids)
        if not doc.endswith("\n"):  # a chat pair already ends with <|im_end|>
            stream.append(eos)
    return stream, starts


# ----- the model ----------------------------------------------------------------------------------
def model_config(tc: TrainConfig, vocab_size: int):
    from engine.models.config import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                       num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
                       num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, rms_norm_eps=1e-6,
                       rope_theta=10_000.0, max_position_embeddings=tc.max_position_embeddings,
                       tie_word_embeddings=True)


def init_weights(model, seed: int) -> None:
    """N(0, 0.02) for the embedding and projections (the two that write into the residual stream
    scaled by 1/sqrt(2 * layers)), norms at 1; drawn in name order from a private generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    depth = model.cfg.num_hidden_layers
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def batch_logits(model, ids):
    """Training forward of B sequences at once through the model's own decoder loop:
    ids [B, T] -> logits [B * T, V]. Each row attends causally within its own sequence."""
    import torch.nn.functional as F

    from engine.models.layers import add_norm
    from engine.rope import rope_cos_sin
    import torch

    b, t = ids.shape
    cfg, m = model.cfg, model.model
    pos = torch.arange(t).repeat(b)  # [B * T]: every sequence starts at position 0
    h = m.embed_tokens(ids.reshape(-1))  # [B * T, D]
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)

    def attend(i, attn, x, cos, sin):
        q, k, v = attn.qkv(x, cos, sin)  # [B * T, H, Dh]
        q, k, v = (z.view(b, t, -1, cfg.head_dim).transpose(1, 2) for z in (q, k, v))  # [B, H, T, Dh]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale, enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(b * t, -1))

    h, residual = m.run_layers(h, cos, sin, attend)
    h, _ = add_norm(h, residual, m.norm)
    return model.compute_logits(h)


def windows(stream: list[int], length: int):
    """The stream cut into consecutive [length + 1] windows (one token of overlap): [N, length + 1]."""
    import torch

    n = (len(stream) - 1) // length
    data = torch.tensor(stream[:n * length + 1])
    return torch.stack([data[i * length:(i + 1) * length + 1] for i in range(n)])


def mean_loss(model, rows, batch: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over every token of ``rows`` [N, T + 1]."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for at in range(0, rows.shape[0], batch):
            chunk = rows[at:at + batch]
            logits = batch_logits(model, chunk[:, :-1])
            total += float(F.cross_entropy(logits, chunk[:, 1:].reshape(-1), reduction="sum"))
            count += chunk[:, 1:].numel()
    return total / count


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    frac = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(tc: TrainConfig, out: Path) -> dict:
    """Run the whole recipe and write the checkpoint folder ``out``; returns training.json's dict."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from course.bench.machine import machine_line
    from engine.models.qwen3 import Qwen3ForCausalLM

    machine = machine_line()  # read before training, so the load average is other jobs', not ours
    t_start = time.perf_counter()
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    torch.set_num_threads(tc.threads)
    torch.use_deterministic_algorithms(True)

    verses = read_kjv()
    train_verses, held_verses = split_verses(verses)
    tok = train_tokenizer(train_verses, tc.vocab_size)
    stream, starts = token_stream(tok, train_verses, CHAT_EVERY)
    held_stream, _ = token_stream(tok, held_verses)
    held_rows = windows(held_stream, tc.seq_len)
    starts = [s for s in starts if s + tc.seq_len + 1 <= len(stream)]
    data = torch.tensor(stream)
    print(f"{len(verses)} verses ({len(held_verses)} held out), vocabulary {tok.get_vocab_size()}, "
          f"{len(stream)} training tokens, {held_rows.numel() - held_rows.shape[0]} held-out tokens")

    cfg = model_config(tc, tok.get_vocab_size(with_added_tokens=True))
    model = Qwen3ForCausalLM(cfg)
    init_weights(model, tc.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(tc.seed)
    offsets = torch.arange(tc.seq_len + 1)
    curve: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    t_train = time.perf_counter()
    bar = tqdm(range(tc.steps), desc="training", unit="step")
    for step in bar:
        pick = torch.randint(len(starts), (tc.batch_size,), generator=gen)
        rows = data[torch.tensor([starts[i] for i in pick.tolist()])[:, None] + offsets]  # [B, T + 1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        logits = batch_logits(model, rows[:, :-1])
        loss = F.cross_entropy(logits, rows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        curve.append((step + 1, loss.item()))
        if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
            model.eval()
            evals.append((step + 1, mean_loss(model, held_rows[:64])))
            model.train()
            bar.set_postfix(loss=f"{float(loss):.3f}", held_out=f"{evals[-1][1]:.3f}")
        else:
            bar.set_postfix(loss=f"{float(loss):.3f}")
    train_seconds = time.perf_counter() - t_train
    model.eval()
    held_f32 = mean_loss(model, held_rows)
    model.to(torch.bfloat16)  # the shipped weights
    held_bf16 = mean_loss(model, held_rows)

    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(model, tok, out)
    figures = {
        "text": "King James Version (Debian bible-kjv-text, read with `bible " + VERSE_SPEC + "`)",
        "verses": len(verses), "held_out_verses": len(held_verses),
        "training_tokens_in_stream": len(stream), "held_out_tokens": held_rows.numel() - held_rows.shape[0],
        "tokens_seen": tc.steps * tc.batch_size * tc.seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
        "held_out_loss_float32": round(held_f32, 4), "held_out_loss_bfloat16": round(held_bf16, 4),
        "final_train_loss_mean_last_20": round(sum(l for _, l in curve[-20:]) / len(curve[-20:]), 4),
        "evals": evals, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "cpu": machine, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(), "config": asdict(tc),
    }
    plot_curve(curve, evals, out / "loss.png")
    figures["generations"] = greedy_card_generations(out)
    (out / "training.json").write_text(json.dumps(figures, indent=1) + "\n")
    (out / "README.md").write_text(model_card(figures))
    print(f"held-out loss {held_f32:.4f} (float32), {held_bf16:.4f} (bfloat16 weights); "
          f"{train_seconds / 60:.1f} min training; wrote {out}")
    return figures


# ----- writing the checkpoint ---------------------------------------------------------------------
def write_checkpoint(model, tok, out: Path) -> None:
    """config.json, model.safetensors (no lm_head: it is tied), tokenizer.json,
    tokenizer_config.json and generation_config.json, all in HF's format."""
    from safetensors.torch import save_file

    cfg = model.cfg
    tensors = {n: p.detach().contiguous() for n, p in model.state_dict().items() if n != "lm_head.weight"}
    # Through a temporary file and a rename: an LLM alive on the old checkpoint keeps mapping the old
    # file's bytes (rewriting the mapped file in place kills it with SIGBUS, or changes its weights).
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"  # a name of this process's own; the umask's mode
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / "model.safetensors")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    eos, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos, "initializer_range": 0.02,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT, "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": None, "eos_token_id": [eos, im_end], "pad_token_id": eos}, indent=2) + "\n")


def plot_curve(curve: list[tuple[int, float]], evals: list[tuple[int, float]], path: Path) -> None:
    """Training loss per step (and its 20-step mean) with the held-out evaluations, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*curve)
    smooth = [sum(losses[max(0, i - 19):i + 1]) / len(losses[max(0, i - 19):i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="#9ab", lw=0.6, label="training batch")
    ax.plot(steps, smooth, color="#246", lw=1.5, label="training, 20-step mean")
    if evals:
        ax.plot(*zip(*evals), "o-", color="#c42", label="held-out (first 64 windows)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("qwen3-kjv-tiny")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def greedy_card_generations(folder: Path, max_new_tokens: int = 48) -> dict[str, str]:
    """prompt -> its greedy continuation by ``engine.generate`` on the saved checkpoint, computed
    in float64 (exact greedy choices on any CPU), EOS included; "[EOS]" or "[...]" marks the end."""
    import torch

    from engine.generate import generate
    from engine.models.loader import load_model
    from engine.tokenizer import Tokenizer

    model = load_model(folder, dtype=torch.float64)
    tok = Tokenizer.from_pretrained(folder)
    out = {}
    for prompt in CARD_PROMPTS:
        ids = generate(model, tok.encode(prompt), max_new_tokens, eos_token_id=tok.eos_token_id)
        out[prompt] = tok.decode(ids) + (" [EOS]" if ids and ids[-1] == tok.eos_token_id else " [...]")
    return out


def card_line(prompt: str, generation: str) -> str:
    """One quoted continuation as the model card lists it: the prompt in bold, then the text."""
    return f"- **{prompt}**{generation if generation.startswith(' ') else ' ' + generation}"


def model_card(f: dict) -> str:
    """The model card (README.md) from training.json's figures."""
    tc = f["config"]
    gens = "\n".join(card_line(p, g) for p, g in f["generations"].items())
    evals = ", ".join(f"step {s}: {l:.3f}" for s, l in f["evals"])
    return f"""# qwen3-kjv-tiny

A {f['parameters'] / 1e6:.2f}M-parameter Qwen3 (HF `Qwen3ForCausalLM` layout, loadable by this course's
engine, HF transformers and vLLM unchanged) trained from scratch on the King James Bible, so that the
course has a model that writes sentences without any download. It is a toy: it continues text in the
style of the KJV, ends a verse with `<|endoftext|>` on its own, and knows nothing else.

| | |
|---|---|
| architecture | {tc['num_hidden_layers']} layers, hidden {tc['hidden_size']}, SwiGLU {tc['intermediate_size']}, {tc['num_attention_heads']} query / {tc['num_key_value_heads']} KV heads of {tc['head_dim']} (GQA), RoPE base 10000, tied embedding |
| vocabulary | {tc['vocab_size']} byte-level BPE tokens (HF `tokenizers`), trained on the training verses; `<\\|endoftext\\|>` = 0 (EOS), `<\\|im_start\\|>` = 1, `<\\|im_end\\|>` = 2 |
| weights | bfloat16, `model.safetensors` |
| context | trained on {tc['seq_len']}-token windows; `max_position_embeddings` {tc['max_position_embeddings']} |
| text | {f['text']}: {f['verses']} verses, one per document, each followed by EOS; every {CHAT_EVERY}th verse is also followed by a ChatML pair (user: that verse, assistant: the next one) |
| held-out split | every {HELD_OUT_EVERY}th chapter ({f['held_out_verses']} verses, {f['held_out_tokens']} tokens), never trained on |
| training | {tc['steps']} steps x {tc['batch_size']} windows x {tc['seq_len']} tokens = {f['tokens_seen']} tokens (of {f['training_tokens_in_stream']} in the stream); AdamW (0.9, 0.95), lr {tc['lr']} with {tc['warmup_steps']} warmup steps and cosine decay to {tc['min_lr_ratio']}x, weight decay {tc['weight_decay']}, gradient clip {tc['grad_clip']}; seed {tc['seed']}; float32 |
| **held-out loss** | **{f['held_out_loss_float32']:.4f}** nats/token with the float32 weights, {f['held_out_loss_bfloat16']:.4f} with the shipped bfloat16 ones (training batches, last 20 steps: {f['final_train_loss_mean_last_20']:.3f}) |
| held-out during training | {evals} (first 64 windows) |
| wall time | {f['train_seconds'] / 60:.1f} min of training, {f['total_seconds'] / 60:.1f} min in all, torch {f['torch']}, {f['threads']} torch threads, on {f['cpu']} (when the run started; other jobs on the machine slow it down) |

![loss curve](loss.png)

## Reproducing it

```bash
make train-tiny          # = apt-get install bible-kjv bible-kjv-text when missing, then:
.venv/bin/python -m course.train.tiny --out models/qwen3-kjv-tiny
```

The run is seeded (data order, initialisation, tokenizer) and uses {f['threads']} torch threads with
deterministic algorithms; it prints the held-out loss at the end. On one machine with one thread count
two runs write the same bytes: `make train-tiny TINY_OUT=/tmp/kjv` and then
`cmp /tmp/kjv/model.safetensors models/qwen3-kjv-tiny/model.safetensors` checks it (only this card's
wall-time line and `training.json`'s timings differ). Another CPU or thread count changes the order of
the float sums, which moves the held-out loss by far less than 0.05.

## Greedy continuations

By `engine.generate` (greedy, at most 48 new tokens; the bfloat16 weights computed in float64, so
every choice is exact) on this checkpoint, quoted verbatim; `[EOS]` marks
where the model ended the verse itself, `[...]` where the 48 tokens ran out.

{gens}

Try it: `python run.py generate --prompt "And God said"` (this is the default model), or with `--chat`.

## Licence

The King James Version was translated in 1611; its text is in the public domain (Debian's package states
that its copyright has expired). In the United Kingdom the Crown still controls printing of the KJV by
letters patent; this toy model is not a printing of the text. The Debian package's own files
(`/usr/share/doc/bible-kjv-text/copyright`) may be copied, modified and distributed at will. The model,
the tokenizer and this card are part of this course and under its terms.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.train.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_MODEL), help=f"checkpoint folder to write (default {DEFAULT_MODEL})")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps (default %(default)s)")
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--threads", type=int, default=TrainConfig.threads, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--card-only", action="store_true",
                    help="do not train: recompute the greedy continuations of the checkpoint in --out and "
                         "rewrite its README.md from its training.json")
    args = ap.parse_args(argv)
    if args.card_only:
        out = Path(args.out)
        figures = json.loads((out / "training.json").read_text())
        figures["generations"] = greedy_card_generations(out)
        (out / "training.json").write_text(json.dumps(figures, indent=1) + "\n")
        (out / "README.md").write_text(model_card(figures))
        print(f"rewrote {out / 'README.md'}")
        return 0
    if args.steps < 1 or args.threads < 1:
        raise SystemExit("--steps and --threads must be >= 1")
    train(TrainConfig(seed=args.seed, steps=args.steps, threads=args.threads), Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
