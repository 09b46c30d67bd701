"""The stretch-exercise scripts (experiments/ch31.py) on reduced workloads.

These check the instructors' reference solutions, so they run against the reference engine
(``given``: none of your holes are patched in). Each asserts the property its exercise is about.
"""
from __future__ import annotations

from pathload import load_by_path

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent




pytestmark = pytest.mark.given


def experiments():
    """experiments/ch31.py as a module (imported inside tests: conftest must set --impl first)."""
    return load_by_path("_ch31_experiments", "experiments/ch31.py")


def small_model():
    from engine.models import tiny_model

    return tiny_model(seed=0)


def test_cache_stats_multi_turn_chat_reuses_history_when_the_pool_allows():
    ex = experiments()
    smallest = -(-ex.chat_longest(*ex.chat(3, 3)) // 16)  # blocks the longest request needs
    result = ex.cache_stats(pool_sizes=(smallest, 48), num_convs=3, turns=3, model=small_model(), quiet=True)
    small, large = result["summary"]
    assert small["same_answers"] and large["same_answers"], "the pool size must not change greedy answers"
    assert large["hit_rate"] > small["hit_rate"], "a bigger pool keeps more chat history cached"
    assert large["evicted"] == 0 and small["evicted"] > 0
    steps = result["per_step"][48]
    assert all(s["cached"] <= s["admitted"] for s in steps)
    # Later turns find the earlier turns' prompt AND answer in the cache (published after each step).
    system_share = 64 / min(s["admitted"] for s in steps if s["admitted"])
    assert large["hit_rate"] > system_share


def test_recompute_vs_swap_same_tokens_different_work():
    ex = experiments()
    rows = {r["config"]: r for r in ex.recompute_vs_swap(
        num_requests=4, num_blocks=8, output_len=(30, 40), repeats=1, model=small_model(), quiet=True)["rows"]}
    assert all(r["same_tokens"] for r in rows.values()), "preemption mode must not change greedy outputs"
    assert all(r["preemptions"] > 0 for r in rows.values()), "the small pool must force preemption"
    for caching in ("on", "off"):
        recompute, swap = rows[f"recompute, caching {caching}"], rows[f"swap, caching {caching}"]
        assert recompute["recomputed_tokens"] > 0 and recompute["blocks_swapped"] == 0
        assert swap["recomputed_tokens"] == 0 and swap["blocks_swapped"] > 0
    assert rows["recompute, caching on"]["recomputed_tokens"] <= rows["recompute, caching off"]["recomputed_tokens"], \
        "with prefix caching a resumed request finds some of its own blocks"


def test_cache_aware_admission_raises_hit_rate_and_risks_starvation():
    ex = experiments()
    rows = ex.cache_aware(model=small_model(), quiet=True)["rows"]
    fcfs, lpm, aged = rows
    assert lpm["hit_rate"] >= fcfs["hit_rate"], "longest-prefix-first must not lose hits"
    assert lpm["max_wait"] > fcfs["max_wait"], "cold requests wait longer under longest-prefix-first"
    assert aged["max_wait"] <= lpm["max_wait"], "aging bounds the wait"


def test_radix_tree_matches_flat_without_eviction_and_beats_it_with_partial_matches():
    ex = experiments()
    work = ex.tree_workload(apps=2, templates=2, users=2, turns=2, seed=1)
    rows = ex.radix(pool_sizes=(64, 96, 512), concurrency=2, work=work, quiet=True)["rows"]
    for row in rows:
        assert row["radix"] >= row["flat"], f"pool {row['pool_blocks']}: radix hit rate below the flat map's"
        assert row["radix"] >= row["radix_whole_blocks"]
    roomy = rows[-1]
    assert roomy["evicted_radix"] == 0
    assert roomy["radix_whole_blocks"] == roomy["flat"], \
        "with no eviction, whole-block radix matching finds exactly what the hash chain finds"
    assert roomy["partial_tokens"] > 0 and roomy["radix"] > roomy["flat"]


def test_radix_no_eviction_pool_is_the_smallest_that_keeps_everything():
    ex = experiments()
    work = ex.tree_workload(apps=2, templates=2, users=2, turns=2, seed=1)
    result = ex.radix(pool_sizes=(512,), concurrency=2, work=work, quiet=True)
    n = result["no_eviction_from"]
    for size, evicts in ((n - 1, True), (n, False)):
        flat, tree = ex.FlatBlockCache(size, 16), ex.RadixBlockCache(size, 16, partial=False)
        ex.simulate(flat, work, 2)
        ex.simulate(tree, work, 2)
        assert (flat.bm.num_evicted + tree.num_evicted > 0) == evicts, f"pool {size}"
        if not evicts:
            assert flat.hit_rate == tree.hit_rate, "with nothing evicted the tree finds what the chain finds"


def test_free_order_head_first_loses_hits_only_under_pressure():
    ex = experiments()
    work = ex.skewed_prompt_workload(num_requests=30, seed=0)
    rows = ex.free_order(extra_blocks=(0, 12, 400), work=work, quiet=True)["rows"]
    tight, _, roomy = rows
    assert tight["tail_first"] > tight["head_first"], "head-first freeing evicts the shared system prompts first"
    assert all(r["tail_first"] >= r["head_first"] for r in rows)
    assert roomy["tail_first"] == roomy["head_first"] and roomy["evicted_tail_first"] == 0, \
        "with room for everything the order of freeing cannot matter"


def test_head_first_manager_reverses_only_the_order():
    ex = experiments()
    from engine.serve import Request, SamplingParams

    bm = ex.HeadFirstBlockManager(6, 4)
    r = Request("x", list(range(10)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(r, 10)
    table = list(bm.req_blocks["x"])
    bm.free(r)
    assert list(bm.free_queue)[-3:] == table, "head first: the request's first block joins the queue first"
    assert bm.num_free == 6 and "x" not in bm.req_blocks


def test_command_line_writes_a_plot(tmp_path, capsys):
    ex = experiments()
    plot = tmp_path / "radix.png"
    assert ex.main(["radix", "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0
    assert "radix" in capsys.readouterr().out
