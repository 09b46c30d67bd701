"""Chapter 32's Triton paged-attention backend, checked on a CPU through Triton's interpreter.

The kernel runs on CPU tensors only under ``TRITON_INTERPRET=1``, which must be set before the
kernel module is imported. So, unless this process already runs under the interpreter (as in
``make test-triton``), the kernel checks run in a subprocess with that variable set. ``make test``
runs a few small cases (a few seconds); ``make test-triton`` (``--triton-full`` or
``TRITON_FULL=1``) runs every case of ``test_backends.CASES`` plus the engine end to end.
On a GPU, ``course/bench/gpu_check.py`` runs the compiled kernel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="Triton is an optional extra: pip install -e .[triton]")

pytestmark = pytest.mark.given  # the backend is complete code; no learner hole runs here

ROOT = Path(__file__).resolve().parent.parent
QUICK_CASES = [  # (seed, block_size, Hq, Hkv, window): GQA, a padded group (3 -> 4), a window
    (0, 16, 4, 2, 0), (3, 3, 6, 3, 5), (8, 4, 6, 2, 0),
]

# Runs under TRITON_INTERPRET=1: every case vs the reference backend; prints one JSON line.
CHECK_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_backends import random_paged_batch
from engine.serve.attention import ReferenceBackend
from engine.fast.triton_attention import TritonBackend
cases, block_ns = json.loads(sys.argv[2]), json.loads(sys.argv[3])
results = []
for seed, block_size, hq, hkv, window, dtype in cases:
    q, cache, meta = random_paged_batch(seed, block_size, hq, hkv, num_reqs=4, dtype=getattr(torch, dtype))
    want = ReferenceBackend().forward(q.float(), (cache[0].float(), cache[1].float()), meta, window=window)
    for block_n in block_ns:
        backend = TritonBackend(prefill_tile_rows=8, block_n=block_n)
        got = backend.forward(q, cache, meta, window=window).float()
        results.append({"case": [seed, block_size, hq, hkv, window, dtype], "block_n": block_n,
                        "interpreted": backend.interpreted, "err": (got - want).abs().max().item(),
                        "pad_zero": got[int(meta.query_start_loc_cpu[-3]):].abs().max().item()})
print(json.dumps(results))
"""


def _full(config) -> bool:
    try:
        flag = config.getoption("--triton-full")
    except ValueError:  # the option is registered in conftest.py; tolerate its absence
        flag = False
    return bool(flag) or os.environ.get("TRITON_FULL") == "1"


def _interpreter_env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", "ENGINE_IMPL": "solution"}


@pytest.fixture(scope="module")
def kernel_results(request):
    from test_backends import CASES

    full = _full(request.config)
    cases = sorted(set(map(tuple, CASES + QUICK_CASES))) if full else QUICK_CASES
    cases = [[*c, "float32"] for c in cases] + [[*QUICK_CASES[0], "bfloat16"]]
    block_ns = [16, 32] if full else [16]
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, str(ROOT / "tests"), json.dumps(cases),
                           json.dumps(block_ns)], cwd=ROOT, env=_interpreter_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"the interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_kernel_matches_reference(kernel_results):
    assert kernel_results, "no case ran"
    for r in kernel_results:
        assert r["interpreted"], "the kernel did not run under Triton's interpreter (TRITON_INTERPRET=1)"
        tol = 1e-5 if r["case"][-1] == "float32" else 3e-2
        assert r["err"] < tol, (f"Triton kernel differs from the reference by {r['err']:.2e} on case "
                                f"(seed, block_size, Hq, Hkv, window, dtype) = {r['case']}, block_n={r['block_n']}")
        assert r["pad_zero"] == 0.0, f"padding rows must stay zero (case {r['case']})"


def test_missing_triton_says_how_to_install(monkeypatch):
    """Without triton, building the backend names the extra to install."""
    from engine.fast.triton_attention import TritonBackend

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "engine.fast.triton_paged_kernel", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e \.\[triton\]"):
        TritonBackend()


def test_refuses_what_it_cannot_run():
    """Compiled Triton needs a GPU: CPU tensors without the interpreter, and float64, are refused."""
    import torch

    from engine.fast.triton_attention import TritonBackend

    backend = TritonBackend()
    backend.interpreted = False  # as when TRITON_INTERPRET was not set before the kernel was imported
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backend.allocate((3, 4, 2, 8), torch.float32, "cpu")
    backend.interpreted = True
    with pytest.raises(ValueError, match="float64"):
        backend.allocate((3, 4, 2, 8), torch.float64, "cpu")
    with pytest.raises(ValueError, match="block_n"):
        TritonBackend(block_n=24)


ENGINE_SCRIPT = r"""
import json, torch
from engine.models.tiny import tiny_model
from engine.serve import EngineConfig, EngineCore, SamplingParams
model = tiny_model(seed=2)
g = torch.Generator().manual_seed(4)
prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (21, 5, 40, 13)]
prompts[3] = prompts[2][:16] + prompts[3]
outs = {}
for backend in ("torch", "triton"):
    for name, extra in (("chunked", dict(max_num_batched_tokens=12)), ("preempt", dict(num_blocks=9))):
        core = EngineCore(model, EngineConfig(block_size=8, attention_backend=backend, **extra))
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
        outs[f"{backend}/{name}"] = [core.run_until_done(), core.preemptions]
print(json.dumps(outs))
"""


def test_engine_on_triton_backend(request):
    """The whole engine on the Triton backend gives the torch backend's greedy tokens (full run only)."""
    if not _full(request.config):
        pytest.skip("end-to-end Triton run is part of `make test-triton` (--triton-full / TRITON_FULL=1)")
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], cwd=ROOT, env=_interpreter_env(),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("chunked", "preempt"):
        assert outs[f"triton/{name}"][0] == outs[f"torch/{name}"][0], f"{name}: triton and torch backends disagree"
    assert outs["triton/preempt"][1] > 0, "the small pool was meant to force a preemption"
