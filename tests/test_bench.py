"""``run.py bench`` end to end on tiny workloads: every engine serves the same greedy tokens.

The numbers themselves are not checked (they depend on the machine); what is checked is that the
workloads are what they claim, that every engine answers every request with the same tokens,
and that ``--json`` and ``--plot`` write their files.
"""
from __future__ import annotations

import json

import pytest

from course.bench import bench_main, longest_request, make_workload
from course.workloads import ChatTurn, chat_workload, random_workload

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
    assert "x fastest peer" in capsys.readouterr().out
    assert report["model"]["layers"] == 2 and report["model"]["hidden"] == 128, "--preset test is the tests' model"


def test_scaling_point_keeps_every_request_running():
    """The scaling table must measure R requests decoding together, whatever the model's size:
    the point sizes its own pool, so a bigger model cannot turn R = 256 into a preempting run."""
    from course.bench import MODEL_PRESETS, scaling_point
    from engine.models import tiny_model

    # Wide K/V per token (16 kv heads of 64), as a bigger model has: the memory-sized default pool
    # (128 MiB) would hold far fewer than 300 requests' tokens.
    model = tiny_model(seed=0, num_attention_heads=16, num_key_value_heads=16, head_dim=64)
    point = scaling_point(model, "torch", 300, steps=1, prompt_len=64)
    assert point["requests"] == 300 and point["step_ms"] > 0
    assert set(MODEL_PRESETS) == {"test", "small", "qwen3-0.6b"} and MODEL_PRESETS["test"] == {}


def test_peer_runner_time_and_agreement(capsys):
    """A peer engine (another process) reports its own serve time, which the bench uses; the
    agreement column falls back to the fast core when core/reference does not run."""
    from course.bench import compare_engines, make_workload
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
    import course.bench_peers as bp

    monkeypatch.setattr(bp, "PEERS_VENV", tmp_path / "missing")
    assert bp.peers_main(["--dtypes", "float32", "--threads", "1"]) == 2
    assert "make bench-peers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bp.peers_main(["--vllm-block-sizes", "16"])


def test_core_rounds_interleave_every_variant_between_chapter_24_runs(capsys):
    """``run.py core --rounds``: each core variant runs between two chapter-24 runs of the same
    round, every run gives chapter 24's tokens (or the command fails), and a ratio is printed for
    each of the four ingredients, by wall clock and by CPU time."""
    from course.bench_core import RATIO_VARIANTS, core_main, ratio_rounds
    from engine.models import tiny_model
    from course.workloads import shared_prefix_workload

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
    from course.bench_core import compare_with_reference

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
