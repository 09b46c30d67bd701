"""Training the shipped tiny real model, ``models/qwen3-kjv-tiny`` (``make train-tiny``).

Who runs it: maintainers, when the model or its tokenizer changes.
"""
