"""Which registered configuration serves a model fastest on this machine: the default of ``LLM``
and of ``run.py bench``'s fast core (``EngineConfig``'s own defaults stay the plain, readable ones).
"""
from __future__ import annotations

from importlib.util import find_spec

import torch

FASTEST_FLAT_MODEL = "fused"  # on every device; see fastest_options


def fastest_options(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """The ``attention_backend`` and ``flat_model`` that serve a model of ``dtype`` on ``device``
    fastest here: always ``flat_model="fused"``, and "triton" on a CUDA device with Triton
    installed; "cpu" on a CPU whose C++ compiler builds its kernel, for the dtypes it reads
    (float32, bfloat16, float64); else "torch".

    Measured, not assumed (``docs/performance.md``): the compiled layer graph ("compiled") was
    slower than the fused eager path on every CPU measured, once the fused elementwise kernels
    existed, and it costs a compile at start-up, so it is opt-in.
    """
    device = torch.device(device)
    if device.type == "cuda":
        backend = "triton" if find_spec("triton") is not None else "torch"
    else:
        backend = "torch"
        if device.type == "cpu":
            from engine.fast import cpu_attention

            try:
                if dtype in cpu_attention.DTYPES:
                    cpu_attention.load_kernel()
                    backend = "cpu"
            except ValueError:  # no C++ compiler, or a failed build: the PyTorch backend needs none
                pass
    return {"attention_backend": backend, "flat_model": FASTEST_FLAT_MODEL}
