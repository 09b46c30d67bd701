"""Memory: one resident copy of the weights, a memory-mapped loader, and a pool sized for the model.

- ``load_model`` leaves every parameter inside a mapping of the checkpoint file (no copy);
- ``FusedFlatModel`` holds each linear in exactly one layout; where that layout is the plain
  tensor, the model's q/k/v and gate/up parameters are views of the merged tensors (one storage);
  where it is a packed one, the model's file-backed originals hand their resident pages back and
  still give ``generate()``'s tokens; a tied head shares the embedding;
- with no pool option, a CPU engine's pool holds ``DEFAULT_KV_CACHE_TOKENS`` tokens of the model's
  own K/V (so its bytes follow the model's per-token K/V bytes), capped at a share of memory, and
  says so; a request larger than the pool is refused with a ValueError naming the options.
"""
from __future__ import annotations

import pytest
import torch

from course.bench.checkpoints import write_checkpoint
from engine.generate import generate
from engine.models import load_model
from engine.models.mapped import PAGE, mapped_file
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
from engine.fast.fused import FusedFlatModel
from engine.serve.sizing import DEFAULT_KV_CACHE_SHARE, DEFAULT_KV_CACHE_TOKENS, default_kv_cache_bytes, kv_bytes_per_block

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _checkpoint(tmp_path, dtype=torch.float32, **overrides):
    # wide enough that each projection spans whole pages (hidden 256: a 256 x 256 float32 weight is 64 pages)
    model = tiny_model(seed=3, dtype=dtype, hidden_size=256, intermediate_size=768, head_dim=64, **overrides)
    return write_checkpoint(model, tmp_path / "ckpt"), model


def _resident(path) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_loader_memory_maps_the_checkpoint(tmp_path):
    path, _ = _checkpoint(tmp_path)
    model = load_model(path)
    file = str((path / "model.safetensors").resolve())
    for name, p in model.named_parameters():
        assert mapped_file(p.detach()) == file, f"{name} is not a view of the memory-mapped checkpoint"


def test_fused_model_holds_one_copy_per_weight(tmp_path):
    """Packed layouts (float32 on a CPU with oneDNN: oneDNN's or the small kernel's, whichever was
    measured faster): one layout per linear, and the model's
    originals' pages go back to the file, while the model still computes generate()'s tokens."""
    path, _ = _checkpoint(tmp_path)
    file = (path / "model.safetensors").resolve()
    model = load_model(path)
    prompt = list(range(7, 40))
    want = generate(model, prompt, 6)  # touches every page of the file
    projection_bytes = sum(getattr(m, n).weight.numel() * 4 for layer in model.model.layers
                           for m in (layer.self_attn, layer.mlp) for n in PROJECTIONS if hasattr(m, n))
    before = _resident(file)
    fused = FusedFlatModel(model)
    assert fused.pack, "this test needs oneDNN (torch.backends.mkldnn) to pack float32 weights"
    for entry in fused.layers:
        for key in ("qkv", "o", "gate_up", "down"):
            linear = entry[key]
            held = [t for t in (linear.weight, linear.packed, linear.small) if t is not None]
            assert len(held) == 1 and linear.layout in ("packed", "small"), f"{key}: {len(held)} layouts held"
    released = before - _resident(file)
    slack = 2 * PAGE * len(PROJECTIONS) * len(model.model.layers)  # pages shared with a neighbour stay
    assert released >= projection_bytes - slack, \
        f"only {released} of the projections' {projection_bytes} resident bytes were handed back"
    assert generate(model, prompt, 6) == want, "the model changed after its pages were handed back"


def test_plain_layout_shares_storage_with_the_model(tmp_path):
    """float64 (not packable): the fused layers ARE the model's tensors; q/k/v and gate/up are
    views of the merged tensors, a second fused model reuses them, and the tied head is the
    embedding."""
    model = tiny_model(seed=3, dtype=torch.float64, tie_word_embeddings=True)
    ids_before = [id(p) for p in model.parameters()]
    fused = FusedFlatModel(model)
    for layer, entry in zip(model.model.layers, fused.layers):
        qkv, gate_up = entry["qkv"].weight, entry["gate_up"].weight
        a, mlp = layer.self_attn, layer.mlp
        assert entry["qkv"].layout == "plain" and entry["qkv"].packed is None and entry["qkv"].small is None
        for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
            assert p.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr(), "q/k/v copied"
        for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
            assert p.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr(), "gate/up copied"
        assert entry["o"].weight.data_ptr() == a.o_proj.weight.data_ptr()
        assert entry["down"].weight.data_ptr() == mlp.down_proj.weight.data_ptr()
    assert fused.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert [id(p) for p in model.parameters()] == ids_before, "the model's Parameter objects were replaced"
    again = FusedFlatModel(model)
    assert again.layers[0]["qkv"].weight.data_ptr() == fused.layers[0]["qkv"].weight.data_ptr(), \
        "a second fused model merged again instead of reusing the shared tensor"


def test_default_pool_follows_the_models_kv_bytes(capsys):
    """No pool option: DEFAULT_KV_CACHE_TOKENS tokens of each model's own K/V (two models whose
    per-token K/V differ 4x get pools 4x apart), and the engine prints the capacity."""
    pools = []
    for layers, kv_heads in ((2, 2), (4, 4)):
        model = tiny_model(seed=3, num_hidden_layers=layers, num_key_value_heads=kv_heads, num_attention_heads=4)
        core = EngineCore(model, EngineConfig(block_size=16))
        per_block = kv_bytes_per_block(layers, kv_heads, model.cfg.head_dim, 16, torch.float32)
        assert core.blocks.num_blocks * 16 == DEFAULT_KV_CACHE_TOKENS, \
            f"the default pool holds {core.blocks.num_blocks * 16} tokens, not {DEFAULT_KV_CACHE_TOKENS}"
        pools.append(core.blocks.num_blocks * per_block)
    assert pools[1] == 4 * pools[0]
    err = capsys.readouterr().err
    assert f"KV cache: {DEFAULT_KV_CACHE_TOKENS:,} tokens" in err and "kv_cache_bytes" in err
    # the cap: a share of the machine's memory, whichever is smaller
    assert default_kv_cache_bytes(1000, total_memory=10**12) == DEFAULT_KV_CACHE_TOKENS * 1000
    assert default_kv_cache_bytes(10**6, total_memory=10**9) == int(10**9 * DEFAULT_KV_CACHE_SHARE)


def test_a_request_larger_than_the_pool_names_the_option():
    core = EngineCore(tiny_model(seed=3), EngineConfig(block_size=8, num_blocks=4))
    with pytest.raises(ValueError, match=r"kv_cache_bytes= or num_blocks="):
        core.add_request("big", list(range(30)), SamplingParams(max_tokens=8))
    assert not core.has_unfinished()
