"""Building an EngineCore reads straight through: following ``EngineCore.__init__``'s configuration
through the calls, the construction goes back into a module it already left at most
``course.quality.rooms.MAX_RETURNS`` times (the pool is sized once, then the runner holds it and the
block manager keeps its books)."""
from __future__ import annotations

import contextlib
import io

from course.quality import rooms
from engine.models import tiny_model
from engine.serve import CacheConfig, ModelRunner, get_backend
from engine.serve.flat import FlatModel


def test_building_the_engine_core_returns_to_few_rooms():
    trace = rooms.trace_engine_core()
    assert "engine.serve.runner" in trace.rooms and "engine.serve.processor" in trace.rooms, trace.report()
    assert trace.returns <= rooms.MAX_RETURNS, (
        f"EngineCore(model, EngineConfig()) goes back into a module it left {trace.returns} times "
        f"(at most {rooms.MAX_RETURNS}): size the pool once, then build what holds it\n{trace.report()}")


def test_the_count_sees_a_runner_built_sized_and_allocated_in_three_visits():
    """The old way (a runner without blocks, asked for its size, then allocated: three visits to
    runner.py from the caller) counts two returns to the runner; the one-call way counts none."""
    flat, backend, cache = FlatModel(tiny_model()), get_backend("reference"), CacheConfig(block_size=4)

    def three_visits() -> None:
        runner = ModelRunner(flat, backend, None, cache.block_size)
        runner.initialize_kv_cache(runner.determine_num_blocks(cache, max_num_tokens=16))

    with contextlib.redirect_stderr(io.StringIO()):
        old = rooms.trace_rooms(three_visits, start="tests")
        new = rooms.trace_rooms(lambda: ModelRunner.with_pool(flat, backend, cache, 16), start="tests")
    back_to_runner = [func for room, func, kind in old.entries if room == "engine.serve.runner" and kind == rooms.RETURN]
    assert back_to_runner == ["ModelRunner.determine_num_blocks", "ModelRunner.initialize_kv_cache"], old.report()
    assert [k for room, _, k in new.entries if room == "engine.serve.runner"] == [rooms.ENTER], new.report()
    assert new.returns < old.returns, (old.report(), new.report())
