"""Reading an HF ``config.json`` into our :class:`Qwen3Config` (used by ``engine.models.loader``).

Both spellings transformers has used are read: version 4's ``rope_theta`` / ``rope_scaling`` /
``torch_dtype`` / ``num_experts`` and version 5's ``rope_parameters`` / ``dtype`` /
``num_local_experts``. A field we do not implement (scaled RoPE, attention biases, quantization,
a mix of windowed and full layers) is refused with a ``ValueError`` instead of loading a model
that would silently compute something else.
"""
from __future__ import annotations

import json
import math
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


# Upper bounds that no real checkpoint comes near: a config beyond them is corrupt or hostile, and
# building its modules (even shapes only, on the meta device) would take minutes or memory first.
LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "head_dim": 4096, "max_position_embeddings": 1 << 24, "num_experts": 4096,
    "num_experts_per_tok": 4096, "moe_intermediate_size": 1 << 20, "decoder_sparse_step": 1024,
    "sliding_window": 1 << 24, "max_window_layers": 1 << 20,
}
MAX_EXPERT_MODULES = 1 << 16  # layers x experts: each expert is three Linear modules


def _int_field(raw: dict[str, Any], key: str, source: str, default: Any = None, minimum: int = 1) -> int:
    """``raw[key]`` (or ``default`` when absent or null) as an int in [minimum, LIMITS[key]]."""
    value = raw.get(key)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"{source}: required field {key!r} is missing; is this a Qwen3 checkpoint?")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some writers save 4096 as 4096.0
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    top = LIMITS.get(key, 1 << 62)
    if not minimum <= value <= top:
        raise ValueError(f"{source}: {key} must be in [{minimum}, {top}], got {value}")
    return value


def _float_field(raw: dict[str, Any], key: str, source: str, default: float) -> float:
    """``raw[key]`` (``default`` when absent or null) as a finite float > 0."""
    value = raw.get(key)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    return float(value)


def _bool_field(raw: dict[str, Any], key: str, source: str, default: bool) -> bool:
    """``raw[key]`` as a JSON boolean (a string "false" is not one)."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> tuple[str, Qwen3Config, torch.dtype]:
    """Map an HF ``config.json`` dict to (architecture name, Qwen3Config, the checkpoint's dtype).

    Reads both the transformers 4 spelling (``rope_theta``, ``rope_scaling``, ``torch_dtype``,
    ``num_experts``) and the transformers 5 one (``rope_parameters``, ``dtype``,
    ``num_local_experts``). Options our model does not implement raise ``ValueError`` rather than
    load a model that silently computes something else.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: must hold a JSON object, got {type(raw).__name__}")
    arch = _pick_architecture(raw, source)
    moe = arch == "Qwen3MoeForCausalLM"

    def unsupported(what: str, fix: str) -> ValueError:
        return ValueError(f"{source}: {what} is not supported by this engine ({fix})")

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise unsupported(f"hidden_act={act!r}", "Qwen3 uses 'silu'")
    if _bool_field(raw, "attention_bias", source, False):
        raise unsupported("attention_bias=true", "our q/k/v/o projections have no bias")
    quant = raw.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {quant!r}")
    if quant:
        method = quant.get("quant_method", "?")
        raise unsupported(f"a quantized checkpoint (quant_method={method!r})",
                          "use the unquantized BF16/FP16/FP32 weights")

    rope_theta = _rope_theta(raw, source)
    hidden = _int_field(raw, "hidden_size", source)
    heads = _int_field(raw, "num_attention_heads", source)
    layers = _int_field(raw, "num_hidden_layers", source)
    fields: dict[str, Any] = dict(
        vocab_size=_int_field(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_int_field(raw, "intermediate_size", source),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_int_field(raw, "num_key_value_heads", source, default=heads),
        head_dim=_int_field(raw, "head_dim", source, default=max(1, hidden // heads)),
        rms_norm_eps=_float_field(raw, "rms_norm_eps", source, 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=_int_field(raw, "max_position_embeddings", source, default=32768),
        tie_word_embeddings=_bool_field(raw, "tie_word_embeddings", source, False),
        sliding_window=_sliding_window(raw, layers, moe, source),
    )
    if moe:
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        if raw.get(key) is None:
            raise ValueError(f"{source}: a Qwen3MoeForCausalLM config needs 'num_experts' "
                             "(or 'num_local_experts')")
        experts = _int_field({"num_experts": raw[key]}, "num_experts", source)
        if experts * layers > MAX_EXPERT_MODULES:
            raise ValueError(f"{source}: {layers} layers x {experts} experts is more than this engine "
                             f"builds ({MAX_EXPERT_MODULES} expert blocks); is the config corrupt?")
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 and 0 <= i < layers for i in only):
            raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices in "
                             f"[0, {layers}), got {only!r}")
        fields.update(
            num_experts=experts,
            num_experts_per_tok=_int_field(raw, "num_experts_per_tok", source),
            moe_intermediate_size=_int_field(raw, "moe_intermediate_size", source),
            # HF's Qwen3-MoE default is False; the released models set it to true explicitly.
            norm_topk_prob=_bool_field(raw, "norm_topk_prob", source, False),
            decoder_sparse_step=_int_field(raw, "decoder_sparse_step", source, default=1),
            mlp_only_layers=list(only),
        )
    try:
        cfg = Qwen3Config(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    dtype_name = raw.get("torch_dtype") or raw.get("dtype")
    try:
        if dtype_name is not None and not isinstance(dtype_name, str):
            raise ValueError(dtype_name)
        dtype = resolve_dtype(dtype_name)
    except ValueError:
        raise ValueError(f"{source}: unknown dtype {dtype_name!r}; pass dtype= to load_model") from None
    return arch, cfg, dtype


def _pick_architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{source}: architectures must be a list of names, got {archs!r}")
    if not archs and isinstance(raw.get("model_type"), str) and raw["model_type"] in _MODEL_TYPES:
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
    return _float_field({"rope_theta": theta}, "rope_theta", source, 10_000.0)


def _sliding_window(raw: dict[str, Any], layers: int, moe: bool, source: str) -> int:
    """0 for full attention, else the window; refuses a mix of windowed and full layers.

    HF applies the window only when ``use_sliding_window`` is true. Qwen3-MoE then windows every
    layer; dense Qwen3 windows the layers marked "sliding_attention" in ``layer_types`` (by
    default those with index >= ``max_window_layers``). Our model has one window for all layers.
    """
    if not _bool_field(raw, "use_sliding_window", source, False) or not raw.get("sliding_window"):
        return 0
    window = _int_field(raw, "sliding_window", source)
    if moe:
        return window
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= _int_field(raw, "max_window_layers", source, default=28, minimum=0)
        else "full_attention" for i in range(layers)]
    if not isinstance(types, list):
        raise ValueError(f"{source}: layer_types must be a list, got {types!r}")
    sliding = {t == "sliding_attention" for t in types}
    if sliding == {True}:
        return window
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
    return config_from_hf(read_json_object(cfg_file), str(cfg_file))


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file if it is not UTF-8 JSON holding
    an object (a binary file, a truncated download, a list, nesting deep enough to overflow)."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not valid UTF-8 JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    return raw
