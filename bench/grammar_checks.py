"""The API's grammar check of an agent's strict tools: compiled every turn, or remembered, paired per round.

``python -m bench.grammar_checks`` (``make bench-grammar``). Before a constrained request is queued the
API checks its grammar against the model's vocabulary (:func:`api.constraints.request_grammar`). An
agent offers the same strict tools every turn; :class:`resq.grammars.AcceptedGrammars` remembers the
grammars a vocabulary accepted, so only the first turn compiles. Each round times, for each tool
count, one turn's check both ways, in an order rotated between rounds (:func:`bench.stats.alternated`):

- ``compiled``: the check as every turn ran it before (:func:`resq.grammars.check_grammar`: llguidance
  compiles);
- ``remembered``: the same grammar through a memo that accepted it on an earlier turn.

The grammar is the one resq builds for the tools (:func:`resq.grammars.build_grammar`, Qwen3 reasoning
and Hermes calls, ``tool_choice: auto``), each tool with a small nested object schema like a coding
agent's; the vocabulary is the built-in model's (2k tokens; a compile was not measured to grow with
the vocabulary, but was not measured on a 150k one either). Printed: medians of each, and the median
of per-round ratios compiled / remembered with the per-round values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import click
from llguidance import LLTokenizer
from tokenizers import Tokenizer

from bench.stats import alternated, median
from gpu_worker.builtin_model import ensure_builtin_model
from resq.grammars import (
    AcceptedGrammars,
    AnswerShape,
    CallableFunction,
    CallEnvelope,
    CallsShape,
    ReasoningMarkup,
    build_grammar,
    check_grammar,
)

CHECKS_PER_SAMPLE = 20
"""Checks timed together per round and system (a remembered check takes microseconds)."""


def tool_schema(index: int) -> dict[str, Any]:
    """A coding agent's kind of tool parameters: strings, an integer, an enum and a nested object."""
    return {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": f"File for tool {index}."},
            "line": {"type": "integer"},
            "mode": {"type": "string", "enum": ["read", "write", "append"]},
            "options": {
                "type": "object",
                "properties": {"recursive": {"type": "boolean"}, "depth": {"type": "integer"}},
                "required": ["recursive", "depth"],
                "additionalProperties": False,
            },
        },
        "required": ["path", "line", "mode", "options"],
        "additionalProperties": False,
    }


def tools_grammar(count: int) -> str:
    """The grammar resq builds for ``count`` strict tools offered with ``tool_choice: auto``."""
    calls = CallsShape(
        envelope=CallEnvelope("<tool_call>", "</tool_call>"),
        functions=tuple(CallableFunction(f"tool_{index}", tool_schema(index)) for index in range(count)),
        required=False,
        single=False,
    )
    shape = AnswerShape(ReasoningMarkup("<think>", "</think>", starts_inside=False), None, calls)
    grammar = build_grammar(shape, lambda _: None)
    assert grammar is not None
    return grammar


def seconds_per_check(check: Callable[[], object]) -> float:
    started = time.perf_counter()
    for _ in range(CHECKS_PER_SAMPLE):
        check()
    return (time.perf_counter() - started) / CHECKS_PER_SAMPLE


@click.command()
@click.option("--rounds", default=7, show_default=True, help="Paired rounds per tool count.")
@click.option(
    "--tools", "tool_counts", default="1,6,20", show_default=True, help="Tool counts, comma-separated."
)
def main(rounds: int, tool_counts: str) -> None:
    """Time the API's grammar check of a turn's strict tools, compiled and remembered."""
    tokenizer_json = Tokenizer.from_file(str(ensure_builtin_model() / "tokenizer.json")).to_str()
    vocabulary = LLTokenizer(tokenizer_json)
    click.echo(f"vocabulary: the built-in model's, {vocabulary.vocab_size} tokens; {rounds} paired rounds")
    click.echo(
        "| tools | grammar chars | compiled ms | remembered ms | compiled / remembered, per round | median |"
    )
    click.echo("|---|---|---|---|---|---|")
    for count in (int(text) for text in tool_counts.split(",")):
        grammar = tools_grammar(count)
        warm = AcceptedGrammars(vocabulary)
        warm.check(grammar)
        systems: dict[str, Callable[[], object]] = {
            "compiled": partial(check_grammar, grammar, vocabulary),
            "remembered": partial(warm.check, grammar),
        }
        samples: dict[str, list[float]] = {name: [] for name in systems}
        for round_index in range(rounds):
            for name in alternated(list(systems), round_index):
                samples[name].append(seconds_per_check(systems[name]))
        ratios = [c / r for c, r in zip(samples["compiled"], samples["remembered"], strict=True)]
        click.echo(
            f"| {count} | {len(grammar):,} | {median(samples['compiled']) * 1e3:.2f} "
            f"| {median(samples['remembered']) * 1e3:.4f} | {', '.join(f'{x:,.0f}' for x in ratios)} "
            f"| {median(ratios):,.0f}x |"
        )


if __name__ == "__main__":
    main()
