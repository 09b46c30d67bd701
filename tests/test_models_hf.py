"""Real checkpoints and text: the loader, the tokenizer, ``LLM`` and ``run.py generate``.

The oracle is HF transformers itself. A session fixture writes tiny random Qwen3 and Qwen3-MoE
checkpoints with ``save_pretrained`` (dense and MoE, tied and untied heads, one file and
shards) plus a small byte-level BPE tokenizer; we check that our loader reproduces HF's logits,
that the engine core's greedy output equals HF ``generate`` through chunked prefill,
preemption and prefix sharing, that text round-trips, and that every malformed checkpoint is
refused with a ValueError naming its problem.

Weights are re-drawn after HF's init (norms away from 1, embeddings and head wide): HF's own init
leaves norms at exactly 1 (a loader that skipped them would pass) and logits nearly uniform
(greedy choices would be near-ties). Generation comparisons run in float64 on both sides.

Tests that run the engine core need the reference implementation: ``pytest --impl solution``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import transformers  # a dev dependency: `make setup` installs it

from engine.models.loader import load_model  # noqa: E402
from engine.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402
from pathload import load_by_path  # noqa: E402

VOCAB = 320  # the model's; the tokenizer has 300 ids (real checkpoints pad the embedding too)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, the engine serves many requests at once",
    "a paged cache holds keys and values in fixed blocks",
    "prefill and decode are the same kind of work",
] * 3
TEXT_PROMPTS = ["the quick brown fox", "hello world", "a paged cache holds keys"]
MULTIBYTE = "naïve café: 🙂 中文 ok — ünïcödé ∑ end"


# --------------------------------------------------------------------------- fixtures


def _write_tokenizer(d: Path) -> None:
    """A byte-level BPE trained on CORPUS (300 ids: 3 specials, 256 bytes, 41 merges)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
        "pad_token": ENDOFTEXT, "chat_template": CHAT_TEMPLATE, "model_max_length": 512}))


def _hf_config(moe: bool, tied: bool, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rope_theta=10_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=[2, 0], pad_token_id=0)
    common.update(extra)
    if moe:
        return transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, **common)
    return transformers.Qwen3Config(**common)


# Norms ~ 1 +- 0.1, embedding and head ~ N(0, 1), the rest ~ N(0, 1/fan_in).
_redraw = load_by_path("tiny_hf_checkpoint", "scripts/tiny_hf_checkpoint.py").redraw


CHECKPOINTS = {
    # name: (moe, tied, extra config)
    "dense": (False, False, {}),
    "dense_tied": (False, True, {}),
    # layer 0 dense, layer 1 sparse; renormalised top-k
    "moe": (True, False, dict(mlp_only_layers=[0], norm_topk_prob=True)),
    # both layers sparse; HF's default norm_topk_prob=False
    "moe_tied": (True, True, {}),
}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    """name -> checkpoint directory (config, weights, tokenizer, generation config)."""
    root = tmp_path_factory.mktemp("hf_ckpts")
    dirs = {}
    for i, (name, (moe, tied, extra)) in enumerate(CHECKPOINTS.items()):
        cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
        torch.manual_seed(i)
        model = cls(_hf_config(moe, tied, **extra)).eval()
        _redraw(model, seed=100 + i)
        d = root / name
        model.save_pretrained(d)
        _write_tokenizer(d)
        dirs[name] = d
        if name == "dense":
            model.save_pretrained(root / "dense_sharded", max_shard_size="40KB")
            dirs["dense_sharded"] = root / "dense_sharded"
    return dirs


@pytest.fixture(scope="session")
def hf_models(ckpt):
    """name -> HF model in float64 (eager attention), loaded back from the saved directory."""
    cache = {}

    def get(name: str, dtype=torch.float64):
        if (name, dtype) not in cache:
            cache[name, dtype] = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt[name], dtype=dtype, attn_implementation="eager",
                experts_implementation="eager").eval()
        return cache[name, dtype]

    return get


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                          do_sample=False, eos_token_id=[2, 0], pad_token_id=0)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- (a) logits


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_hf(ckpt, hf_models, name):
    from engine.models.loader import weight_files

    ours = load_model(ckpt[name])
    hf = hf_models(name, torch.float32)
    # a tied checkpoint as HF writes it has no lm_head.weight: the loader must tie, not load
    assert ("lm_head.weight" in weight_files(ckpt[name])) != CHECKPOINTS[name][1]
    assert ours.cfg.tie_word_embeddings == CHECKPOINTS[name][1]
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == CHECKPOINTS[name][1]
    assert next(ours.parameters()).dtype == torch.float32  # the config's dtype
    for prompt in _prompts(1, [1, 7, 40]):
        ids = torch.tensor(prompt)
        with torch.no_grad():
            want = hf(ids[None]).logits[0]
            got = ours(ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5,
                                   msg=lambda m: f"{name}, prompt length {len(prompt)}: {m}")


@pytest.mark.parametrize("moe", [False, True])
def test_sliding_window_matches_hf(tmp_path, moe):
    """A window on every layer (dense: max_window_layers=0) attends as HF's does."""
    torch.manual_seed(5)
    extra = dict(use_sliding_window=True, sliding_window=6)
    if not moe:
        extra["max_window_layers"] = 0
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    hf = cls(_hf_config(moe, False, **extra)).eval()
    _redraw(hf, seed=5)
    hf.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = load_model(tmp_path)
    assert ours.cfg.sliding_window == 6
    ids = torch.tensor(_prompts(3, [30])[0])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=1e-5)


def test_moe_config_mapping(ckpt):
    moe = load_model(ckpt["moe"]).cfg
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert moe.norm_topk_prob and moe.mlp_only_layers == [0]
    assert not load_model(ckpt["moe_tied"]).cfg.norm_topk_prob


def test_config_defaults_follow_hf(ckpt):
    """Fields a config.json may omit take HF's defaults (not our dataclass's), and both
    transformers 4 and 5 spellings are read."""
    from engine.models.hf_config import config_from_hf

    raw = json.loads((ckpt["moe_tied"] / "config.json").read_text())
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings",
                "rope_parameters", "dtype", "head_dim", "num_key_value_heads"):
        raw.pop(key, None)
    arch, cfg, dtype = config_from_hf(raw)
    assert arch == "Qwen3MoeForCausalLM" and dtype == torch.float32
    assert not cfg.norm_topk_prob and not cfg.tie_word_embeddings and cfg.mlp_only_layers == []
    assert cfg.rope_theta == 10_000.0 and cfg.head_dim == 64 // 4
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    # transformers 4 spelling, as in Qwen3-0.6B's config.json
    raw.update(rope_theta=1_000_000, rope_scaling=None, torch_dtype="bfloat16", num_local_experts=None,
               num_experts=4, use_sliding_window=False, sliding_window=None)
    _, cfg, dtype = config_from_hf(raw)
    assert cfg.rope_theta == 1e6 and dtype == torch.bfloat16 and cfg.num_experts == 4
    # a window on every layer (Qwen3-MoE applies it to all) is supported
    raw.update(use_sliding_window=True, sliding_window=8)
    assert config_from_hf(raw)[1].sliding_window == 8


def test_dtype_and_device_arguments(ckpt):
    m = load_model(ckpt["dense"], dtype="bfloat16", device="cpu")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in m.parameters())
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(ckpt["dense"], dtype="float8")


# --------------------------------------------------------------------------- (d) shards, fused experts


def test_sharded_checkpoint_loads(ckpt):
    d = ckpt["dense_sharded"]
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 2, "max_shard_size should have produced shards"
    one, many = load_model(ckpt["dense"]), load_model(d)
    for (n1, p1), (n2, p2) in zip(one.named_parameters(), many.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_fused_expert_tensors_load(ckpt, hf_models, tmp_path):
    """transformers 5 keeps experts fused in memory; a file written from that layout loads too."""
    src = ckpt["moe"]
    tensors = {}
    with safe_open(src / "model.safetensors", framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    hf_state = hf_models("moe", torch.float32).state_dict()
    fused = {}
    for layer in (1,):  # the sparse layer
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"),
                                          tensors.pop(f"{p}.{e}.up_proj.weight")]) for e in range(4)])
        down = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
        fused[f"{p}.gate_up_proj"], fused[f"{p}.down_proj"] = gate_up, down
        if f"{p}.gate_up_proj" in hf_state:  # our layout is HF's in-memory one
            assert torch.equal(hf_state[f"{p}.gate_up_proj"], gate_up)
            assert torch.equal(hf_state[f"{p}.down_proj"], down)
    d = tmp_path / "fused"
    shutil.copytree(src, d)
    save_file({**tensors, **fused}, d / "model.safetensors", metadata={"format": "pt"})
    a, b = load_model(src), load_model(d)
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


# --------------------------------------------------------------------------- (e) malformed


def _edit_config(**changes):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _edit_tensors(drop=(), add=None):
    def edit(d: Path) -> None:
        with safe_open(d / "model.safetensors", framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        t.update(add or {})
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return edit


MALFORMED = {
    "no_config": (lambda d: (d / "config.json").unlink(), r"no config\.json"),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), r"no weights file"),
    "architecture": (_edit_config(architectures=["LlamaForCausalLM"]),
                     r"unsupported architecture \['LlamaForCausalLM'\]"),
    "rope_scaling": (_edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
                     r"rope_scaling with rope_type='yarn' is not supported"),
    "attention_bias": (_edit_config(attention_bias=True), r"attention_bias=true is not supported"),
    "hidden_act": (_edit_config(hidden_act="gelu"), r"hidden_act='gelu'"),
    "quantized": (_edit_config(quantization_config={"quant_method": "awq"}), r"quantized checkpoint.*awq"),
    "mixed_window": (_edit_config(use_sliding_window=True, sliding_window=8,
                                  layer_types=["full_attention", "sliding_attention"]),
                     r"mix of windowed and full-attention layers"),
    "missing_field": (_edit_config(hidden_size=None), r"required field 'hidden_size' is missing"),
    "missing_tensor": (_edit_tensors(drop=["model.norm.weight"]), r"missing tensors: model\.norm\.weight"),
    "missing_head": (_edit_tensors(drop=["lm_head.weight"]), r"missing tensors \(an untied LM head.*lm_head\.weight"),
    "unexpected_tensor": (_edit_tensors(add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
                          r"unexpected tensors.*model\.layers\.0\.self_attn\.q_proj\.bias"),
    "shape": (_edit_config(intermediate_size=96),
              r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \[64, 128\] but config\.json implies \[64, 96\]"),
    # config values: types and ranges, each named with its key and file
    "config_not_object": (lambda d: (d / "config.json").write_text("[1, 2]"),
                          r"config\.json: must hold a JSON object, got list"),
    "config_binary": (lambda d: (d / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00"),
                      r"config\.json: not valid UTF-8 JSON"),
    "config_truncated": (lambda d: (d / "config.json").write_text('{"hidden_size": 6'), r"config\.json: not valid UTF-8 JSON"),
    "tie_as_string": (_edit_config(tie_word_embeddings="false"), r"config\.json: tie_word_embeddings must be true or false"),
    "bias_as_string": (_edit_config(attention_bias="false"), r"config\.json: attention_bias must be true or false"),
    "zero_heads": (_edit_config(num_attention_heads=0), r"config\.json: num_attention_heads must be in \[1, "),
    "zero_heads_no_head_dim": (_edit_config(num_attention_heads=0, head_dim=None), r"num_attention_heads must be in"),
    "negative_size": (_edit_config(hidden_size=-64), r"config\.json: hidden_size must be in \[1, "),
    "fractional_size": (_edit_config(hidden_size=64.5), r"config\.json: hidden_size must be an integer"),
    "size_as_string": (_edit_config(intermediate_size="128"), r"config\.json: intermediate_size must be an integer"),
    "size_as_bool": (_edit_config(vocab_size=True), r"config\.json: vocab_size must be an integer"),
    "nan_eps": (_edit_config(rms_norm_eps=float("nan")), r"config\.json: rms_norm_eps must be a finite number > 0"),
    "infinite_theta": (_edit_config(rope_theta=float("inf"), rope_parameters=None),
                       r"config\.json: rope_theta must be a finite number > 0"),
    "negative_window": (_edit_config(use_sliding_window=True, sliding_window=-8), r"sliding_window must be in \[1, "),
    "quantization_not_object": (_edit_config(quantization_config="awq"), r"quantization_config must be an object"),
    "architectures_not_list": (_edit_config(architectures="Qwen3ForCausalLM"), r"architectures must be a list"),
    "dtype_not_string": (_edit_config(torch_dtype=32, dtype=None), r"unknown dtype 32"),
    "absurd_layers": (_edit_config(num_hidden_layers=10**9), r"num_hidden_layers must be in \[1, 1024\], got 1000000000"),
    "absurd_experts": (_edit_config(architectures=["Qwen3MoeForCausalLM"], num_experts=10**7, num_experts_per_tok=2,
                                    moe_intermediate_size=32), r"num_experts must be in \[1, 4096\]"),
    "too_many_expert_blocks": (_edit_config(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=1000,
                                            num_experts=4000, num_experts_per_tok=2, moe_intermediate_size=32),
                               r"1000 layers x 4000 experts is more than this engine builds"),
    "mlp_only_layers_bad": (_edit_config(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, mlp_only_layers=[7]),
                            r"mlp_only_layers must be a list of layer indices in \[0, 2\)"),
    # weight files
    "int_tensor": (_edit_tensors(drop=["model.norm.weight"], add={"model.norm.weight": torch.ones(64, dtype=torch.int64)}),
                   r"tensor 'model\.norm\.weight' has dtype I64; this engine loads floating-point weights only"),
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors"),
                          r"model\.safetensors: not a readable safetensors file"),
    "not_safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"PK\x03\x04 a zip, not a safetensors file"),
                        r"model\.safetensors: not a readable safetensors file"),
    "empty_weights": (lambda d: (d / "model.safetensors").write_bytes(b""), r"model\.safetensors: not a readable safetensors file"),
}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_named(ckpt, tmp_path, case):
    edit, pattern = MALFORMED[case]
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt["dense"], d)
    edit(d)
    with pytest.raises(ValueError, match=pattern):
        load_model(d)


def test_missing_directory_and_shard(ckpt, tmp_path):
    with pytest.raises(ValueError, match="does not exist.*never downloads"):
        load_model(tmp_path / "nowhere")
    d = tmp_path / "sharded"
    shutil.copytree(ckpt["dense_sharded"], d)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"lists shard '{shard.name}', which is missing"):
        load_model(d)


@pytest.mark.parametrize("kind", ["fifo", "directory", "indexed-fifo"])
def test_weights_glob_refuses_what_is_not_a_regular_file(ckpt, tmp_path, kind):
    """Shards found by ``*.safetensors`` (no index) must be regular files: a named pipe among them
    would block load_model forever (opening it waits for a writer, holding the GIL), a directory
    would not read. Loaded in a child process, so a loader that blocks fails the test, not the run."""
    import os
    import subprocess
    import sys

    d = tmp_path / "ckpt"
    shutil.copytree(ckpt["dense_sharded"], d)
    if kind == "indexed-fifo":  # a shard the index lists is a pipe
        odd = sorted(d.glob("model-*.safetensors"))[0]
        odd.unlink()
        os.mkfifo(odd)
    else:
        (d / "model.safetensors.index.json").unlink()
        odd = d / "zz-extra.safetensors"
        os.mkfifo(odd) if kind == "fifo" else odd.mkdir()
    script = ("import sys\nfrom engine.models.loader import load_model\n"
              "try:\n    load_model(sys.argv[1])\nexcept ValueError as e:\n    print(e)\n")
    try:
        done = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_model blocked on {kind} {odd.name}")
    assert "is not a regular file" in done.stdout and odd.name in done.stdout, done.stdout + done.stderr[-2000:]


def _edit_index(change):
    def edit(d: Path) -> None:
        index = d / "model.safetensors.index.json"
        raw = json.loads(index.read_text())
        index.write_text(json.dumps(change(raw, d)))
    return edit


def _first_shard_to(target):
    """Point the index's first shard at ``target`` (a name, or a function of the directory)."""
    def change(raw, d: Path):
        first = sorted(set(raw["weight_map"].values()))[0]
        name = target(d) if callable(target) else target
        raw["weight_map"] = {k: (name if v == first else v) for k, v in raw["weight_map"].items()}
        return raw
    return change


SHARD_INDEX_CASES = {
    "parent_dir": (_edit_index(_first_shard_to("../elsewhere/model-00001.safetensors")), r"must be a plain file name"),
    "absolute": (_edit_index(_first_shard_to(lambda d: str(d.parent / "elsewhere" / "model-00001.safetensors"))),
                 r"must be a plain file name"),
    "dotdot_inside": (_edit_index(_first_shard_to("sub/../../x.safetensors")), r"must be a plain file name"),
    "backslash": (_edit_index(_first_shard_to("..\\x.safetensors")), r"must be a plain file name"),
    "map_not_object": (_edit_index(lambda raw, d: {"weight_map": ["a", "b"]}), r"not a valid safetensors index"),
    "name_not_string": (_edit_index(lambda raw, d: {"weight_map": {"model.norm.weight": 3}}),
                        r"not a valid safetensors index"),
    "index_not_object": (lambda d: (d / "model.safetensors.index.json").write_text("[]"), r"must hold a JSON object"),
    "index_binary": (lambda d: (d / "model.safetensors.index.json").write_bytes(b"\xff\xfe\x00{"),
                     r"model\.safetensors\.index\.json: not valid UTF-8 JSON"),
}


@pytest.mark.parametrize("case", list(SHARD_INDEX_CASES))
def test_shard_index_stays_inside_the_checkpoint(ckpt, tmp_path, case):
    """An index is untrusted: a shard name that leaves the directory is refused (the shard it
    points at exists, so today's loader would read it)."""
    edit, pattern = SHARD_INDEX_CASES[case]
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt["dense_sharded"], d)
    first = sorted(d.glob("model-*.safetensors"))[0]
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(first, tmp_path / "elsewhere" / "model-00001.safetensors")
    edit(d)
    with pytest.raises(ValueError, match=pattern):
        load_model(d)


def test_hf_cache_symlinks_into_blobs_still_load(ckpt, tmp_path):
    """The HF cache layout: snapshots/<rev>/ holds symlinks to ../../blobs/<digest>."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt["dense_sharded"].iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    a, b = load_model(snap), load_model(ckpt["dense_sharded"])
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_pickle_files_are_never_unpickled(ckpt, tmp_path):
    """A directory with only pytorch_model.bin is refused without loading it: unpickling runs code."""
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(ckpt["dense"] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"pickle files are never loaded"):
        load_model(d)
    assert not marker.exists(), "the pickle was unpickled"


TOKENIZER_FILE_CASES = {
    "tokenizer_json_garbage": ("tokenizer.json", b"{\"model\": 42}", r"tokenizer\.json: not a readable tokenizer\.json"),
    "tokenizer_json_binary": ("tokenizer.json", b"\x00\xff\x13", r"tokenizer\.json: not a readable tokenizer\.json"),
    "config_binary": ("tokenizer_config.json", b"\xff\xfe{", r"tokenizer_config\.json: not valid UTF-8 JSON"),
    "config_list": ("tokenizer_config.json", b"[]", r"tokenizer_config\.json: must hold a JSON object"),
    "eos_not_text": ("tokenizer_config.json", b'{"eos_token": 5}', r"tokenizer_config\.json: eos_token must be a string"),
    "template_not_text": ("tokenizer_config.json", b'{"chat_template": 5}', r"chat_template must be a string"),
    "template_list_of_text": ("tokenizer_config.json", b'{"chat_template": ["a"]}', r"chat_template must be a string or a list"),
    "generation_config_list": ("generation_config.json", b"[2]", r"generation_config\.json: must hold a JSON object"),
    "generation_eos_text": ("generation_config.json", b'{"eos_token_id": "2"}',
                            r"generation_config\.json: eos_token_id must be a token id"),
    "generation_eos_nested": ("generation_config.json", b'{"eos_token_id": [[2]]}', r"eos_token_id must be a token id"),
    "generation_truncated": ("generation_config.json", b'{"eos_token_id": [2,', r"generation_config\.json: not valid"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_FILE_CASES))
def test_malformed_tokenizer_files_are_named(ckpt, tmp_path, case):
    name, content, pattern = TOKENIZER_FILE_CASES[case]
    d = tmp_path / "tok"
    shutil.copytree(ckpt["dense"], d)
    (d / name).write_bytes(content)
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_pretrained(d)


def test_tokenizer_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(ckpt["dense"] / "tokenizer.json", d)
    tok = Tokenizer.from_pretrained(d)  # no tokenizer_config.json: no template, no EOS
    assert tok.eos_token_id is None and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_hf(ckpt):
    ours = Tokenizer.from_pretrained(ckpt["dense"])
    hf = transformers.AutoTokenizer.from_pretrained(ckpt["dense"])
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.eos_token_ids == [2, 0]  # generation_config.json adds <|endoftext|>
    for text in TEXT_PROMPTS + [MULTIBYTE]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == text
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    for gen_prompt in (True, False):
        want = hf.apply_chat_template(convo, add_generation_prompt=gen_prompt, tokenize=False)
        assert ours.apply_chat_template(convo, add_generation_prompt=gen_prompt) == want
    ids = ours.apply_chat_template(convo, tokenize=True)
    assert ids[0] == ours.token_to_id(IM_START) and ours.decode(ids, skip_special_tokens=False).endswith("assistant\n")


# --------------------------------------------------------------------------- (f) incremental detokenizer


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], prompt=None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        pieces.append(detok.add(ids[i:i + n]))
        i, k = i + n, k + 1
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


def test_incremental_detokenizer_multibyte(ckpt):
    tok = Tokenizer.from_pretrained(ckpt["dense"])
    ids = tok.encode(MULTIBYTE)
    pieces = _stream(tok, ids, [1])
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces), pieces
    assert pieces.count("") >= 3, "the 4-byte emoji alone should hold back 3 tokens"
    # the emoji comes out whole, in one piece
    assert any("🙂" in p for p in pieces)
    # with the prompt as left context, the pieces are the continuation's text exactly
    prompt, out = tok.encode("hello"), tok.encode(" world 🙂 café")
    assert "".join(_stream(tok, out, [1], prompt)) == tok.decode(prompt + out)[len("hello"):]


@pytest.fixture(scope="session")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_pretrained(ckpt["dense"])


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), chunks=st.lists(st.integers(1, 4), max_size=5))
def test_incremental_detokenizer_property(tok, text, chunks):
    """Any text, fed in any chunking: the pieces join to the text and none is a broken character."""
    ids = tok.encode(text)
    pieces = _stream(tok, ids, chunks)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_incremental_detokenizer_is_linear_over_tokens_without_text(tok, monkeypatch):
    """Tokens that add no text — special tokens that decoding skips, lone UTF-8 lead bytes — must
    not grow the window decoded on every step: 8,000 of them cost a bounded number of decoded ids
    each (counted, not timed), and the text still equals decode() of everything."""
    lead = tok.token_to_id("\u00e2")  # byte 0xE2 in the byte-level alphabet: a 3-byte character's lead byte
    assert lead is not None and tok.decode([lead]) == "\ufffd"
    special = tok.token_to_id(IM_START)
    assert special is not None and tok.decode([special]) == ""  # skipped when decoding
    hello, world = tok.encode("hello"), tok.encode(" world 🙂")
    decoded = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw))
    for filler in (special, lead):
        ids = hello + [filler] * 8000 + world
        decoded.clear()
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add([t]) for t in ids] + [detok.flush()]
        assert "".join(pieces) == detok.text == real(ids), f"filler {filler}: wrong text"
        assert sum(decoded) < 40 * len(ids), f"filler {filler}: {sum(decoded):,} ids decoded for {len(ids):,} tokens"


# --------------------------------------------------------------------------- (b) engine core vs HF generate


def _core_configs():
    from engine.serve import EngineConfig

    return {
        "chunked": EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                enable_chunked_prefill=True, long_prefill_token_threshold=5),
        "preempt": EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=64),
        "prefix": EngineConfig(block_size=4, num_blocks=64, enable_prefix_caching=True),
        # all three at once (the MoE model runs only this one: its HF oracle is slow)
        "all": EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=8,
                            long_prefill_token_threshold=5, enable_prefix_caching=True),
    }


@pytest.mark.parametrize("name, setup", [("dense", "chunked"), ("dense", "preempt"),
                                         ("dense", "prefix"), ("moe_tied", "all")])
def test_engine_core_matches_hf_generate(ckpt, hf_models, name, setup):
    from engine.serve import EngineCore, SamplingParams

    model = load_model(ckpt[name], dtype=torch.float64)
    hf = hf_models(name)
    prompts = _prompts(7, [5, 11, 19, 9, 14])
    prompts[3] = prompts[2][:8] + prompts[3]  # shares its first two 4-token blocks with prompt 2
    config = _core_configs()[setup]
    core = EngineCore(model, config, eos_token_id=2)
    params = SamplingParams(max_tokens=12, stop_token_ids=[0], temperature=0.0)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    done, cached = {}, 0
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                done[out.request_id] = (out.output_token_ids, out.finish_reason)
                cached += out.num_cached_tokens
    for i, p in enumerate(prompts):
        want = _hf_greedy(hf, p, 12)
        got, reason = done[f"r{i}"]
        assert got == want, f"{name}/{setup}: request r{i} (prompt length {len(p)}) differs from HF generate"
        assert reason == ("stop" if want[-1] in (0, 2) else "length")
    assert core.blocks.num_free == config.cache.num_blocks, "blocks leaked at idle"
    if setup in ("preempt", "all"):
        assert core.preemptions > 0, "the 12-block pool should have forced a preemption"
    if setup == "prefix":
        assert cached >= 8, "prompt 3 should have found prompt 2's first two blocks cached"


# --------------------------------------------------------------------------- (c) LLM and the CLI


def test_llm_generate_strings_round_trip(ckpt):
    from engine.generate import generate
    from engine.llm import LLM
    from engine.serve import SamplingParams

    llm = LLM(ckpt["dense"], dtype="float64", block_size=4, num_blocks=64)
    tok = llm.get_tokenizer()
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(max_tokens=10, temperature=0.0))
    assert [o.prompt for o in outs] == TEXT_PROMPTS
    for text, out in zip(TEXT_PROMPTS, outs):
        assert out.prompt_token_ids == tok.encode(text)
        assert tok.decode(out.prompt_token_ids) == text
        want = generate(llm.model, out.prompt_token_ids, 10, eos_token_id=None)
        stop = next((i for i, t in enumerate(want) if t in (0, 2)), None)
        want = want if stop is None else want[:stop + 1]
        assert out.token_ids == want
        assert out.text == tok.decode(out.token_ids)
        assert out.finish_reason == ("length" if stop is None else "stop")
    # one prompt as a string, token ids, per-prompt params, n > 1
    [single] = llm.generate(TEXT_PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0))
    assert single.token_ids == outs[0].token_ids
    [by_ids] = llm.generate(outs[1].prompt_token_ids, SamplingParams(max_tokens=10, temperature=0.0))
    assert by_ids.token_ids == outs[1].token_ids and by_ids.prompt is None
    mixed = llm.generate(TEXT_PROMPTS[:2], [SamplingParams(max_tokens=3, temperature=0.0), SamplingParams(max_tokens=5, temperature=0.0)])
    assert len(mixed[0].token_ids) <= 3 and len(mixed[1].token_ids) <= 5
    [two] = llm.generate("hello", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4))
    assert len(two.outputs) == 2 and [c.index for c in two.outputs] == [0, 1]
    with pytest.raises(ValueError, match="one SamplingParams or a list of 3"):
        llm.generate(TEXT_PROMPTS, [SamplingParams(temperature=0.0)])
    assert not llm.engine.has_unfinished()


def test_llm_extra_eos_from_generation_config(ckpt):
    """<|endoftext|> (generation_config.json) stops generation as <|im_end|> does, unless ignore_eos."""
    from engine.generate import generate
    from engine.llm import LLM
    from engine.serve import SamplingParams

    llm = LLM(ckpt["dense"], dtype="float64", block_size=4, num_blocks=64)
    prompt = TEXT_PROMPTS[1]
    first = generate(llm.model, llm.get_tokenizer().encode(prompt), 1)[0]
    base = llm.get_tokenizer()
    tok = Tokenizer(base.backend, eos_token=IM_END, extra_eos_token_ids=[first])
    llm2 = LLM(llm.model, tok, block_size=4, num_blocks=64)
    [out] = llm2.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert out.token_ids == [first] and out.finish_reason == "stop"
    [out] = llm2.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_llm_chat_and_model_object(ckpt, capsys):
    from engine.llm import LLM
    from engine.serve import SamplingParams

    model = load_model(ckpt["moe"], dtype=torch.float64)
    tok = Tokenizer.from_pretrained(ckpt["moe"])
    llm = LLM(model, tok, block_size=4, num_blocks=64)
    convo = [{"role": "user", "content": "hello world"}]
    [out] = llm.chat(convo, SamplingParams(max_tokens=5, temperature=0.0))
    assert out.prompt == tok.apply_chat_template(convo)
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    [again] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(max_tokens=5, temperature=0.0))
    assert again.token_ids == out.token_ids
    capsys.readouterr()
    assert len(llm.chat([convo, convo], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)) == 2
    assert capsys.readouterr().err == "", "no progress bar with use_tqdm=False"
    llm.chat([convo, convo], SamplingParams(max_tokens=2, temperature=0.0))  # vLLM's default: use_tqdm=True
    assert "2/2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pass tokenizer="):
        LLM(model, block_size=4, num_blocks=16).generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(model, tok, num_blockz=4)
    bare = torch.nn.Module()
    bare.cfg = model.cfg  # looks like one of ours, holds no weights
    with pytest.raises(ValueError, match="without weights"):
        LLM(bare, tok)


def test_llm_without_tokenizer_files(ckpt, tmp_path):
    from engine.llm import LLM
    from engine.serve import SamplingParams

    d = tmp_path / "no_tok"
    shutil.copytree(ckpt["dense"], d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json.*skip_tokenizer_init=True"):
        LLM(d, block_size=4, num_blocks=16)
    llm = LLM(d, skip_tokenizer_init=True, block_size=4, num_blocks=16)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3 and out.text == ""


def test_llm_stream_pieces_join_to_text(ckpt):
    from engine.llm import LLM
    from engine.serve import SamplingParams

    llm = LLM(ckpt["dense_tied"], dtype="float64", block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    deltas = list(llm.stream("the lazy dog", params))
    [full] = llm.generate("the lazy dog", params)
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == "length" and not llm.engine.has_unfinished()


def test_cli_generate(ckpt, capsys):
    from course.learner.cli_generate import generate_main
    from engine.llm import LLM
    from engine.serve import SamplingParams

    args = ["--model", str(ckpt["dense"]), "--prompt", "hello world", "--max-tokens", "8",
            "--dtype", "float64", "--device", "cpu", "--block-size", "4"]
    assert generate_main(args) == 0
    printed = capsys.readouterr()
    [want] = LLM(ckpt["dense"], dtype="float64", block_size=4, num_blocks=64).generate(
        "hello world", SamplingParams(max_tokens=8, temperature=0.0))
    assert printed.out == "hello world" + want.text + "\n"
    assert "tokens in" in printed.err
    assert generate_main(args[:2] + ["--prompt", "hi", "--chat", "--max-tokens", "3"]) == 0
    assert generate_main(["--model", str(ckpt["dense"]) + "-nope", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_generate_says_when_16bit_matmuls_ran_in_float32(ckpt, capsys):
    """The README's one exception to "equals generate()": a bfloat16 model on the fused path of a
    CPU without bf16 matmul units; `run.py generate` then prints a ``numerics:`` line, and only then."""
    import torch
    from course.learner.cli_generate import generate_main
    from engine.fast.fused import fast_16bit_matmul

    args = ["--model", str(ckpt["dense"]), "--prompt", "hello world", "--max-tokens", "4", "--device", "cpu"]
    assert generate_main(args + ["--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    widened = not fast_16bit_matmul(torch.bfloat16, torch.device("cpu"))
    assert ("[numerics: bfloat16 model, matmuls in float32" in err) == widened, err
    assert generate_main(args + ["--dtype", "float32"]) == 0
    assert "numerics:" not in capsys.readouterr().err


CLI_ERRORS = {
    # case: (extra arguments, what the one line must say)
    "block_size_zero": (["--block-size", "0"], "--block-size must be in [1, 1024], got 0"),
    "block_size_huge": (["--block-size", str(10**9)], "--block-size must be in [1, 1024]"),
    "max_tokens_past_the_model": (["--max-tokens", str(10**9)], "exceeds the model's 512 positions; lower --max-tokens"),
    "device_unknown": (["--device", "tpu"], "--device 'tpu' is not usable here"),
    "device_empty": (["--device", ""], "--device '' is not usable here"),
    "device_meta": (["--device", "meta"], "--device 'meta' is not usable here"),
    "device_other_cpu": (["--device", "cpu:3"], "--device 'cpu:3' is not usable here"),
    "temperature_nan": (["--temperature", "nan"], "temperature must be >= 0"),
    "prompt_empty": (["--prompt", ""], "--prompt is empty"),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_user_errors_are_one_line(ckpt, capsys, monkeypatch, case):
    """A user error ends `run.py generate` with exit status 2 and one line saying what to change,
    before any model memory is sized (load_model is never reached)."""
    import engine.models.loader
    from course.learner.cli_generate import generate_main

    def no_load(*args, **kwargs):
        raise AssertionError("load_model was called before the arguments were checked")

    monkeypatch.setattr(engine.models.loader, "load_model", no_load)
    extra, message = CLI_ERRORS[case]
    args = ["--model", str(ckpt["dense"]), "--prompt", "hello", "--dtype", "float64", "--device", "cpu", *extra]
    assert generate_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("bad", ["config_binary", "tokenizer_binary"])
def test_cli_bad_checkpoint_files_are_one_line(ckpt, tmp_path, capsys, bad):
    from course.learner.cli_generate import generate_main

    d = tmp_path / "ckpt"
    shutil.copytree(ckpt["dense"], d)
    (d / ("config.json" if bad == "config_binary" else "tokenizer.json")).write_bytes(b"\xff\xfe\x00\x01")
    assert generate_main(["--model", str(d), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "not " in err, err


def test_run_py_bad_impl_exits_2(capsys):
    import run

    with pytest.raises(SystemExit) as exit_:
        run.main(["generate", "--impl", "bogus"])
    assert exit_.value.code == 2
    assert "run.py generate: error: argument --impl: invalid choice: 'bogus'" in capsys.readouterr().err
