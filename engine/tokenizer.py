"""Text in and out: a thin wrapper over the ``tokenizers`` library, chat templates, streaming.

``Tokenizer.from_pretrained(dir)`` reads an HF checkpoint's tokenizer files:

* ``tokenizer.json`` — the tokenizer itself (vocabulary, merges, normaliser, pre-tokeniser,
  decoder and the special tokens it adds);
* ``tokenizer_config.json`` — the special tokens by role (``eos_token`` ...) and usually the
  Jinja ``chat_template`` (newer saves put it in ``chat_template.jinja`` instead);
* ``generation_config.json`` (optional) — ``eos_token_id``, often a list: chat models end a turn
  with one token (``<|im_end|>``) and a document with another (``<|endoftext|>``).

``IncrementalDetokenizer`` turns a stream of token ids into a stream of text pieces. With a
byte-level vocabulary one character may span several tokens (an emoji is 4 bytes and can be 4
tokens), and decoding a prefix that ends inside a character yields U+FFFD, the replacement
character. The detokenizer therefore decodes a short window of recent tokens and holds its
output back while that window's text ends in U+FFFD.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from engine.chat_template import compile_template, render, text_messages
from engine.models.hf_config import read_json_object

REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence produces
# How many prompt tokens the detokenizer decodes as left context for the first output token, so
# that a leading space or a merge with the prompt's last word comes out right.
PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character is at most 3 bytes, so it lies in the last 3 tokens: once more tokens
# than this wait behind a U+FFFD, everything before the last 3 whose text is final is emitted.
HELD_TOKENS = 3

Message = dict[str, Any]  # {"role": "user", "content": "..."}


class Tokenizer:
    """Encode/decode plus the special tokens and chat template of one checkpoint.

    Invariant: ``eos_token_id`` (when not None) is the first entry of ``eos_token_ids``, and
    every id in ``eos_token_ids`` is a token of this vocabulary.
    """

    def __init__(
        self,
        backend: _Backend,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token, pad_token
        self.chat_template = chat_template
        self.eos_token_id = self._known_id(eos_token, "eos_token")
        self.bos_token_id = self._known_id(bos_token, "bos_token")
        self.pad_token_id = self._known_id(pad_token, "pad_token")
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        for t in extra_eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"eos token id {t} is outside the vocabulary (size {self.vocab_size})")
            if t not in ids:
                ids.append(t)
        if self.eos_token_id is None and ids:  # only generation_config.json named an EOS
            self.eos_token_id = ids[0]
        self.eos_token_ids: list[int] = ids
        self._compiled_template = None
        self._special_ids: frozenset[int] | None = None  # special_token_ids, read on first use

    def _known_id(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary; fix "
                             "tokenizer_config.json")
        return tid

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read ``tokenizer.json`` (required), ``tokenizer_config.json``, ``chat_template.jinja``
        and ``generation_config.json`` (all optional) from a checkpoint directory."""
        root = Path(path).expanduser()
        if not root.is_dir():
            raise ValueError(f"tokenizer directory {str(root)!r} does not exist")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            found = sorted(p.name for p in root.glob("*token*"))
            raise ValueError(
                f"{root}: no tokenizer.json (found {found or 'no tokenizer files'}). This engine "
                "reads only the fast-tokenizer format; save one with transformers' "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises a plain Exception for a bad file
            raise ValueError(f"{tok_file}: not a readable tokenizer.json ({str(e)[:200]})") from None
        cfg_file = root / "tokenizer_config.json"
        config = _read_json(cfg_file)
        template = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            try:
                template = (root / "chat_template.jinja").read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{root / 'chat_template.jinja'}: not UTF-8 text ({e})") from None
        elif template is None and (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            if not all(isinstance(t, dict) for t in template):
                raise ValueError(f"{cfg_file}: chat_template must be a string or a list of "
                                 "{\"name\", \"template\"} objects")
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{cfg_file}: chat_template must be a string, got {type(template).__name__}")
        gen_file = root / "generation_config.json"
        gen_eos = _read_json(gen_file).get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) and not isinstance(gen_eos, bool) else gen_eos
        if gen_eos is None:
            gen_eos = []
        if not isinstance(gen_eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in gen_eos):
            raise ValueError(f"{gen_file}: eos_token_id must be a token id or a list of them, got {gen_eos!r}")
        return cls(backend, eos_token=_token_text(config.get("eos_token"), "eos_token", str(cfg_file)),
                   bos_token=_token_text(config.get("bos_token"), "bos_token", str(cfg_file)),
                   pad_token=_token_text(config.get("pad_token"), "pad_token", str(cfg_file)),
                   chat_template=template, extra_eos_token_ids=gen_eos)

    # ------------------------------------------------------------------ ids and text

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids. ``add_special_tokens`` lets the tokenizer add what its post-processor
        adds (a BOS for Llama-style tokenizers; nothing for Qwen's)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        check_text(text, "the text to encode")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text; special tokens (EOS, chat markers) are dropped by default."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The ids ``decode(skip_special_tokens=True)`` drops: the added tokens marked special."""
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the checkpoint's Jinja chat template (or ``chat_template``).

        ``add_generation_prompt`` appends the opening of an assistant turn, so the model answers
        rather than continues the user's message; ``continue_final_message`` instead cuts the
        text right after the last message's content, so the model carries that message on (HF's
        meaning; the two exclude each other). Extra keyword arguments reach the template (Qwen3
        reads ``enable_thinking``; ``tools`` lists tool schemas) and, as in HF, override the
        special tokens the template sees (``bos_token``, ``eos_token``, ``pad_token``). Returns
        the text, or its token ids with ``tokenize=True`` (special tokens come from the text,
        none are added).
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt=True opens a new assistant turn and continue_final_message=True "
                             "keeps the last message open: choose one (set add_generation_prompt=False)")
        if chat_template is None and self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); use a chat/instruct checkpoint, set "
                "tokenizer.chat_template to a Jinja template, or pass plain prompts to generate()")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        messages = text_messages(messages)  # OpenAI-style content parts -> their text
        if chat_template is not None:  # a one-off template (LLM.chat(chat_template=...))
            compiled = compile_template(chat_template)
        else:
            if self._compiled_template is None:
                self._compiled_template = compile_template(self.chat_template)
            compiled = self._compiled_template
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token or "", **template_kwargs}
        clash = sorted({"messages", "add_generation_prompt"} & set(context))
        if clash:
            raise ValueError(f"chat template keyword(s) {clash} are set by apply_chat_template itself; rename them")
        text = render(compiled, messages=messages, add_generation_prompt=add_generation_prompt, **context)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1] if messages else None)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` ({} if there is no such file); ValueError naming the file if it
    is not UTF-8 JSON holding an object."""
    return read_json_object(path) if path.is_file() else {}


def _token_text(value: Any, key: str = "special token", source: str = "tokenizer_config.json") -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{source}: {key} must be a string or {{\"content\": string}}, got {value!r}")
    return value


def _cut_after_final_message(text: str, final: Message) -> str:
    """The rendered text up to the end of the last message's content (what follows is the
    template's end-of-turn, which would make the model start a new turn)."""
    content = final.get("content") if isinstance(final, dict) else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with non-empty text content")
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at != -1:
            return text[:at + len(piece)]
    raise ValueError("continue_final_message: the chat template does not reproduce the last message's "
                     "content verbatim, so there is no place to cut")


def check_text(text: str, what: str) -> None:
    """ValueError for a str that is not valid Unicode: a lone surrogate, which is how Python
    carries bytes that were not UTF-8 (``errors="surrogateescape"``, e.g. from ``sys.argv``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: {e.reason} at index {e.start} "
                         f"({text[e.start:e.end]!r}); decode the bytes as UTF-8 first") from None


class IncrementalDetokenizer:
    """Turns output tokens, as they arrive, into text pieces that concatenate to the full text.

    It keeps every token and two offsets into that list: text of ``tokens[prefix:read]`` has
    already been emitted; ``tokens[read:]`` has not. Each ``add`` decodes the window
    ``tokens[prefix:]`` and emits what it adds beyond ``tokens[prefix:read]`` — unless the
    window's text ends in U+FFFD (a character whose bytes have not all arrived), in which case
    nothing is emitted and the tokens wait for the rest of their character. Decoding a window
    rather than everything keeps each step's cost constant; starting the window one emitted
    piece back keeps decoders that treat the first token specially (a leading space) right.

    Work per token is bounded (so a stream is linear in its length), also for tokens that add no
    text: special tokens that decoding skips are not kept at all (decode would drop them), and
    when more than ``HELD_TOKENS`` tokens wait behind a trailing U+FFFD (lone UTF-8 lead bytes, say),
    the text of all but the last ``HELD_TOKENS`` is emitted if it is final (a prefix of the whole
    window's text: later bytes can only complete the last, incomplete character).

    Invariant: ``text`` == decode(output tokens so far, minus the held-back tail), and after
    ``flush()`` == decode(all output tokens).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.tokens: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """Take new token ids; return the text they complete ("" while a character is split)."""
        before = len(self.tokens)
        self.tokens.extend(t for t in token_ids if t not in self._skipped)
        if len(self.tokens) == before:
            return ""
        done = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset:])
        end = len(self.tokens)
        if window.endswith(REPLACEMENT_CHAR) and end - self.read_offset > HELD_TOKENS:
            end -= HELD_TOKENS  # the held tokens' text so far, if final
            head = self._decode(self.tokens[self.prefix_offset:end])
            if not window.startswith(head):
                return ""
            window = head
        if len(window) <= len(done) or (end == len(self.tokens) and window.endswith(REPLACEMENT_CHAR)):
            return ""
        piece = window[len(done):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, even an incomplete character."""
        done = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset:])
        piece = window[len(done):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += piece
        return piece
