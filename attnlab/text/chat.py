"""A model's chat template (Jinja, as transformers and llama.cpp store it) applied to messages.

The template comes from the model file, so it is rendered in jinja2's immutable
sandbox (no attribute access to Python internals, no mutation of the messages), with the
settings and helpers transformers gives it (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``raise_exception``, ``strftime_now``), so the same template gives the same text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["render_chat", "as_messages"]


def as_messages(chat: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """``[{"role": "user", "content": chat}]`` for one user turn given as text; a list of
    ``{"role", "content"}`` dicts is checked and copied."""
    if isinstance(chat, str):
        return [{"role": "user", "content": chat}]
    if not isinstance(chat, Sequence) or not chat:
        raise TypeError(f"chat: expected a str or a non-empty list of {{'role', 'content'}} "
                        f"dicts, got {type(chat).__name__}")
    out = []
    for i, m in enumerate(chat):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise TypeError(f"chat[{i}]: expected a dict with str 'role' and 'content', "
                            f"got {m!r}")
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *,
                add_generation_prompt: bool = True, **special_tokens: str | None) -> str:
    """The text ``template`` makes of ``messages`` (``[{"role", "content"}, ...]``), ending
    with the assistant's turn opened when ``add_generation_prompt``. ``special_tokens``
    (``bos_token="<s>"``, ``eos_token=...``) are passed to the template as transformers
    does. A template that fails is one ValueError naming the reason."""
    from jinja2 import TemplateError

    try:
        return _compile(template).render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **special_tokens)
    except TemplateError as exc:
        raise ValueError(f"the chat template cannot be applied: {exc}") from None
