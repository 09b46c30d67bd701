"""One offline script, two engines: only the import line differs.

    .venv/bin/python scripts/offline_same_script.py --model DIR --out ours.json
    SAME_SCRIPT_ENGINE=vllm .venv-peers/bin/python scripts/offline_same_script.py --model DIR --out vllm.json

It uses what the course engine shares with vLLM's offline API — the constructor's vLLM names,
``generate`` with strings, token-id dicts and per-prompt params, ``n`` and ``seed``, stop strings
and stop tokens, ``min_tokens``, ``detokenize``, ``skip_special_tokens``, prompt truncation,
``prompt_logprobs``, ``chat`` with template options, the prefix cache's ``num_cached_tokens`` and
``reset_prefix_cache`` — and writes every output as JSON. ``scripts/vllm_same_script.py`` runs
it on both and diffs; ``tests/test_vllm_surface.py`` runs it through a stand-in with vLLM 0.32's
recorded signatures, so nothing here is ours alone. Greedy results must agree exactly; sampled
ones (``"compare": false``) only in shape, since the two engines draw random numbers differently.
"""
from __future__ import annotations

import argparse
import json
import os

if os.environ.get("SAME_SCRIPT_ENGINE") == "vllm":  # the import line
    from vllm import LLM, SamplingParams
else:
    from engine.llm import LLM
    from engine.serve import SamplingParams

PROMPTS = ["hello world", "the quick brown fox", "a paged cache holds", "stop strings end"]
LONG = "the quick brown fox jumps over the lazy dog " * 3  # > 2 blocks of 32 tokens


def record(outputs, compare: bool = True) -> list[dict]:
    """The fields of vLLM's RequestOutput / CompletionOutput both engines fill."""
    rows = []
    for o in outputs:
        rows.append({
            "prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids), "finished": o.finished,
            "num_cached_tokens": o.num_cached_tokens, "compare": compare,
            "prompt_logprobs": None if o.prompt_logprobs is None else [
                None if e is None else {str(t): round(lp.logprob, 3) for t, lp in sorted(e.items())}
                for e in o.prompt_logprobs],
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "cumulative_logprob": c.cumulative_logprob} for c in o.outputs],
        })
    return rows


def main(model: str) -> dict[str, list[dict]]:
    llm = LLM(model=model, dtype="float32", seed=0, max_model_len=512, block_size=32,
              kv_cache_memory_bytes=32 * 2**20, max_num_seqs=16, max_num_batched_tokens=512,
              enable_prefix_caching=True, enforce_eager=True, tensor_parallel_size=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    runs: dict[str, list[dict]] = {}
    first = llm.generate(PROMPTS, greedy, use_tqdm=False)
    runs["strings"] = record(first)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    runs["token_ids_per_prompt_params"] = record(llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4,
                                                                       stop_token_ids=[first[1].outputs[0].token_ids[6]])],
        use_tqdm=False))
    # stop strings picked from the greedy text, so that they occur (both engines pick the same ones
    # exactly when their greedy texts agree, which is what this diff checks first)
    text = first[0].outputs[0].text
    stop = text[6:8] if len(text) >= 8 else "zz"
    runs["stop_strings"] = record(llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
                                               use_tqdm=False))
    toks = first[2].outputs[0].token_ids  # a stop string made of two tokens' edges
    i = next((i for i in range(1, len(toks)) if tok.decode(toks[:i]) and tok.decode(toks[i:i + 1]).strip()
              and tok.decode(toks[:i])[-1] + tok.decode(toks[i:i + 1])[0] not in tok.decode(toks[:i])), 1)
    across = tok.decode(toks[:i])[-1:] + tok.decode(toks[i:i + 1])[:1]
    runs["stop_across_tokens"] = record(llm.generate(PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=24,
                                                                                  stop=["\x01", across]),
                                                     use_tqdm=False))
    later = first[3].outputs[0].text
    runs["stop_late"] = record(llm.generate(PROMPTS[3:], SamplingParams(temperature=0.0, max_tokens=24,
                                                                        stop=[later[12:15] or "zz"]), use_tqdm=False))
    runs["stop_strings_included"] = record(llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False))
    runs["ignore_eos_no_detokenize"] = record(llm.generate(
        PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False))
    runs["special_tokens_kept"] = record(llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, skip_special_tokens=False),
        use_tqdm=False))
    runs["truncated_prompt"] = record(llm.generate(
        [LONG], greedy, use_tqdm=False,
        tokenization_kwargs={"truncate_prompt_tokens": 9, "truncation_side": "left"}))
    runs["prompt_logprobs"] = record(llm.generate(
        PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1), use_tqdm=False))
    # the prefix cache: the second run of a long prompt finds its two full 32-token blocks
    llm.reset_prefix_cache()
    runs["prefix_cache"] = record(llm.generate([LONG], greedy, use_tqdm=False)
                                  + llm.generate([LONG], greedy, use_tqdm=False))
    convo = [{"role": "user", "content": "hello world"}]
    runs["chat"] = record(llm.chat(convo, greedy, use_tqdm=False))
    runs["chat_continue"] = record(llm.chat(
        convo + [{"role": "assistant", "content": "the quick"}], greedy, use_tqdm=False,
        add_generation_prompt=False, continue_final_message=True))
    runs["sampled_n_seed"] = record(llm.generate(
        PROMPTS[:1], SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, seed=1234, max_tokens=8,
                                    ignore_eos=True), use_tqdm=False), compare=False)
    return runs


if __name__ == "__main__":  # vLLM's CPU build starts worker processes: keep this guard
    ap = argparse.ArgumentParser(description="run the same offline script on the course engine or vLLM")
    ap.add_argument("--model", required=True, help="an HF checkpoint directory (scripts/tiny_hf_checkpoint.py)")
    ap.add_argument("--out", required=True, help="where to write the outputs as JSON")
    args = ap.parse_args()
    with open(args.out, "w") as f:
        json.dump(main(args.model), f, indent=1)
