"""Random seeded preset models saved as HF checkpoints (config.json + model.safetensors).

``run.py bench --memory`` measures each engine the way a user runs it: a fresh process that loads
a checkpoint directory. Our parameter names are HF's, so the state dict is written as it is (a tied
head is left out, as transformers does), next to a config.json that both ``load_model`` and
vLLM read. Written once per (preset, dtype) under ``checkpoint_root()`` and reused.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def checkpoint_root() -> Path:
    """``$ENGINE_BENCH_CHECKPOINTS``, else a per-user folder in the temp directory (never the repository)."""
    root = os.environ.get("ENGINE_BENCH_CHECKPOINTS")
    return Path(root) if root else Path(tempfile.gettempdir()) / f"engine-checkpoints-{os.getuid()}"


def hf_config(model: nn.Module) -> dict:
    """The model's config.json, in transformers' Qwen3 spelling."""
    cfg = model.cfg
    if cfg.is_moe:
        raise ValueError("write_checkpoint writes dense Qwen3 models only")
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": cfg.num_hidden_layers, "torch_dtype": dtype,
        "bos_token_id": None, "eos_token_id": None,
    }


def write_checkpoint(model: nn.Module, path: Path) -> Path:
    """Save ``model`` (dense Qwen3) as an HF checkpoint directory at ``path``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()
               if not (model.cfg.tie_word_embeddings and name == "lm_head.weight")}
    tmp = path / "model.safetensors.partial"
    save_file(tensors, tmp, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(model), indent=2))
    tmp.rename(path / "model.safetensors")  # last: a directory with model.safetensors is complete
    return path


def preset_checkpoint(preset: str, dtype: torch.dtype, root: Path | None = None) -> Path:
    """The bench preset ``preset`` in ``dtype`` as a checkpoint (built and written on first use)."""
    from course.bench.compare import MODEL_PRESETS
    from engine.models import tiny_model

    path = (root or checkpoint_root()) / f"{preset}-{str(dtype).removeprefix('torch.')}"
    if not (path / "model.safetensors").is_file():
        model = tiny_model(seed=0, dtype=dtype, **MODEL_PRESETS[preset])
        write_checkpoint(model, path)
        del model
    return path
