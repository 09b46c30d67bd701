"""Chat templates: Jinja from a downloaded checkpoint, rendered in a sandbox with bounds on work and size.

A chat template is code that arrives with a checkpoint (or from a caller, ``LLM.chat(chat_template=...)``)
and runs on every ``chat()``. It is compiled the way HF compiles them (Jinja's immutable sandbox,
trimmed block whitespace, ``break``/``continue``, ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII), and on top of the sandbox, which stops a template from reaching
Python's internals but not from running forever or building a string of a terabyte, one render is
bounded:

* work: at most ``MAX_TEMPLATE_STEPS`` lines of the template's compiled code (counted by a trace
  function on the rendering thread, on the template's own frames only), so nested loops end; and
  at most ``MAX_TEMPLATE_CPU_S`` seconds of the rendering thread's CPU time (read every
  ``CPU_CHECK_EVERY`` lines), so lines that each do a lot of bounded work (a replace() over
  millions of characters, a thousand times) are refused early too, not after ~10 s;
* size: no string or list the template builds (``*``, ``+``, ``~``, ``%``, ``**`` on ints, the
  filters and string methods that take a width or a count) and no rendered text may exceed
  ``MAX_TEMPLATE_CHARS``; refused before the allocation where the size is known in advance.

Whatever goes wrong inside a render (those limits, ``raise_exception``, an undefined name, a type
error, recursion, memory) comes out as one ``ValueError`` naming the template.

Message content may be a string or OpenAI-style content parts (``[{"type": "text", "text": "hi"}]``),
which become their texts joined by newlines (as vLLM's "string" content format does); other
part types (images, audio) are refused, as they are chapter 43's.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from typing import Any

MAX_TEMPLATE_CHARS = 8_000_000  # the largest string (or list) a template may build, and the longest text it may render
MAX_TEMPLATE_STEPS = 5_000_000  # lines of template code one render may run (a real conversation needs thousands)
MAX_TEMPLATE_CPU_S = 1.0  # CPU seconds one render may take (a real conversation needs milliseconds)
CPU_CHECK_EVERY = 16  # lines of template code between two reads of the thread's CPU clock
MAX_POWER_BITS = 1 << 16  # ``a ** b`` on ints: refused past this many bits of result
_WIDE_FORMAT = re.compile(r"\d{7,}|\*")  # a %-format or format-spec width of millions, or one taken from the arguments


class TemplateLimit(Exception):
    """A chat template went past one of this module's bounds."""


def _sized(value: Any) -> Any:
    """``value``, unless it is a string or sequence longer than ``MAX_TEMPLATE_CHARS``."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"it built a {type(value).__name__} of {len(value):,} items "
                            f"(limit {MAX_TEMPLATE_CHARS:,})")
    return value


def _check_numbers(args: tuple, kwargs: dict) -> None:
    """A width, count or repeat argument in the millions and up is refused before the call."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a) > MAX_TEMPLATE_CHARS:
            raise TemplateLimit(f"it passed {a!r} to a filter or method (limit {MAX_TEMPLATE_CHARS:,})")


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int) and len(seq) * max(times, 0) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"it repeats a {type(seq).__name__} of {len(seq):,} items {times:,} times "
                            f"(limit {MAX_TEMPLATE_CHARS:,})")


def _check_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = s.count(old) if old else len(s) + 1
        if len(s) + count * max(0, len(new) - len(old)) > MAX_TEMPLATE_CHARS:
            raise TemplateLimit(f"a replace() would build {len(s) + count * (len(new) - len(old)):,} characters")


def _check_join(sep: Any, items: Any) -> None:
    if isinstance(sep, str) and hasattr(items, "__len__") and len(sep) * len(items) > MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"a join() would build {len(sep) * len(items):,} characters of separators")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and ("%" in fmt or "{" in fmt) and _WIDE_FORMAT.search(fmt):
        raise TemplateLimit("a format string asks for a width of millions (or one taken from its arguments)")


def _bounded_filter(name: str, fn):
    """A Jinja filter with its arguments and result bounded (``replace`` and ``join`` by what they build)."""
    @functools.wraps(fn)  # keeps jinja_pass_arg: the filter still gets its context / environment first
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_numbers(args, kwargs)
        values = [a for a in args if not _is_jinja_internal(a)]
        if name == "replace" and len(values) >= 3:
            _check_replace(*values[:3])
        elif name == "join" and values:
            _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), values[0])
        elif name == "format" and values:
            _check_format(values[0])
        return _sized(fn(*args, **kwargs))
    return bounded


@functools.cache
def _jinja_internals() -> tuple[type, ...]:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return EvalContext, Context, Environment


def _is_jinja_internal(a: Any) -> bool:
    """The context / environment Jinja passes a filter first (``pass_context`` and friends)."""
    return isinstance(a, _jinja_internals())


def compile_template(source: str):
    """``source`` compiled in the bounded sandbox; ValueError if it is not valid Jinja."""
    try:
        import jinja2
        from jinja2.compiler import CodeGenerator
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ValueError("chat templates need jinja2: pip install jinja2") from e
    if not isinstance(source, str):
        raise ValueError(f"a chat template must be a string, got {type(source).__name__}")

    class _Generator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # ``a ~ b``: sized before it is joined
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class _Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                _check_repeat(left, right)
                _check_repeat(right, left)
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * left.bit_length() > MAX_POWER_BITS:
                    raise TemplateLimit(f"{left} ** {right} has more than {MAX_POWER_BITS:,} bits")
            elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
                if isinstance(left, (str, list, tuple)) and len(left) + len(right) > MAX_TEMPLATE_CHARS:
                    raise TemplateLimit(f"it built a {type(left).__name__} of {len(left) + len(right):,} items")
            elif operator == "%":
                _check_format(left)
            return _sized(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's spelling)
            _check_numbers(args, kwargs)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
            if isinstance(owner, str):
                if name == "replace" and len(args) >= 2:
                    _check_replace(owner, args[0], args[1])
                elif name == "join" and args:
                    items = list(args[0]) if not hasattr(args[0], "__len__") else args[0]
                    _check_join(owner, items)
                    args = (items, *args[1:])
                elif name in ("format", "format_map"):
                    _check_format(owner)
            return _sized(super().call(__context, __obj, *args, **kwargs))

        @staticmethod
        def bounded_concat(parts: tuple) -> str:
            texts = [str(p) for p in parts]
            if sum(len(t) for t in texts) > MAX_TEMPLATE_CHARS:
                raise TemplateLimit(f"a '~' would build {sum(len(t) for t in texts):,} characters")
            return "".join(texts)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)  # lorem ipsum of any length: no template needs it
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except RecursionError:
        raise ValueError("the chat template nests too deeply to compile") from None


def render(compiled, **context: Any) -> str:
    """The text of ``compiled`` (from ``compile_template``) on ``context``, within the bounds; any
    failure of the template is a ValueError."""
    steps = 0
    limit, cpu_limit, every = MAX_TEMPLATE_STEPS, MAX_TEMPLATE_CPU_S, CPU_CHECK_EVERY
    cpu_end = time.thread_time() + cpu_limit

    def count_lines(frame, event: str, arg: Any):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > limit:
                raise TemplateLimit(f"it ran more than {limit:,} lines of template code")
            if steps % every == 0 and time.thread_time() > cpu_end:
                raise TemplateLimit(f"it took more than {cpu_limit:g} s of CPU time")
        return count_lines

    def on_call(frame, event: str, arg: Any):  # trace the template's own frames only
        return count_lines if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    pieces: list[str] = []
    size = 0
    try:
        for piece in compiled.generate(**context):
            size += len(piece)
            if size > MAX_TEMPLATE_CHARS:
                raise TemplateLimit(f"it rendered more than {MAX_TEMPLATE_CHARS:,} characters")
            pieces.append(piece)
    except TemplateLimit as e:
        raise ValueError(f"the chat template was stopped: {e}") from None
    except MemoryError:
        raise ValueError("the chat template was stopped: it ran out of memory") from None
    except RecursionError:
        raise ValueError("the chat template was stopped: it recursed too deeply") from None
    except ValueError as e:
        raise ValueError(f"the chat template failed: {e}") from None
    except Exception as e:  # raise_exception, an undefined name, a type error ... in the template's code
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with OpenAI-style content parts turned into their text (joined by newlines);
    ValueError for content that is neither a string, None nor a list of text parts. The caller's
    dicts are left as they are."""
    result = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if content is None or isinstance(content, str):
            result.append(m)
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(f"message {i}: content must be a string or a list of "
                             f"{{'type': 'text', 'text': ...}} parts, got {type(content).__name__}")
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(kind, str) and kind != "text":
                raise ValueError(f"message {i}, part {j}: content of type {kind!r} is not supported "
                                 "(images and audio are chapter 43); send text parts")
            else:
                raise ValueError(f"message {i}, part {j}: expected {{'type': 'text', 'text': str}}, got {part!r:.80}")
        result.append({**m, "content": "\n".join(texts)})
    return result
