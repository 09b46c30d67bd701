"""The one rule for which code runs: outside the tests, ``ENGINE_IMPL`` unset runs the reference
(where ``solutions/`` is present) and says so once; ``ENGINE_IMPL=engine`` runs the learner's holes."""
from __future__ import annotations

import os
import subprocess
import sys

from engine import _impl

SCRIPT = ("from engine.serve import EngineCore, SamplingParams\n"
          "from engine.models.tiny import tiny_model\n"
          "core = EngineCore(tiny_model(seed=0))\n"
          "core.add_request('a', [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))\n"
          "print(len(core.run_until_done()['a']))\n")


def _run(env_impl: str | None, script: str = SCRIPT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != _impl.ENV_VAR}
    if env_impl is not None:
        env[_impl.ENV_VAR] = env_impl
    return subprocess.run([sys.executable, "-c", script], cwd=_impl.ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_plain_script_runs_the_reference_and_says_so_once():
    assert _impl.default_impl() == "solution" and _impl.TEST_DEFAULT == "engine"
    done = _run(None)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr[-2000:]
    assert done.stderr.count("ENGINE_IMPL is not set") == 1 and "ENGINE_IMPL=engine" in done.stderr


def test_engine_impl_engine_runs_the_learners_holes_silently():
    done = _run("engine", "import engine.serve\nfrom engine import _impl\nprint(_impl.current_impl())\n")
    assert done.returncode == 0 and done.stdout.strip() == "engine", done.stderr[-2000:]
    assert "ENGINE_IMPL is not set" not in done.stderr
