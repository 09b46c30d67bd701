"""The race with vLLM-CPU: ``run.py bench-peers`` (``race``) drives the core and a vLLM worker
(``vllm_worker``, run with ``.venv-peers``' Python) on the same model and workloads in one sitting.

Who runs it: anyone claiming a speed against vLLM (``make bench-peers``); figures in ``docs/performance.md``.
"""
