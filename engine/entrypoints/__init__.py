"""The front end's network entry points: ``openai_server`` (``run.py serve``), on one ``LLM``'s core.

``engine_loop`` owns the engine in one thread, ``protocol`` turns OpenAI request bodies into
prompts and ``SamplingParams``, ``metrics`` writes the Prometheus text, ``cli`` parses ``run.py serve``.
"""
