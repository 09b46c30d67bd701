"""Models: Qwen3 (chapter 17), Qwen3-MoE (chapter 27), and the 2-layer test model."""
from engine.models.config import Qwen3Config
from engine.models.loader import load_model
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.tiny import tiny_config, tiny_model

__all__ = ["Qwen3Config", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "load_model", "tiny_config",
           "tiny_model"]
