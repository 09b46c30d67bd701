"""Record vLLM's offline API surface to ``tests/vllm_surface.json``; run it with vLLM's Python.

    .venv-peers/bin/python scripts/record_vllm_surface.py [--out tests/vllm_surface.json]

What it writes, for ``tests/test_vllm_surface.py`` to check the course's ``LLM`` against without
importing vLLM: the parameters (name, default, kind) of ``LLM.__init__`` and of every public
``LLM`` method, the fields and defaults of ``SamplingParams``, ``CompletionOutput`` and
``RequestOutput``, and the names and defaults of ``EngineArgs`` (what ``LLM(**kwargs)`` passes
on). Defaults are stored as ``repr()`` strings, so they compare exactly whatever their type.
Names and defaults only: no documentation text is copied.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from pathlib import Path


def _default(value) -> str | None:
    """repr() of a default; None for "no default" (a required parameter)."""
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return None
    return repr(value)


def _signature(fn) -> list[dict]:
    params = []
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self":
            continue
        params.append({"name": name, "default": _default(p.default), "kind": p.kind.name})
    return params


def _struct_fields(cls) -> list[dict]:
    """Fields of a msgspec Struct (SamplingParams) or a dataclass, in declaration order."""
    if dataclasses.is_dataclass(cls):
        out = []
        for f in dataclasses.fields(cls):
            default = f.default
            if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            out.append({"name": f.name, "default": _default(default)})
        return out
    import msgspec

    out = []
    for f in msgspec.structs.fields(cls):
        default = f.default
        if default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        out.append({"name": f.name, "default": None if default is msgspec.NODEFAULT else repr(default)})
    return out


def record() -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput, RequestOutput

    methods = {}
    for name, member in inspect.getmembers(LLM):
        if name.startswith("_"):
            continue
        if inspect.isfunction(member) or inspect.ismethod(member):
            methods[name] = _signature(member)
        elif isinstance(member, property):
            methods[name] = "property"
    return {
        "vllm_version": vllm.__version__,
        "LLM.__init__": _signature(LLM.__init__),
        "LLM methods": methods,
        "SamplingParams": _struct_fields(SamplingParams),
        "SamplingParams properties": sorted(n for n, m in inspect.getmembers(SamplingParams)
                                            if not n.startswith("_") and isinstance(m, property)),
        "CompletionOutput": _struct_fields(CompletionOutput),
        "CompletionOutput methods": sorted(n for n, m in vars(CompletionOutput).items()
                                           if not n.startswith("_") and inspect.isfunction(m)),
        "RequestOutput.__init__": _signature(RequestOutput.__init__),
        "EngineArgs": _struct_fields(EngineArgs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "vllm_surface.json"))
    args = ap.parse_args()
    surface = record()
    Path(args.out).write_text(json.dumps(surface, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}: vLLM {surface['vllm_version']}, {len(surface['LLM methods'])} LLM methods, "
          f"{len(surface['SamplingParams'])} SamplingParams fields, {len(surface['EngineArgs'])} EngineArgs")


if __name__ == "__main__":
    main()
