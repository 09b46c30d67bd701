"""The registries of attention backends and flat models: each found by name, imported only when asked for.

The chapter's files name none of the fast paths: ``EngineCore`` asks for
``get_flat_model(config.flat_model)`` and ``get_backend(config.attention_backend)``, and this file
maps those names to classes ("module:Class"), so ``engine/fast/`` is imported only when
one of its entries is chosen. The chapter's own pieces are the entries "reference" (attention) and
"flat" (the model).

Which fast configuration to pick on a machine is not the chapter's business: ``engine.fast.choose``.
"""
from __future__ import annotations

import importlib
from typing import Any

from engine.serve.config import ATTENTION_BACKENDS, FLAT_MODELS  # the name tables live with the options that name them


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
