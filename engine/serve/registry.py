"""The registries of attention backends and flat models: each found by name, imported only when asked for.

The chapter's files name none of the fast paths: ``EngineCore`` asks for
``get_flat_model(config.flat_model)`` and ``get_backend(config.attention_backend)``, and this file
maps those names to classes ("module:Class"), so ``engine/serve/backends/`` is imported only when
one of its entries is chosen. The chapter's own pieces are the entries "reference" (attention) and
"flat" (the model).

``fastest_options`` names the configuration that serves a model fastest on this machine: the
default of ``LLM`` and of ``run.py bench``'s fast core (``EngineConfig``'s own defaults stay the
plain, readable ones).
"""
from __future__ import annotations

import importlib
from importlib.util import find_spec
from typing import Any

import torch

ATTENTION_BACKENDS: dict[str, str] = {
    "reference": "engine.serve.attention:ReferenceBackend",  # the chapter's loop: the oracle
    "torch": "engine.serve.backends.torch_attention:TorchBackend",  # vectorized, the default
    "cpu": "engine.serve.backends.cpu_attention:CPUBackend",  # a C++ kernel reads the pool in place
    "triton": "engine.serve.backends.triton_attention:TritonBackend",  # chapter 32, GPU
}
FLAT_MODELS: dict[str, str] = {
    "flat": "engine.serve.flat:FlatModel",  # the chapter's: the model's own modules, one by one
    "fused": "engine.serve.backends.fused:FusedFlatModel",  # merged projections, fused elementwise ops
    "compiled": "engine.serve.backends.compiled:CompiledFlatModel",  # fused layers as one Inductor graph
}


def _load(registry: dict[str, str], kind: str, name: str) -> Any:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}: choose one of {sorted(registry)}")
    module_name, cls_name = registry[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def get_backend(name: str, **options: Any):
    """The attention backend called ``name`` (see ``ATTENTION_BACKENDS``), built with ``options``."""
    return _load(ATTENTION_BACKENDS, "attention backend", name)(**options)


def get_flat_model(name: str, model) -> Any:
    """The flat model called ``name`` (see ``FLAT_MODELS``) around the loaded ``model``."""
    return _load(FLAT_MODELS, "flat model", name)(model)


FASTEST_FLAT_MODEL = "fused"  # on every device; see fastest_options


def fastest_options(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """The ``attention_backend`` and ``flat_model`` that serve a model of ``dtype`` on ``device``
    fastest here: always ``flat_model="fused"``, and "triton" on a CUDA device with Triton
    installed; "cpu" on a CPU whose C++ compiler builds its kernel, for the dtypes it reads
    (float32, bfloat16, float64); else "torch".

    Measured, not assumed (``docs/performance.md``): the compiled layer graph ("compiled") was
    slower than the fused eager path on every CPU measured, once the fused elementwise kernels
    existed, and it costs a compile at start-up, so it is opt-in.
    """
    device = torch.device(device)
    if device.type == "cuda":
        backend = "triton" if find_spec("triton") is not None else "torch"
    else:
        backend = "torch"
        if device.type == "cpu":
            from engine.serve.backends import cpu_attention

            try:
                if dtype in cpu_attention.DTYPES:
                    cpu_attention.load_kernel()
                    backend = "cpu"
            except ValueError:  # no C++ compiler, or a failed build: the PyTorch backend needs none
                pass
    return {"attention_backend": backend, "flat_model": FASTEST_FLAT_MODEL}
