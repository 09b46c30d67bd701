"""The course's ``LLM``/``SamplingParams``/outputs against vLLM 0.32's recorded offline surface.

vLLM is not importable in the suite, so ``tests/vllm_surface.json`` records its names and
defaults (``scripts/record_vllm_surface.py``, run with vLLM's Python, rewrites it). Every vLLM
field, parameter and method must be, here, either supported with vLLM's meaning — same name,
same default, and a test below or in ``test_llm_api.py`` showing the behaviour — or refused by
name with a message saying why. Then one offline script (``scripts/offline_same_script.py``)
runs twice: through a stand-in that accepts exactly vLLM's recorded signatures and exposes only
vLLM's output fields, and on the course engine directly; both give the same outputs.
``scripts/vllm_same_script.py`` runs the same script on real vLLM and diffs.

Run with the reference: ``pytest --impl solution tests/test_vllm_surface.py``.
"""
from __future__ import annotations

# greedy_rewrite: done (written for temperature 1.0 by default: greedy calls say temperature=0.0)

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest

from engine import llm_options
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.serve import EngineConfig, SamplingParams
from engine.serve.params import FULL_SAMPLER_FIELDS, UNSUPPORTED_FIELDS
from pathload import load_by_path

TESTS = Path(__file__).resolve().parent
SURFACE = json.loads((TESTS / "vllm_surface.json").read_text())

# vLLM's SamplingParams fields that its own docs mark as set by the engine, not given by users.
INTERNAL_FIELDS = {"output_text_buffer_length", "_eos_token_id", "_all_stop_token_ids", "_watermarking_skipped",
                   "_bad_words_token_ids"}
# field -> the test that shows it behaving as in vLLM.
SERVED_FIELDS = {
    "n": "test_llm_api.py::test_default_params_and_n",
    "temperature": "test_llm_api.py::test_tiny_temperature_is_raised_to_the_documented_minimum",
    "top_p": "test_llm_api.py::test_seeded_sampling_matches_chapter_8",
    "top_k": "test_llm_api.py::test_seeded_sampling_matches_chapter_8",
    "seed": "test_llm_api.py::test_seeded_sampling_matches_chapter_8",
    "stop": "test_llm_api.py::test_stop_string_across_a_token_boundary",
    "stop_token_ids": "test_llm_api.py::test_stop_token_text_is_left_out_unless_asked",
    "ignore_eos": "test_models_hf.py::test_llm_extra_eos_from_generation_config",
    "max_tokens": "test_llm_api.py::test_max_tokens_none_runs_to_the_context_limit",
    "min_tokens": "test_llm_api.py::test_stop_strings_wait_for_min_tokens",
    "prompt_logprobs": "test_llm_api.py::test_outputs_carry_vllms_fields",
    "logprobs": "test_sampling_features.py::test_logprobs_match_a_float64_forward_pass",
    "presence_penalty": "test_sampling_features.py::test_penalties_match_a_float64_oracle",
    "frequency_penalty": "test_sampling_features.py::test_penalties_match_a_float64_oracle",
    "repetition_penalty": "test_sampling_features.py::test_penalties_match_a_float64_oracle",
    "min_p": "test_sampling_features.py::test_min_p_draws_from_the_oracles_distribution",
    "detokenize": "test_llm_api.py::test_detokenize_off_and_special_tokens",
    "skip_special_tokens": "test_llm_api.py::test_detokenize_off_and_special_tokens",
    "include_stop_str_in_output": "test_llm_api.py::test_stop_string_across_a_token_boundary",
}
# fields that change nothing here, as in vLLM for the same set-up -> why (test_no_effect_fields).
NO_EFFECT_FIELDS = {
    "flat_logprobs": "it only changes the container vLLM returns logprobs in; here always a list of dicts",
    "skip_clone": "a copying hint for vLLM's internals",
    "output_kind": "offline generate() returns finished requests whatever it says, in vLLM too",
    "extra_args": "for custom samplers; no built-in sampler reads it, in vLLM either",
    "spaces_between_special_tokens": "vLLM applies it to slow tokenizers only; both read the fast tokenizer.json",
}
SUPPORTED_METHODS = {"generate", "chat", "enqueue", "enqueue_chat", "wait_for_completion", "get_tokenizer",
                     "get_default_sampling_params", "get_metrics", "reset_prefix_cache", "apply_model",
                     "get_world_size", "reset_mm_cache"}
# LLM.__init__ parameters that are the course's own explicit parameters (the rest go through **options).
NOT_OPTIONS = {"model", "kwargs"}


def _fields(name: str) -> dict[str, str | None]:
    return {f["name"]: f["default"] for f in SURFACE[name]}


def _test_exists(ref: str) -> bool:
    file, name = ref.split("::")
    return re.search(rf"^def {name}\(", (TESTS / file).read_text(), re.M) is not None


def _literal(text: str):
    """A recorded default as a value, when it is a plain literal; else a marker."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _NOT_LITERAL


_NOT_LITERAL = object()


def test_surface_is_vllm_032():
    assert SURFACE["vllm_version"] == "0.32.0"


# --------------------------------------------------------------------------- SamplingParams


def test_sampling_params_fields_and_defaults():
    ours = {f.name: f for f in dataclasses.fields(SamplingParams)}
    theirs = {k: v for k, v in _fields("SamplingParams").items() if k not in INTERNAL_FIELDS}
    groups = [set(SERVED_FIELDS), set(NO_EFFECT_FIELDS), set(FULL_SAMPLER_FIELDS), set(UNSUPPORTED_FIELDS)]
    for name, default in theirs.items():
        assert name in ours, f"vLLM's SamplingParams.{name} is missing"
        assert repr(ours[name].default) == default, f"SamplingParams.{name}: default {ours[name].default!r} vs vLLM's {default}"
        assert sum(name in g for g in groups) == 1, f"SamplingParams.{name} must be in exactly one group"
    for g in groups:
        assert g <= set(theirs), f"not vLLM fields: {sorted(g - set(theirs))}"
    for name, ref in SERVED_FIELDS.items():
        assert _test_exists(ref), f"{name}: no test {ref}"
    for name, neutral in FULL_SAMPLER_FIELDS.items():  # the neutral value is vLLM's default
        assert SamplingParams(**{name: _literal(theirs[name])}).full_sampler_fields() == []
    order = [n for n in ours if n in theirs]
    assert order == list(theirs), "vLLM's fields are in vLLM's order (positional arguments mean the same)"
    for prop in SURFACE["SamplingParams properties"]:
        assert isinstance(getattr(SamplingParams, prop, None), property), f"SamplingParams.{prop}"


def test_no_effect_fields(model_llm):
    llm, prompt = model_llm
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [want] = llm.generate({"prompt_token_ids": prompt}, base)
    from engine.serve.params import RequestOutputKind

    changed = {"flat_logprobs": True, "skip_clone": True, "output_kind": RequestOutputKind.FINAL_ONLY,
               "extra_args": {"x": 1}, "spaces_between_special_tokens": False}
    assert set(changed) == set(NO_EFFECT_FIELDS)
    for name, value in changed.items():
        [got] = llm.generate({"prompt_token_ids": prompt}, dataclasses.replace(base, **{name: value}))
        assert (got.outputs[0].token_ids, got.outputs[0].text) == (want.outputs[0].token_ids, want.outputs[0].text), name


# --------------------------------------------------------------------------- outputs


def test_output_fields_and_defaults():
    ours = {f.name: f for f in dataclasses.fields(CompletionOutput)}
    for name, default in _fields("CompletionOutput").items():
        assert name in ours, f"vLLM's CompletionOutput.{name} is missing"
        if default is not None:
            assert repr(ours[name].default) == default, f"CompletionOutput.{name}"
    for method in SURFACE["CompletionOutput methods"]:
        assert callable(getattr(CompletionOutput, method, None)), f"CompletionOutput.{method}()"
    ours = {f.name: f for f in dataclasses.fields(RequestOutput)}
    for p in SURFACE["RequestOutput.__init__"]:
        if p["kind"] == "VAR_KEYWORD":
            continue
        assert p["name"] in ours, f"vLLM's RequestOutput.{p['name']} is missing"
        if p["default"] is not None:
            assert repr(ours[p["name"]].default) == p["default"], f"RequestOutput.{p['name']}"


# --------------------------------------------------------------------------- LLM


def test_llm_constructor_parameters():
    ours = inspect.signature(LLM.__init__).parameters
    engine_fields = set(EngineConfig.field_names())
    for p in SURFACE["LLM.__init__"]:
        name, default = p["name"], p["default"]
        if name in NOT_OPTIONS:
            continue
        if name in ours:
            assert repr(ours[name].default) == default, f"LLM({name}=...): default {ours[name].default!r} vs {default}"
            continue
        assert (name in llm_options.HARMLESS or name in llm_options.NEUTRAL_ONLY
                or llm_options.VLLM_NAMES.get(name, name) in engine_fields), f"LLM({name}=...) is not handled"
        if name in llm_options.NEUTRAL_ONLY:
            value = _literal(default)
            llm_options.split_options({name: value}, engine_fields)  # vLLM's default is accepted
            with pytest.raises(ValueError, match=rf"{name}=.*not supported by the course engine"):
                llm_options.split_options({name: "something else"}, engine_fields)


def test_every_engine_argument_is_accepted_or_refused_by_name():
    """LLM(**kwargs) passes vLLM's EngineArgs on: each name is ours, harmless, or refused by name."""
    engine_fields = set(EngineConfig.field_names())
    marker = object()
    for name, default in _fields("EngineArgs").items():
        ours = llm_options.VLLM_NAMES.get(name, name)
        if ours in engine_fields or name in llm_options.HARMLESS or name == "kv_cache_memory_bytes":
            continue
        with pytest.raises(ValueError, match=re.escape(name)):
            llm_options.split_options({name: marker}, engine_fields)
        if name in llm_options.NEUTRAL_ONLY and _literal(default) is not _NOT_LITERAL and name != "generation_config":
            llm_options.split_options({name: _literal(default)}, engine_fields)  # vLLM's default changes nothing
    # where vLLM gives an engine knob a concrete default, it is ours too
    config = EngineConfig()
    for name, default in _fields("EngineArgs").items():
        ours = llm_options.VLLM_NAMES.get(name, name)
        if ours in engine_fields and _literal(default) not in (None, _NOT_LITERAL) and ours != "gpu_memory_utilization":
            owner = next(c for c in (config.cache, config.scheduler, config) if hasattr(c, ours))
            assert getattr(owner, ours) == _literal(default), f"EngineConfig.{ours} vs vLLM's {name}={default}"


def test_llm_methods(model_llm):
    llm, _ = model_llm
    for name, params in SURFACE["LLM methods"].items():
        assert hasattr(LLM, name), f"vLLM's LLM.{name} is missing"
        if name in SUPPORTED_METHODS:
            ours = inspect.signature(getattr(LLM, name)).parameters
            for p in params:
                assert p["name"] in ours, f"LLM.{name}({p['name']}=...) is missing"
                if p["default"] is not None:
                    assert repr(ours[p["name"]].default) == p["default"], f"LLM.{name}({p['name']}=...) default"
            extra = [n for n, q in ours.items() if n != "self" and n not in {p["name"] for p in params}]
            assert all(ours[n].default is not inspect.Parameter.empty for n in extra), f"LLM.{name}: {extra}"
        else:
            with pytest.raises(ValueError, match=rf"^LLM\.{name}: \w"):
                getattr(llm, name)()


# --------------------------------------------------------------------------- one script, both shapes


def _signature(params: list[dict]) -> inspect.Signature:
    sig = []
    for p in params:
        kind = inspect.Parameter.__dict__[p["kind"]]
        default = inspect.Parameter.empty if p["default"] is None and kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) else "recorded"
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            default = inspect.Parameter.empty
        sig.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(sig)


class _Shaped:
    """An output seen through vLLM's recorded field names: anything else is an AttributeError."""

    def __init__(self, obj, allowed: set[str]) -> None:
        self._obj, self._allowed = obj, allowed

    def __getattr__(self, name: str):
        if name not in self._allowed:
            raise AttributeError(f"vLLM 0.32's {type(self._obj).__name__} has no {name!r}")
        value = getattr(self._obj, name)
        if name == "outputs":
            return [_Shaped(c, COMPLETION_NAMES) for c in value]
        return value


COMPLETION_NAMES = set(_fields("CompletionOutput")) | set(SURFACE["CompletionOutput methods"])
REQUEST_NAMES = {p["name"] for p in SURFACE["RequestOutput.__init__"]} | {"kv_transfer_params"}


def vllm_shaped(calls: list[str]):
    """LLM and SamplingParams stand-ins that accept exactly vLLM 0.32's recorded signatures and fields,
    run the course engine underneath, and record each call they checked."""
    sp_fields = set(_fields("SamplingParams")) - INTERNAL_FIELDS
    engine_args = set(_fields("EngineArgs"))
    init = _signature(SURFACE["LLM.__init__"])
    methods = {n: _signature([{"name": "self", "kind": "POSITIONAL_ONLY", "default": None}] + ps)
               for n, ps in SURFACE["LLM methods"].items()}

    def sampling_params(*args, **kwargs):
        assert not args, "the script passes SamplingParams' fields by name"
        unknown = set(kwargs) - sp_fields
        assert not unknown, f"not vLLM 0.32 SamplingParams fields: {sorted(unknown)}"
        calls.append("SamplingParams(" + ", ".join(sorted(kwargs)) + ")")
        return SamplingParams(**kwargs)

    class ShapedLLM:
        def __init__(self, *args, **kwargs):
            bound = init.bind(*args, **kwargs)
            extra = set(bound.arguments.get("kwargs", {}))
            assert extra <= engine_args, f"not vLLM 0.32 engine arguments: {sorted(extra - engine_args)}"
            calls.append("LLM(" + ", ".join(sorted(kwargs)) + ")")
            model = kwargs.pop("model", args[0] if args else None)
            self._llm = LLM(model, **kwargs)

        def __getattr__(self, name):
            if name not in methods:
                raise AttributeError(f"vLLM 0.32's LLM has no method {name!r}")

            def call(*args, **kwargs):
                methods[name].bind(self, *args, **kwargs)
                calls.append(f"LLM.{name}(" + ", ".join(sorted(kwargs)) + ")")
                result = getattr(self._llm, name)(*args, **kwargs)
                if isinstance(result, list) and result and isinstance(result[0], RequestOutput):
                    return [_Shaped(r, REQUEST_NAMES) for r in result]
                return result

            return call

    return ShapedLLM, sampling_params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tiny = load_by_path("tiny_hf_checkpoint", "scripts/tiny_hf_checkpoint.py")
    return tiny.save_tiny_checkpoint(tmp_path_factory.mktemp("same_script") / "tiny-qwen3")


@pytest.fixture(scope="module")
def model_llm(checkpoint):
    llm = LLM(checkpoint, block_size=4, num_blocks=64)
    return llm, llm.get_tokenizer().encode("hello world")


def test_one_offline_script_through_both_shapes(checkpoint, monkeypatch):
    script = load_by_path("offline_same_script", "scripts/offline_same_script.py")
    direct = script.main(str(checkpoint))
    calls: list[str] = []
    shaped_llm, shaped_params = vllm_shaped(calls)
    monkeypatch.setattr(script, "LLM", shaped_llm)
    monkeypatch.setattr(script, "SamplingParams", shaped_params)
    through_vllm_shape = script.main(str(checkpoint))
    assert through_vllm_shape == direct
    assert any(c.startswith("LLM.chat(") for c in calls) and any("stop" in c for c in calls), calls
    same = load_by_path("vllm_same_script", "scripts/vllm_same_script.py")
    assert same.diff_runs(direct, through_vllm_shape) == []
    changed = json.loads(json.dumps(direct))
    changed["strings"][0]["outputs"][0]["token_ids"][3] += 1
    assert same.diff_runs(direct, changed) == [
        f"strings[0].outputs[0].token_ids: ours {direct['strings'][0]['outputs'][0]['token_ids']!r} vs vLLM "
        f"{changed['strings'][0]['outputs'][0]['token_ids']!r}"]
