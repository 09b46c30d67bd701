"""``run.py bench`` end to end on tiny workloads: every engine serves the same greedy tokens.

The numbers themselves are not checked (they depend on the machine); what is checked is that the
workloads are what they claim, that every engine answers every request with the same tokens,
and that ``--json`` and ``--plot`` write their files.
"""
from __future__ import annotations

import json

import pytest
import torch

from course.bench.compare import bench_main, longest_request, make_workload
from course.bench.workloads import ChatTurn, chat_workload, random_workload

pytestmark = pytest.mark.given  # the bench drives the reference engine; no learner hole is graded here


def test_workloads_are_seeded_and_shaped():
    a, b = random_workload(8, seed=3), random_workload(8, seed=3)
    assert a == b and len(a) == 8 and all(16 <= len(i.prompt_token_ids) <= 256 for i in a)
    system, rounds = chat_workload(3, num_turns=2, seed=1)
    assert len(rounds) == 2 and all(len(r) == 3 and isinstance(r[0], ChatTurn) for r in rounds)
    chat = make_workload("chat", 512, scale=3 / 8)
    history = {0: [1, 2, 3]}
    first = chat.round_items(1, history)[0]
    assert first.prompt_token_ids[:3] == [1, 2, 3], "a chat turn's prompt must start with its history"
    assert longest_request(chat) > len(chat.system)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", 512)


def test_bench_runs_and_engines_agree(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--workloads", "chat", "--scale", "0.15", "--engines", "ch24,reference,fast,hf",
            "--scaling", "4", "--steps", "2", "--preset", "test", "--json", str(out_json), "--plot", str(out_png)]
    import torch

    threads = torch.get_num_threads()
    try:
        assert bench_main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # bench_main sets the process's thread count
    report = json.loads(out_json.read_text())
    for name, rows in report["workloads"].items():
        engines = {r["engine"] for r in rows}
        assert engines == {"ch24 slots", "core/reference", "core/cpu", "HF generate"}, engines
        for r in rows:
            assert r["agrees"] == 1.0, f"{r['engine']} on {name!r} gave different greedy tokens than core/reference"
            assert r["output_tokens"] > 0 and r["output_tok_s"] > 0
    assert [p["requests"] for p in report["scaling"]] == [4, 4]
    assert out_png.stat().st_size > 0
    out = capsys.readouterr().out
    assert "x fastest peer" in out
    assert report["model"]["layers"] == 2 and report["model"]["hidden"] == 128, "--preset test is the tests' model"
    # Which linear kernels the figures came from: every weight shape of the fused engine, with
    # how its layout was decided (issue 35: a measured choice may differ between sittings).
    layouts = report["linear_layouts"]
    assert layouts and all(("measured" in line or "forced" in line or "only candidate" in line)
                           and "thread(s)" in line for line in layouts), layouts
    m = report["model"]
    qkv = f"[{(m['heads'] + 2 * m['kv_heads']) * m['head_dim']}, {m['hidden']}]"  # the merged q/k/v weight
    assert any(line.startswith(qkv) for line in layouts), (qkv, layouts)
    assert "linear layouts chosen in this sitting:" in out


def test_scaling_point_keeps_every_request_running():
    """The scaling table must measure R requests decoding together, whatever the model's size:
    the point sizes its own pool, so a bigger model cannot turn R = 256 into a preempting run."""
    from course.bench.compare import MODEL_PRESETS, scaling_point
    from engine.models import tiny_model

    # Wide K/V per token (16 kv heads of 64), as a bigger model has: the memory-sized default pool
    # (128 MiB) would hold far fewer than 300 requests' tokens.
    model = tiny_model(seed=0, num_attention_heads=16, num_key_value_heads=16, head_dim=64)
    point = scaling_point(model, "torch", 300, steps=1, prompt_len=64)
    assert point["requests"] == 300 and point["step_ms"] > 0
    assert scaling_point(model, "torch", 1, steps=2, prompt_len=64)["requests"] == 1, "a lone request fits its pool too"
    assert set(MODEL_PRESETS) == {"test", "small", "qwen3-0.6b"} and MODEL_PRESETS["test"] == {}


def test_a_kept_core_engine_starts_each_run_fresh():
    """The race keeps one warm core engine, as vLLM's worker keeps its own: ``fresh()`` empties its
    prefix cache and restarts its counts, so a second run is the first one again (same tokens,
    steps and hit rate), where serving again without it hits the first run's blocks."""
    from course.bench.compare import CoreRunner
    from course.bench.workloads import WorkItem, shared_prefix_workload
    from engine.models import tiny_model
    from engine.serve import SamplingParams

    model = tiny_model(seed=0)
    items = shared_prefix_workload(4, seed=1, system_len=48, question_len=(8, 8), output_len=(3, 3))
    renamed = lambda tag: [WorkItem(i.request_id + tag, i.prompt_token_ids, i.max_tokens) for i in items]  # noqa: E731
    runner = CoreRunner(model, "torch", max_num_seqs=8)
    first = runner.serve(renamed("a"))
    first_stats = runner.stats()
    assert 0 < first_stats["hit_rate"] < 1 and first_stats["steps"] > 0
    assert runner.fresh() is runner
    second = runner.serve(renamed("b"))
    assert runner.stats() == first_stats
    assert [second[i.request_id + "b"] for i in items] == [first[i.request_id + "a"] for i in items]
    runner.fresh()
    runner.serve(renamed("c"))
    again = runner.serve(renamed("d"))  # no fresh(): the cache still holds run c's blocks
    assert runner.stats()["hit_rate"] > first_stats["hit_rate"] and again
    runner.core.add_request("left", items[0].prompt_token_ids, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="still has requests"):
        runner.fresh()


def test_peer_runner_time_and_agreement(capsys):
    """A peer engine (another process) reports its own serve time, which the bench uses; the
    agreement column falls back to the fast core when core/reference does not run."""
    from course.bench.compare import compare_engines, make_workload
    from engine.models import tiny_model

    model = tiny_model(seed=0)
    wl = make_workload("shared", model.cfg.vocab_size, scale=0.15)
    answers = compare_engines(model, wl, "torch", ["fast"], log=lambda s: None)[0].outputs

    class Peer:  # a stand-in for VLLMRunner: the core's own answers, one wrong, a fixed time
        label, timed = "peer", (2.0, 1.5)

        def serve(self, items):  # (the bench's warm-up request is not among the answers)
            out = {i.request_id: list(answers.get(i.request_id, [0])) for i in items}
            out[items[0].request_id] = [0]
            return out

        def stats(self):
            return {"steps": 0, "hit_rate": None, "preemptions": None, "kv_slots": None}

    peer = Peer()
    res = compare_engines(model, wl, "torch", ["fast", "peer"], peers={"peer": lambda: peer}, log=lambda s: None)
    mine, theirs = res
    assert mine.agrees == 1.0 and theirs.agrees == round(1 - 1 / len(answers), 3)
    assert theirs.seconds == 2.0 and theirs.cpu_seconds == 1.5, "the peer's own timing must be used"


def test_bench_peers_without_its_environment(tmp_path, monkeypatch, capsys):
    """bench-peers is optional: without .venv-peers it says how to make it and exits 2."""
    import course.peers.race as bp

    monkeypatch.setattr(bp, "PEERS_VENV", tmp_path / "missing")
    assert bp.peers_main(["--dtypes", "float32", "--threads", "1"]) == 2
    assert "make bench-peers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bp.peers_main(["--vllm-block-sizes", "16"])


def test_core_rounds_interleave_every_variant_between_chapter_24_runs(capsys):
    """``run.py core --rounds``: each core variant runs between two chapter-24 runs of the same
    round, every run gives chapter 24's tokens (or the command fails), and a ratio is printed for
    each of the four ingredients, by wall clock and by CPU time."""
    from course.bench.core import RATIO_VARIANTS, core_main, ratio_rounds
    from engine.models import tiny_model
    from course.bench.workloads import shared_prefix_workload

    model = tiny_model(seed=0)
    ratios = ratio_rounds(model, shared_prefix_workload(3), rounds=2, log=lambda line: None)
    assert len(ratios["ch24"]["wall"]) == 2 * (1 + len(RATIO_VARIANTS)), "a chapter-24 run before and after each core"
    for label, _, _ in RATIO_VARIANTS:
        assert len(ratios[label]["wall"]) == len(ratios[label]["cpu"]) == 2
        assert all(r > 0 for r in ratios[label]["wall"] + ratios[label]["cpu"])
    assert core_main(["--rounds", "1", "--requests", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 interleaved rounds" in out and "cores" in out
    for label, _, _ in RATIO_VARIANTS:
        assert any(line.startswith(label) and "median" in line and "range" in line for line in out.splitlines()), label


def test_core_comparison_with_the_reference_names_what_differs():
    """``run.py core --impl engine`` compares each core run's exact figures with the reference's:
    the same figures say "same"; a higher hit rate and more steps are named, each with what it
    suggests; other tokens name the requests."""
    from course.bench.core import compare_with_reference

    ref = {"engine": "ch31 core, ample pool", "output_tokens": 399, "steps": 115, "prefix_hit_rate": 0.827,
           "preemptions": 12, "outputs": {"r0": [1, 2], "r1": [3]}}
    assert compare_with_reference(dict(ref), ref) == {"engine": ref["engine"], "vs_reference": "same", "differs": {},
                                                      "same_tokens": True}
    mine = {**ref, "steps": 178, "prefix_hit_rate": 0.885, "outputs": {"r0": [1, 2], "r1": [4]}}
    line = compare_with_reference(mine, ref)
    assert line["vs_reference"] == "differs" and not line["same_tokens"]
    assert line["differs"] == {"steps": {"yours": 178, "reference": 115},
                               "prefix_hit_rate": {"yours": 0.885, "reference": 0.827}}
    steps, hits, tokens = line["suggests"]
    assert "empty plan" in steps and "record_lookup for a miss" in hits and "(r1)" in tokens


@pytest.mark.parametrize("impl, backend", [("engine", "reference"), ("solution", "torch")])
def test_run_py_core_says_which_code_ran(impl, backend):
    """``run.py core --impl engine`` (the default) runs the learner's own reference attention and
    FlatModel, and its first line says so; ``--impl solution`` runs the default fast backend."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "run.py", "core", "--requests", "2", "--repeat", "1", "--impl", impl],
                         cwd=root, capture_output=True, text=True, timeout=300)
    first = json.loads(out.stdout.splitlines()[0])
    assert first == {"impl": impl, "attention_backend": backend, "flat_model": "flat"}, out.stdout + out.stderr
    assert out.returncode in ((0, 2) if impl == "engine" else (0,)), out.stderr  # 2: holes left to fill


# ----- the limit: course.bench.roofline ---------------------------------------------------------------
def test_decode_step_cost_matches_a_hand_count():
    """FLOPs and bytes of a decode step, counted by hand for a tiny config: hidden 8, SwiGLU 12,
    2 layers, 2 query / 1 kv heads of 4, vocab 10; 3 requests of 5 tokens of context, float32."""
    from types import SimpleNamespace

    from course.bench.roofline import decode_step_cost, roofline

    cfg = SimpleNamespace(hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=4, vocab_size=10, num_experts=0)
    cost = decode_step_cost(cfg, requests=3, context=5, weight_bytes=4, kv_bytes=2)
    # a layer's weights: q/k/v 8 x (2 + 1 + 1) * 4 = 128, o 8 * 8 = 64, gate/up/down 3 * 8 * 12 = 288 -> 480;
    # 2 layers 960, LM head 10 * 8 = 80: 1,040 weights.
    # FLOPs: 2 * 1,040 * 3 rows = 6,240; attention 2 layers * 3 req * (2 + 2) * 2 heads * 4 * 5 = 960.
    assert cost.flops == 6240 + 960
    assert cost.weight_bytes == 1040 * 4
    # K/V read: 2 layers * 3 req * (K + V) 2 * 1 kv head * 4 * 5 tokens = 240 values of 2 bytes.
    assert cost.kv_bytes == 480 and cost.bytes == 4160 + 480
    limits = {"peak_flops": 7200 * 1000.0, "bandwidth": 4640 * 500.0}  # 1 ms of FLOPs, 2 ms of bytes
    r = roofline(cost, limits, step_ms=4.0)
    assert (r["compute_ms"], r["memory_ms"], r["roofline_ms"], r["bound"], r["fraction"]) == (1.0, 2.0, 2.0, "memory", 0.5)
    with pytest.raises(ValueError, match="requests >= 1"):
        decode_step_cost(cfg, requests=0, context=5, weight_bytes=4, kv_bytes=4)


def test_prefill_cost_matches_a_hand_count():
    """FLOPs and bytes of one prompt's prefill to its first token, by hand for the same tiny config:
    every token through every layer, causal attention, the LM head on the last token only."""
    from types import SimpleNamespace

    from course.bench.roofline import prefill_cost

    cfg = SimpleNamespace(hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=4, vocab_size=10, num_experts=0)
    cost = prefill_cost(cfg, tokens=3, weight_bytes=4, kv_bytes=2)
    # layers: 2 * 480 = 960 weights, 2 FLOPs each per token: 5,760 for 3 tokens; LM head one row: 2 * 80 = 160;
    # attention: causal pairs 1 + 2 + 3 = 6, 2 layers * (2 + 2) * 2 heads * 4 * 6 = 384.
    assert cost.flops == 5760 + 160 + 384
    assert cost.weight_bytes == (960 + 80) * 4
    # K/V written: 2 layers * 3 tokens * (K + V) 2 * 1 kv head * 4 = 48 values of 2 bytes.
    assert cost.kv_bytes == 96
    with pytest.raises(ValueError, match="tokens >= 1"):
        prefill_cost(cfg, tokens=0, weight_bytes=4, kv_bytes=4)


def test_decode_step_cost_counts_every_weight_of_a_real_model():
    """The weights counted are the model's own matrices (each linear and the LM head, the tied
    embedding counted once as the head), counted from its parameters."""
    from course.bench.compare import MODEL_PRESETS
    from course.bench.roofline import decode_step_cost
    from engine.models import tiny_model

    for overrides in (MODEL_PRESETS["test"], dict(tie_word_embeddings=True, num_hidden_layers=1)):
        model = tiny_model(seed=0, **overrides)
        head = model.lm_head.weight
        matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
        if head is model.model.embed_tokens.weight:
            matrices.append(head)
        assert any(p is head for p in matrices)
        want = sum(p.numel() for p in matrices)
        assert decode_step_cost(model.cfg, 1, 1, 1, 1).weight_bytes == want


def test_machine_limits_are_measured_and_cached():
    from course.bench.roofline import machine_limits

    a = machine_limits(size=128, copy_mib=8, tries=1)
    assert a["peak_flops"] > 0 and a["bandwidth"] == max(a["copy_bandwidth"], a["read_bandwidth"]) > 0
    assert machine_limits(size=128, copy_mib=8, tries=1) == a, "measured once per process and setting"


def test_a_16bit_peak_is_the_fastest_arithmetic_for_its_values():
    """A bfloat16 model's peak is that of bfloat16 GEMMs or of float32 ones on its exactly widened
    values, whichever is faster; on a CPU without bf16 units (emulated bfloat16 GEMMs, several
    times slower) the float32 one."""
    from course.bench.roofline import describe, machine_limits
    from engine.fast.fused import fast_16bit_matmul

    b = machine_limits(torch.bfloat16, size=256, copy_mib=8, tries=3)
    assert b["dtype"] == "bfloat16" and b["peak_dtype"] in ("bfloat16", "float32")
    if not fast_16bit_matmul(torch.bfloat16, torch.device("cpu")):
        assert b["peak_dtype"] == "float32" and "bfloat16 values, float32 arithmetic" in describe(b)
    assert machine_limits(torch.float32, size=256, copy_mib=8, tries=1)["peak_dtype"] == "float32"


def test_bench_prints_the_roofline_per_decode_point(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert bench_main(["--workloads", "", "--engines", "fast", "--scaling", "2", "--steps", "2",
                           "--preset", "test", "--scaling-backends", "torch"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "the limit: this machine's roofline" in out and "peak GEMM" in out and "GB/s" in out
    row = next(line for line in out.splitlines()[::-1] if line.startswith("torch "))
    assert row.split()[1] == "2" and row.rstrip().endswith("%")


def test_cpu_flags_come_from_cpuinfo(tmp_path):
    """One /proc/cpuinfo reader: the model and the matrix-unit flags, AMX included."""
    from course.bench.machine import cpu_model_and_flags, machine_info

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 amx_fancy\n\n"
                    "processor\t: 1\nmodel name\t: other\n")
    assert cpu_model_and_flags(str(info)) == ("Intel(R) Xeon(R) Platinum 8480+",
                                              ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16",
                                               "amx_int8", "amx_fancy"])
    m = machine_info(2)
    assert m["torch_threads"] == 2 and "; 2 torch thread(s), OpenMP " in m["line"] and m["cpu"] in m["line"]
    assert m["line"].endswith(f'{m["openmp"]}; {m["pages"]}'), "the OpenMP runtime, its spin policy and the pages close the line"


# ----- qwen3-0.6b workloads and the LM head ------------------------------------------------------
def test_qwen_preset_workloads_are_sized_for_two_cores():
    """16 requests of 128 prompt tokens wanting 32 each: behind one 96-token prefix, or each its own."""
    shared = make_workload("shared", 151_936, preset="qwen3-0.6b").rounds[0]
    rand = make_workload("random", 151_936, preset="qwen3-0.6b").rounds[0]
    for items in (shared, rand):
        assert len(items) == 16 and all(len(i.prompt_token_ids) == 128 and i.max_tokens == 32 for i in items)
    assert len({tuple(i.prompt_token_ids[:96]) for i in shared}) == 1
    assert len({tuple(i.prompt_token_ids[:8]) for i in rand}) == 16
    assert max(t for i in rand for t in i.prompt_token_ids) > 512, "token ids drawn from the whole vocabulary"


@pytest.mark.parametrize("flat_model", ["fused", "flat"])
def test_lm_head_runs_only_on_the_rows_that_sample(flat_model):
    """Counted: the LM head's input rows over a whole run equal the tokens sampled (one per
    request per step that samples), far fewer than the rows the forward passes carried
    (chunked prefills of long prompts, whose chunks sample nothing)."""
    from engine.models import tiny_model
    from engine.serve import EngineConfig, EngineCore, SamplingParams

    model = tiny_model(seed=0)
    core = EngineCore(model, EngineConfig(attention_backend="torch", flat_model=flat_model, max_num_batched_tokens=48))
    rows = {"head": 0, "forward": 0}
    if flat_model == "fused":
        head = core.flat.lm_head
        core.flat.lm_head = lambda x: (rows.__setitem__("head", rows["head"] + x.shape[0]), head(x))[1]
    else:
        head = core.flat.compute_logits
        core.flat.compute_logits = lambda x: (rows.__setitem__("head", rows["head"] + x.shape[0]), head(x))[1]
    execute = core.runner.execute
    core.runner.execute = lambda batch: (rows.__setitem__("forward", rows["forward"] + batch.input_ids.shape[0]),
                                         execute(batch))[1]
    for i, (n, m) in enumerate([(100, 3), (7, 5), (60, 2)]):
        core.add_request(f"r{i}", [(i + t) % 500 for t in range(n)], SamplingParams(max_tokens=m, ignore_eos=True))
    out = core.run_until_done()
    assert sum(len(v) for v in out.values()) == 10
    assert rows["head"] == 10, rows
    assert rows["forward"] == 167 + (10 - 3), rows  # every prompt token, then one row per later token


# ----- bench-peers with a fake peer ---------------------------------------------------------------
FAKE_WORKER = '''
"""A stand-in for course/peers/vllm_worker.py: the same protocol, every token 0, 1 ms a decode step.
It appends each serve's "reset" flag to $FAKE_PEER_LOG."""
import json, os, sys, time
log = open(os.environ["FAKE_PEER_LOG"], "a")
print(json.dumps({"ready": True, "threads": 1, "vllm": "fake", "torch": "none",
                  "config": {"block_size": 32, "kv_cache_gib": 1, "max_num_seqs": 256,
                             "max_num_batched_tokens": 2048, "thread_bind": "nobind"}}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["cmd"] == "quit":
        break
    if msg["cmd"] == "serve":
        log.write(json.dumps(msg["reset"]) + "\\n"); log.flush()
        print(json.dumps({"outputs": {rid: [0] * m for rid, _, m in msg["items"]}, "seconds": 0.5,
                          "cpu_seconds": 0.25}), flush=True)
    else:
        print(json.dumps({"step_ms": 1.0, "cpu_ms": 0.75}), flush=True)
'''


def test_bench_peers_end_to_end_with_a_fake_peer(tmp_path, monkeypatch, capsys):
    """bench-peers on a fake vLLM (--vllm-python: this interpreter; the worker a stand-in): both
    engines keep their prefix cache through a run's rounds and start each run empty (the fake
    sees reset on a run's first round only), the best configurations, wall and CPU seconds, the
    CPU line, time to first token and the roofline reach the output and the JSON."""
    import sys

    import torch

    import course.peers.race as bp

    worker, log = tmp_path / "fake_worker.py", tmp_path / "resets.log"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(bp, "WORKER", worker)
    monkeypatch.setattr(bp, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("FAKE_PEER_LOG", str(log))
    import torch._dynamo.config as dynamo_config
    out_json = tmp_path / "peers.json"
    threads = torch.get_num_threads()
    try:
        with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit):  # bench-peers raises it
            assert bp.peers_main(["--preset", "test", "--dtypes", "float32", "--threads", "1", "--workloads", "chat",
                                  "--scale", "0.25", "--core-configs", "fused", "--repeat", "2", "--decode", "2",
                                  "--decode-steps", "2", "--ttft-prompt", "8", "--ttft-tries", "1",
                                  "--vllm-python", sys.executable, "--json", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    rounds = len(make_workload("chat", 512, scale=0.25).rounds)
    # warm-up (one round), then 2 timed runs of `rounds` rounds, then the time-to-first-token run
    want = [True] + ([True] + [False] * (rounds - 1)) * 2 + [True]
    assert [json.loads(x) for x in log.read_text().split()] == want
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["machine"]["cpu"] in text and report["machine"]["flags"] == report["sittings"][0]["machine"]["flags"]
    assert "empty prefix cache" in report["cache_policy"] and report["cache_policy"] in text and report["complete"]
    (row,) = report["summary"]
    assert (row["core"], row["vllm"]) == ("core/cpu+fused", "vLLM b32") or row["core"] == "core/torch+fused"
    assert row["vllm_s"] == 0.5 * rounds and row["vllm_cpu_s"] == 0.25 * rounds and row["core_cpu_s"] > 0
    assert row["agrees"] == 0.0, "the fake's tokens are all 0"
    s = report["sittings"][0]
    assert set(s["configs"]) == {row["core"], "vLLM b32"} and "flat_model='fused'" in s["configs"][row["core"]]
    assert s["ttft_s"]["vLLM b32"] == 0.5 and s["ttft_s"][row["core"]] > 0
    (point,) = s["decode"]
    assert point["requests"] == 2 and point["vLLM b32"] == 1.0 and point["roofline"]["roofline_ms"] > 0
    assert point["cpu_ms"]["vLLM b32"] == 0.75 and point["cpu_ms"][row["core"]] > 0
    assert "time to first token" in text and "core reached" in text and s["failures"] == []
    # CPU beside wall in every table: the time to first token too (vLLM's own clocks: the fake's 0.25 s)
    assert s["ttft_cpu_s"]["vLLM b32"] == 0.25 and s["ttft_cpu_s"][row["core"]] > 0
    assert "ms (CPU " in text.split("time to first token, one 8-token prompt")[1].splitlines()[0]
    # one roofline line per preset and sitting, with the first token's bound and the decode step's
    assert s["ttft_prompt"] == 8 and s["ttft_roofline"]["roofline_ms"] > 0 and s["limits"]["peak_flops"] > 0
    roof = text.split("roofline per preset")[1].splitlines()[1]
    assert roof.startswith("test float32 1t: peak GEMM") and "first token of a 8-token prompt >=" in roof
    assert "decode step at R = 2 >=" in roof, roof
    assert "OpenMP" in s["configs"][row["core"]] and "OpenMP" in s["configs"]["vLLM b32"]


def test_bench_peers_drops_a_failing_configuration_and_goes_on(tmp_path, monkeypatch, capsys):
    """A configuration that raises inside its runs (as the compiled core did on torch's recompile
    limit) is reported and dropped; the other configurations' figures are still written."""
    import sys

    import torch

    import course.peers.race as bp

    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(bp, "WORKER", worker)
    monkeypatch.setattr(bp, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "resets.log"))
    import torch._dynamo.config as dynamo_config
    real = bp.CoreRunner
    calls = {"n": 0}

    class Flaky(real):  # the second engine built fails in its runs, as a recompile limit would
        def serve(self, items):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("recompile_limit reached (simulated)")
            return super().serve(items)

    monkeypatch.setattr(bp, "CoreRunner", Flaky)
    out_json = tmp_path / "peers.json"
    threads = torch.get_num_threads()
    try:
        with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit):  # bench-peers raises it
            assert bp.peers_main(["--preset", "test", "--dtypes", "float32", "--threads", "1", "--workloads", "shared",
                                  "--scale", "0.15", "--core-configs", "fused", "--repeat", "1", "--decode", "",
                                  "--ttft-prompt", "0", "--vllm-python", sys.executable, "--json", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    s = json.loads(out_json.read_text())["sittings"][0]
    (failure,) = s["failures"]
    assert "recompile_limit" in failure["error"] and failure["where"] == "workload 'shared'"
    assert [r["engine"] for r in s["workloads"]["shared"]] == ["vLLM b32"]
    text = capsys.readouterr().out
    assert "FAILED" in text
    # no decode table and no first-token run: the sitting's roofline line still says the machine's limits
    assert s["limits"]["bandwidth"] > 0 and "the limit: peak GEMM" in text


def _sitting(dtype: str, threads: int) -> dict:
    """A bench-peers sitting's record as ``sitting`` writes it, with made-up figures."""
    limits = {"dtype": dtype, "peak_dtype": dtype, "threads": threads, "peak_flops": 1e11, "bandwidth": 1e10,
              "copy_bandwidth": 1e10, "read_bandwidth": 9e9}
    roof = lambda ms, bound: {"roofline_ms": ms, "bound": bound}  # noqa: E731
    core, peer = "core/cpu+fused", "vLLM b32"
    return {"preset": "small", "dtype": dtype, "threads": threads, "limits": limits, "startup_s": {core: 1.0},
            "failures": [], "configs": {},
            "workloads": {"random": [{"engine": core, "output_tok_s": 200.0, "seconds": 2.0, "cpu_seconds": 3.5,
                                      "agrees": None},
                                     {"engine": peer, "output_tok_s": 100.0, "seconds": 4.0, "cpu_seconds": 4.5,
                                      "agrees": 1.0}]},
            "ttft_s": {core: 0.05, peer: 0.1}, "ttft_cpu_s": {core: 0.06, peer: 0.12}, "ttft_prompt": 228,
            "ttft_roofline": roof(1.25, "compute"),
            "decode": [{"requests": 16, core: 5.0, peer: 10.0, "cpu_ms": {core: 6.0, peer: 11.0},
                        "roofline": roof(2.5, "memory")}]}


def test_bench_peers_summary_has_cpu_beside_wall_and_a_roofline_per_preset(capsys):
    """Every table of bench-peers' summary prints CPU time beside wall time (the ratio that
    survives a shared machine), and each sitting gets one roofline line."""
    from course.peers.race import print_summary

    print_summary([_sitting("float32", 1), _sitting("bfloat16", 2)])
    text = capsys.readouterr().out
    tables = [t.strip("\n") for t in text.split("\n\n") if "-----" in t]
    assert len(tables) == 3, text  # workloads, time to first token, decode step
    for table in tables:
        head = table.splitlines()[1]
        assert ("wall s" in head and "CPU s" in head) or ("ms" in head and "CPU ms" in head), head
        assert "x CPU" in head, head
    ttft = tables[1].splitlines()
    assert "x CPU" in ttft[1] and "roofline" in ttft[1]
    row = ttft[3].split()
    # float32 1t, prompt 228: core 50.0 ms (CPU 60.0), vLLM 100.0 (CPU 120.0), x 2.00, x CPU 2.00,
    # roofline 1.25 ms: reached 2.5% and 1.2%
    assert row[:3] == ["float32", "1", "228"] and row[4:6] == ["50.0", "60.0"] and row[6:10] == ["vLLM", "b32", "100.0", "120.0"]
    assert row[10:] == ["2.00", "2.00", "1.25", "2.5%", "1.2%"], row
    roof = text.split("roofline per preset")[1].splitlines()[1:3]
    assert roof[0].startswith("small float32 1t: peak GEMM 100.0 GFLOP/s") and "bfloat16 2t" in roof[1]
    assert "first token of a 228-token prompt >= 1.25 ms (compute)" in roof[0]
    assert "decode step at R = 16 >= 2.50 ms (memory)" in roof[0]
    decode = tables[2].splitlines()[3].split()
    assert decode[4:6] == ["5.00", "6.00"] and decode[8:12] == ["10.00", "11.00", "2.00", "1.83"], decode


def test_bench_dtype_option_builds_the_preset_in_that_dtype(tmp_path):
    import torch

    out_json = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        assert bench_main(["--workloads", "shared", "--scale", "0.15", "--engines", "reference,fast", "--backend",
                           "torch", "--scaling", "", "--preset", "test", "--dtype", "bfloat16",
                           "--json", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out_json.read_text())
    assert report["dtype"] == "bfloat16" and report["machine"]["cpu"]
    assert {r["engine"] for r in report["workloads"]["shared"]} == {"core/reference", "core/torch"}
    # The sitting says whether the fused engine's bfloat16 matmuls ran in float32 here (no bf16
    # units: its tokens may then differ from generate()'s) -- on this CPU, whichever it is.
    from engine.fast.fused import fast_16bit_matmul

    widened = not fast_16bit_matmul(torch.bfloat16, torch.device("cpu"))
    assert (report["numerics"] is not None) == widened, report["numerics"]
    if widened:
        assert "matmuls in float32" in report["numerics"]


# ----- two threads against one: course.tuning.threads -----------------------------------------------
def test_thread_scaling_ratios_are_taken_per_round():
    """The summary's ratios are medians of each round's side-by-side pair, not ratios of medians; the
    quiet ratio counts only rounds whose two runs both had the cores to themselves."""
    from course.tuning.threads import policy_env, summarize

    run = lambda wall, cpu: {"wall": wall, "cpu": cpu, "tokens": 100, "load": 1.0, "openmp": "x"}  # noqa: E731
    runs = {("float32", "probe", 1): [run(2.0, 2.0), run(4.0, 4.0), run(3.0, 3.0)],
            ("float32", "probe", 2): [run(1.0, 2.0), run(4.0, 8.0), run(2.0, 3.0)]}
    (row,) = summarize(runs)
    assert (row["x_wall"], row["x_cpu"]) == (1.5, 1.0)  # pairs 2.0, 1.0, 1.5 and 1.0, 0.5, 1.0
    assert (row["quiet_pairs"], row["x_wall_quiet"]) == (0, None), "no run said it was quiet"
    for r, during in zip(runs[("float32", "probe", 1)] + runs[("float32", "probe", 2)], (0.0, 0.1, 1.0, 0.1, 0.5, 0.1)):
        r["others_during"] = during
    (row,) = summarize(runs)
    assert (row["quiet_pairs"], row["x_wall_quiet"]) == (1, 2.0), "only round 0 had both runs quiet"
    assert (row["tok_s_1"], row["tok_s_2"], row["tok_cpu_s_2"]) == (33.3, 50.0, 33.3)
    assert policy_env("probe") == {} and policy_env("GOMP_SPINCOUNT=5,OMP_WAIT_POLICY=PASSIVE") == {
        "GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "PASSIVE"}
    with pytest.raises(ValueError, match="spin policy"):
        policy_env("OMP_NUM_THREADS=3")


def test_thread_scaling_runs_each_count_in_its_own_process_under_the_policy(tmp_path, capsys):
    """One round on the test preset: a run.py bench process per thread count, the spin policy in its
    environment (its machine line says so), CPU seconds beside wall, the load and the other processes'
    CPU printed."""
    from course.tuning.threads import main

    out = tmp_path / "threads.json"
    assert main(["--rounds", "1", "--dtypes", "float32", "--preset", "test", "--scale", "0.1", "--quiet-wait", "1",
                 "--spin", "GOMP_SPINCOUNT=300000", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(r["threads"] for r in report["runs"]) == [1, 2]
    assert all("GOMP_SPINCOUNT=300000 (set in the environment)" in r["openmp"] for r in report["runs"])
    assert all(r["cpu"] > 0 and r["wall"] > 0 for r in report["runs"])
    for key in ("others", "others_during"):
        assert all(r[key] is None or r[key] >= 0 for r in report["runs"]), f"the other processes' CPU ({key}), in cores"
    (row,) = report["summary"]
    assert row["x_wall"] > 0 and row["x_cpu"] > 0 and row["tok_cpu_s_1"] > 0
    text = capsys.readouterr().out
    assert "load average" in text and "x CPU" in text and "other processes" in text
