"""What the fast path's probes share: a choice asked for by name (argument, else environment
variable, else measured) and, for the attention probes, one measured choice per attention shape.

``linear_layout``, ``cpu_prefill`` and ``cpu_decode_variant`` each pick among kernels by timing
them on the machine at hand. A choice can be forced by name, so tests run every path anywhere:
``forced_name`` reads it. The two attention probes measure once per (dtype, heads, head size,
block size, thread count) for the process and report every choice they made (``remembered``,
``shape_line``); the module that owns a probe keeps its two dictionaries, so a test can empty them.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

C = TypeVar("C")


def forced_name(asked: str | None, env: str, names: tuple[str, ...], what: str) -> str | None:
    """The name asked for (``asked``, else ``$env``), or None for "measure" (unset or "auto");
    ValueError naming the choices (and the variable, when it came from there) for any other name."""
    name = asked if asked is not None else os.environ.get(env) or None
    if name in (None, "auto"):
        return None
    if name not in names:
        where = "" if asked is not None else f" (from ${env})"
        raise ValueError(f"{what}{where} must be one of {', '.join(names)} or 'auto', not {name!r}")
    return name


def attention_key(dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int) -> tuple:
    """What an attention probe's choice is kept under: the shape and this process's thread count."""
    return (dtype, hq, hkv, d, bs, torch.get_num_threads())


def remembered(chosen: dict[tuple, C], made: dict[tuple, C], key: tuple, forced: C | None,
               measure: Callable[[], C]) -> C:
    """``forced`` if given, else ``chosen[key]`` (measured on first use); recorded in ``made``
    (under ``key`` and whether it was forced) for the report."""
    if forced is not None:
        choice = forced
    else:
        if key not in chosen:
            chosen[key] = measure()
        choice = chosen[key]
    made[key + (forced is not None,)] = choice
    return choice


def shape_line(choice: str, key: tuple, measured: bool) -> str:
    """One report line: the choice, then how it was made and for which attention shape (``key``
    as ``remembered`` keeps it: shape, thread count, forced)."""
    dtype, hq, hkv, d, bs, threads, _ = key
    return (f"{choice} [{'measured' if measured else 'forced'}; {str(dtype).removeprefix('torch.')}, "
            f"{hq}/{hkv} heads of {d}, blocks of {bs}, {threads} thread(s)]")
