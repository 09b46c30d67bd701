"""Reading an HF ``config.json`` into our :class:`Qwen3Config` (used by ``engine.models.loader``).

Both spellings transformers has used are read: version 4's ``rope_theta`` / ``rope_scaling`` /
``torch_dtype`` / ``num_experts`` and version 5's ``rope_parameters`` / ``dtype`` /
``num_local_experts``. A field we do not implement (scaled RoPE, attention biases, quantization,
a mix of windowed and full layers) is refused with a ``ValueError`` instead of loading a model
that would silently compute something else.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from engine.models.config import Qwen3Config

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Used only when config.json has no "architectures" list.
_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64,
}


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype, a name ("bfloat16", "float32", ...) or None/"auto" (= default)."""
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(set(_DTYPES))} or a torch.dtype")


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> tuple[str, Qwen3Config, torch.dtype]:
    """Map an HF ``config.json`` dict to (architecture name, Qwen3Config, the checkpoint's dtype).

    Reads both the transformers 4 spelling (``rope_theta``, ``rope_scaling``, ``torch_dtype``,
    ``num_experts``) and the transformers 5 one (``rope_parameters``, ``dtype``,
    ``num_local_experts``). Options our model does not implement raise ``ValueError`` rather than
    load a model that silently computes something else.
    """
    arch = _pick_architecture(raw, source)
    moe = arch == "Qwen3MoeForCausalLM"

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ValueError(f"{source}: required field {key!r} is missing; is this a Qwen3 checkpoint?")
        return raw[key]

    def unsupported(what: str, fix: str) -> ValueError:
        return ValueError(f"{source}: {what} is not supported by this engine ({fix})")

    if raw.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act={raw['hidden_act']!r}", "Qwen3 uses 'silu'")
    if raw.get("attention_bias", False):
        raise unsupported("attention_bias=true", "our q/k/v/o projections have no bias")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise unsupported(f"a quantized checkpoint (quant_method={method!r})",
                          "use the unquantized BF16/FP16/FP32 weights")

    rope_theta = _rope_theta(raw, source)
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = raw.get("num_key_value_heads")
    layers = int(need("num_hidden_layers"))
    fields: dict[str, Any] = dict(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(raw, layers, moe, source),
    )
    if moe:
        experts = raw.get("num_experts") or raw.get("num_local_experts")
        if experts is None:
            raise ValueError(f"{source}: a Qwen3MoeForCausalLM config needs 'num_experts' "
                             "(or 'num_local_experts')")
        fields.update(
            num_experts=int(experts),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            # HF's Qwen3-MoE default is False; the released models set it to true explicitly.
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in (raw.get("mlp_only_layers") or [])],
        )
    try:
        cfg = Qwen3Config(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    dtype_name = raw.get("torch_dtype") or raw.get("dtype")
    try:
        dtype = resolve_dtype(dtype_name)
    except ValueError:
        raise ValueError(f"{source}: unknown dtype {dtype_name!r}; pass dtype= to load_model") from None
    return arch, cfg, dtype


def _pick_architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[raw["model_type"]]]
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise ValueError(
        f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; this engine "
        f"loads {list(SUPPORTED_ARCHITECTURES)}")


def _rope_theta(raw: dict[str, Any], source: str) -> float:
    """The RoPE base; any RoPE variant other than the plain one is refused."""
    theta = raw.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if not params:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{source}: {key} must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"{source}: {key} with rope_type={kind!r} is not supported by this engine (only "
                "plain RoPE); remove it to run without long-context scaling, or use a checkpoint "
                "without it")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported by this engine")
        theta = params.get("rope_theta", theta)
    return float(theta) if theta is not None else 10_000.0


def _sliding_window(raw: dict[str, Any], layers: int, moe: bool, source: str) -> int:
    """0 for full attention, else the window; refuses a mix of windowed and full layers.

    HF applies the window only when ``use_sliding_window`` is true. Qwen3-MoE then windows every
    layer; dense Qwen3 windows the layers marked "sliding_attention" in ``layer_types`` (by
    default those with index >= ``max_window_layers``). Our model has one window for all layers.
    """
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or not window:
        return 0
    if moe:
        return int(window)
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)]
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True}:
        return int(window)
    if sliding == {False}:
        return 0
    raise ValueError(
        f"{source}: use_sliding_window=true with a mix of windowed and full-attention layers is "
        "not supported by this engine (one window for all layers); set use_sliding_window=false")


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path to an existing directory (``~`` expanded), else ``ValueError``."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {str(root)!r} does not exist (download the model "
                         "first; this engine never downloads anything)")
    return root


def read_config(path: str | os.PathLike) -> tuple[str, Qwen3Config, torch.dtype]:
    """Read ``<path>/config.json``: (architecture, Qwen3Config, checkpoint dtype)."""
    root = checkpoint_dir(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{root}: no config.json; a checkpoint directory needs config.json next "
                         "to its *.safetensors files")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    return config_from_hf(raw, str(cfg_file))
