"""Render a model's Jinja chat template without importing transformers.

The API must stay free of torch and transformers (fast start, small image), yet
it renders the conversation to count prompt tokens and reject over-long input
before enqueueing. This module sets up Jinja the way
``transformers.utils.chat_template_utils`` does (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, the ``tojson`` filter that does not escape
HTML, ``raise_exception``, ``strftime_now``, ``namespace``, a ``{% generation %}``
block), as Hugging Face's text-generation-inference router does with minijinja.
``tests/unit/test_chat_template.py`` checks the output equals
``apply_chat_template`` for the templates resq ships.

Deliberate divergence: only JSON-shaped data reaches the template (resq's
messages are JSON already), so transformers' placeholder handling of rich
objects is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers uses the block to mark assistant tokens for training masks; for
    inference it is a no-op, but templates that use it must still parse.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension declares it a plain set

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders in, with its checks done once per type and name, not per access.

    Two thirds of rendering an agent's long history went to the sandbox's attribute lookup: each
    ``message.role`` tried the attribute first, and a dict has none by that name (an
    ``AttributeError`` raised and caught every time) before the key was read; each
    ``content.strip()``, ``loop.last`` or ``ns.value`` asked again whether that name is safe on that
    type. The answers are the sandbox's own (``tests/unit/test_chat_template.py`` compares them).
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        """:meth:`ImmutableSandboxedEnvironment.is_safe_attribute`, remembered per (type, name): it reads
        only ``obj``'s type (``isinstance`` checks) and the name. The names are the template's own or an
        existing attribute's, so the memo stays small."""
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe

    def getattr(self, obj: Any, attribute: str) -> Any:
        """:meth:`SandboxedEnvironment.getattr`: a dict's key that no dict attribute shadows is read
        directly (jinja would find no such attribute, then read the key)."""
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                pass  # the sandbox's path gives the undefined value
        return super().getattr(obj, attribute)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template for ``source`` (cached: templates are large and reused)."""
    env = _ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    extra_context: dict[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages`` as the model's chat template renders it."""
    template = compile_chat_template(source)
    # Templates test `message.content` etc. for presence; keys set to None must read as absent.
    clean_messages = [
        {key: value for key, value in message.items() if value is not None} for message in messages
    ]
    context: dict[str, Any] = dict(special_tokens or {})
    context.update(extra_context or {})
    try:
        return template.render(
            messages=clean_messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
