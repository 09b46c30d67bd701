"""Load a repository file as a module by its path (course/ and experiments/ are not packages the
tests import by name, and tests/ may run without the repository root on sys.path)."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_by_path(name: str, relpath: str) -> types.ModuleType:
    """Import ROOT/relpath once under the module name ``name`` and return it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def ascii_tokenizer(folder: Path, chat_template: str):
    """scripts/tiny_hf_checkpoint.py's byte-level BPE over printable ASCII (every id decodes to
    ASCII text), 160 ids, written to ``folder``, with ``chat_template`` set."""
    from engine.tokenizer import Tokenizer

    load_by_path("tiny_hf_checkpoint", "scripts/tiny_hf_checkpoint.py").write_tokenizer(folder, vocab_size=160)
    tok = Tokenizer.from_pretrained(folder)
    tok.chat_template = chat_template
    return tok
