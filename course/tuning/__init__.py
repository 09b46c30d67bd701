"""Tuning the fast path: one A/B per optimisation (``levers.py``: the paged-attention kernel, the prefill
paths, the small-batch linears, the elementwise kernels, greedy argmax, a step's parts) and one thread
against two (``threads.py``), each interleaved in one sitting with the machine line beside its figures.

Who runs it: whoever changes a kernel or a probe in ``engine/fast/`` and needs to know whether it pays;
the engines' end-to-end figures are ``course/bench``'s, and ``docs/performance.md`` names each command.
"""
