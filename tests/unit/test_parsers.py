"""Reasoning and tool-call parsers: exact policies, and the same result for any chunking."""

from __future__ import annotations

import itertools
import json
import random
import types as pytypes
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from resq import jsonutil
from resq.catalog import ModelCard, TextTokenizer, tokenizer_sha256
from resq.events import types as event_types
from resq.options import ProcessingOptions
from resq.postprocess.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    HermesToolParser,
    ParserChain,
    ReasoningParser,
    ReasoningTokenCounter,
    UnknownParserError,
    call_end_tag,
    forced_call_prefix,
    make_parser,
)
from resq.postprocess.parsers.hermes import parse_call
from resq.postprocess.parsers.markup import partial_tag_length
from resq.postprocess.processor import ResponseProcessor
from resq.postprocess.segments import ReasoningEnd, ReasoningSegment, Segment, TextSegment, ToolCallSegment
from resq.protocols import responses as processor_module
from resq.wire import FinishEntry, StartEntry, TokensEntry

THINK_TAGS = ("<think>", "</think>")
CALL_TAGS = ("<tool_call>", "</tool_call>")
ALL_TAGS = THINK_TAGS + CALL_TAGS

Piece = tuple[str, ...]
"""A merged segment: ("text", t), ("reasoning", t) or ("call", name, arguments)."""


def call(city: str) -> str:
    """A get_weather call, formatted exactly as the fixture model's chat template writes it."""
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


def weather(city: str) -> Piece:
    return ("call", "get_weather", json.dumps({"city": city}, ensure_ascii=False))


def options(
    reasoning: str | None = None,
    tools: bool = False,
    tools_enabled: bool = True,
    max_calls: int | None = None,
    constrained: bool = False,
) -> ProcessingOptions:
    return ProcessingOptions(
        model="tiny",
        reasoning_parser=reasoning,
        tool_parser="hermes" if tools else None,
        tools_enabled=tools_enabled,
        max_function_calls=max_calls,
        answer_constrained=constrained,
    )


def merge(segments: Iterable[Segment]) -> list[Piece]:
    """Segments with adjacent text of the same kind joined (what the assembler makes of them)."""
    pieces: list[Piece] = []
    for segment in segments:
        if isinstance(segment, ReasoningEnd):
            continue  # where blocks end: checked by test_a_closed_block_is_followed_by_its_end
        if isinstance(segment, ToolCallSegment):
            pieces.append(("call", segment.name, segment.arguments))
            continue
        kind = "text" if isinstance(segment, TextSegment) else "reasoning"
        if pieces and pieces[-1][0] == kind:
            pieces[-1] = (kind, pieces[-1][1] + segment.text)
        else:
            pieces.append((kind, segment.text))
    return pieces


@dataclass
class Run:
    fed: list[list[Segment]]
    """What each ``feed`` returned, in order."""
    finished: list[Segment]
    spans: list[tuple[int, int]]
    """The reasoning stage's reasoning spans, merged."""

    @property
    def pieces(self) -> list[Piece]:
        return merge([*itertools.chain.from_iterable(self.fed), *self.finished])


def run(chain: ParserChain, chunks: Iterable[str]) -> Run:
    fed = [chain.feed(chunk) for chunk in chunks]
    spans = chain.take_reasoning_spans()
    finished = chain.finish()
    spans += chain.take_reasoning_spans()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return Run(fed, finished, merged)


def parse(text: str, opts: ProcessingOptions, chunks: Iterable[str] | None = None) -> list[Piece]:
    return run(make_parser(opts), [text] if chunks is None else chunks).pieces


def split(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# --- reasoning ---------------------------------------------------------------------------------------

FIXTURE_REASONING = "<think>\nTwo plus two equals four.\n</think>\n\nThe answer is 4."


def test_fixture_answer_splits_into_trimmed_reasoning_and_answer() -> None:
    assert parse(FIXTURE_REASONING, options("qwen3")) == [
        ("reasoning", "Two plus two equals four."),
        ("text", "The answer is 4."),
    ]


def test_without_think_the_output_is_answer_text_exactly() -> None:
    assert parse("  Hello\n\n there ", options("qwen3")) == [("text", "  Hello\n\n there ")]


def test_whitespace_before_the_opening_think_is_dropped() -> None:
    assert parse(" \n<think>r</think>a", options("qwen3")) == [("reasoning", "r"), ("text", "a")]


def test_whitespace_inside_reasoning_and_answer_is_kept() -> None:
    text = "<think> a \n\n b </think>\n x  y \n"
    assert parse(text, options("qwen3")) == [("reasoning", "a \n\n b"), ("text", "x  y \n")]


def test_whitespace_only_reasoning_yields_no_reasoning() -> None:
    assert parse("<think>\n\n</think>\n\nHi", options("qwen3")) == [("text", "Hi")]


def test_qwen3_leading_close_tag_is_an_empty_block() -> None:
    assert parse(" \n</think>\n\nHi", options("qwen3")) == [("text", "Hi")]


def test_qwen3_close_tag_after_answer_text_is_dropped() -> None:
    # Documented limitation: with qwen3 the reasoning of a template-opened block streams as text.
    assert parse("thinking</think>answer", options("qwen3")) == [("text", "thinkinganswer")]


@pytest.mark.parametrize("prefix", ["", "<think>", "\n<think>\n"])
def test_deepseek_r1_starts_inside_reasoning(prefix: str) -> None:
    text = prefix + "Let me think.\n</think>\n\nThe answer."
    assert parse(text, options("deepseek_r1")) == [("reasoning", "Let me think."), ("text", "The answer.")]


def test_stray_tags_are_dropped_and_think_mid_answer_opens_reasoning() -> None:
    text = "<think>a<think>b</think>A </think>B <think> r </think> C"
    assert parse(text, options("qwen3")) == [
        ("reasoning", "ab"),
        ("text", "A B "),
        ("reasoning", "r"),
        ("text", "C"),
    ]


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_under_a_grammar_tags_in_the_answer_are_text(reasoning: str) -> None:
    """A grammar lets reasoning come first only: a JSON answer quoting the chat format keeps its
    tags (without a grammar, the one above, <think> would open reasoning in the middle of it)."""
    answer = '{"t": "x<think>y</think>z </tool_call>"}'
    opening = "<think>r</think>" if reasoning == "qwen3" else "r</think>"
    text = opening + answer
    expected = [("reasoning", "r"), ("text", answer)]
    for cuts in ([], range(len(text)), [3, 9, 20, 24]):
        assert parse(text, options(reasoning, tools=True, constrained=True), split(text, cuts)) == expected
    assert parse(answer, options("qwen3", constrained=True)) == [("text", answer)]


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_a_closed_block_is_followed_by_its_end(reasoning: str) -> None:
    """The end comes with the closing tag, before any answer (whatever the chunking), so that the
    reasoning item is complete even when the output is cut right after the tag."""
    opening = "<think>" if reasoning == "qwen3" else ""
    text = opening + "Two plus two.\n</think>\n\n"
    for cuts in ([], range(len(text))):
        segments = run(make_parser(options(reasoning)), split(text, cuts)).fed
        flat = [segment for fed in segments for segment in fed]
        assert [type(segment) for segment in flat if not isinstance(segment, ReasoningSegment)] == [
            ReasoningEnd
        ]
        assert isinstance(flat[-1], ReasoningEnd)
    # An unclosed block (cut inside it) has no end.
    unclosed = run(make_parser(options(reasoning)), [opening + "Two plus"])
    assert not any(isinstance(segment, ReasoningEnd) for segment in [*unclosed.fed[0], *unclosed.finished])


def test_reasoning_cut_off_ends_with_the_output() -> None:
    assert parse("<think>\nstill thinking \n", options("qwen3")) == [("reasoning", "still thinking")]


def test_a_partial_tag_at_the_end_is_released_as_text() -> None:
    assert parse("Hi <thi", options("qwen3")) == [("text", "Hi <thi")]
    assert parse("<think>ab</thi", options("qwen3")) == [("reasoning", "ab</thi")]
    assert parse("  <th", options("qwen3")) == [("text", "  <th")]


def test_reasoning_streams_promptly_and_holds_only_possible_tags() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi") == []
    assert not parser.in_reasoning
    assert parser.feed("nk>\nStep one.") == [ReasoningSegment("Step one.")]
    assert parser.in_reasoning
    assert parser.feed(" Step two.\n</") == [ReasoningSegment(" Step two.")]
    assert parser.feed("think>\n\nDone") == [ReasoningEnd(), TextSegment("Done")]
    assert not parser.in_reasoning
    assert parser.finish() == []


def test_answer_without_think_streams_at_once() -> None:
    parser = ReasoningParser()
    assert parser.feed("\n") == []  # might still precede <think>
    assert parser.feed("Hello") == [TextSegment("\nHello")]
    assert parser.feed(" <") == [TextSegment(" ")]
    assert parser.feed("b>") == [TextSegment("<b>")]


def test_reasoning_spans_cover_tags_and_trimmed_whitespace() -> None:
    result = run(make_parser(options("qwen3")), [" <think>\nr\n</think>\n\nA</think>"])
    text_end = len(" <think>\nr\n</think>")
    assert result.spans == [(1, text_end), (text_end + 3, text_end + 3 + len("</think>"))]


# --- tool calls -------------------------------------------------------------------------------------


def test_one_call() -> None:
    assert parse(call("Paris"), options(tools=True)) == [weather("Paris")]


def test_two_calls_drop_the_newline_between() -> None:
    assert parse(call("Paris") + "\n" + call("Rome"), options(tools=True)) == [
        weather("Paris"),
        weather("Rome"),
    ]


def test_whitespace_only_runs_next_to_calls_are_dropped() -> None:
    text = "\n\n" + call("Paris") + "\n \n" + call("Rome") + "\n"
    assert parse(text, options(tools=True)) == [weather("Paris"), weather("Rome")]


def test_text_around_calls_is_kept_exactly() -> None:
    text = "Let me check.\n" + call("Oslo") + "\n\nDone. "
    assert parse(text, options(tools=True)) == [
        ("text", "Let me check.\n"),
        weather("Oslo"),
        ("text", "\n\nDone. "),
    ]


def test_whitespace_only_output_without_calls_is_kept() -> None:
    assert parse(" \n", options(tools=True)) == [("text", " \n")]


def test_a_cut_off_call_is_released_as_text() -> None:
    text = "Sure.\n" + call("Oslo")[:-4]
    assert parse(text, options(tools=True)) == [("text", text)]
    assert parse("\n<tool_call>\n{", options(tools=True)) == [("text", "\n<tool_call>\n{")]


def test_under_a_grammar_a_cut_off_call_is_dropped() -> None:
    """There an open block can only be a call max_output_tokens cut: its markup is no answer text."""
    text = "Sure.\n" + call("Paris") + "\n" + call("Oslo")[:-4]
    assert parse(text, options(tools=True, constrained=True)) == [("text", "Sure.\n"), weather("Paris")]
    assert parse(call("Oslo")[:20], options(tools=True, constrained=True)) == []


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": }',
        '{"arguments": {"city": "Oslo"}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f"}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": "{oops"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '["get_weather"]',
        "",
    ],
)
def test_an_invalid_call_is_released_as_text(body: str) -> None:
    text = call("Paris") + "\n<tool_call>\n" + body + "\n</tool_call>\nok"
    assert parse(text, options(tools=True)) == [
        weather("Paris"),
        ("text", "\n<tool_call>\n" + body + "\n</tool_call>\nok"),
    ]


def test_arguments_as_a_json_string_and_unicode() -> None:
    body = '{"name": "f", "arguments": "{\\"city\\": \\"東京\\", \\"n\\": [1, 2]}"}'
    assert parse_call(body) == ToolCallSegment("f", '{"city": "東京", "n": [1, 2]}')
    assert parse_call(' \n{"name":"f","arguments":{}}\n ') == ToolCallSegment("f", "{}")


@pytest.mark.parametrize(
    "arguments",
    [
        '{"xs": [1e999, -1e999]}',  # past a float: json.dumps wrote Infinity, which is no JSON
        '{"x": 0.30000000000000000001, "n": 123456789012345678901234567890}',
        '{"x":1,\n "y" : "\\ud800"}',  # the model's spacing, and an escape that is no character
    ],
)
def test_arguments_are_the_models_json_text_as_written(arguments: str) -> None:
    body = '\n{"name": "f", "arguments": ' + arguments + "}\n"
    assert parse_call(body) == ToolCallSegment("f", arguments)
    json.loads(arguments)  # JSON, as a client parses it


def test_under_a_grammar_a_call_cut_in_its_opening_tag_is_dropped() -> None:
    """Cut by max_output_tokens inside "<tool_call>": no markup reaches the answer."""
    for cut in ("<t", "<tool", "<tool_call"):
        assert parse("Sure.\n" + cut, options(tools=True, constrained=True)) == [("text", "Sure.\n")]
        assert parse(cut, options(tools=True, constrained=True)) == []
        # Without a grammar it may be text the model wrote: released as it is.
        assert parse("Sure.\n" + cut, options(tools=True)) == [("text", "Sure.\n" + cut)]
    assert parse("a <", options(tools=True, constrained=True)) == [("text", "a <")]
    # After a call the grammar allows no text: a lone "<" there is a cut call too (an agent's
    # forced handoff, cut by max_output_tokens, ended with a "\n<" message).
    assert parse(call("Paris") + "\n<", options(tools=True, constrained=True)) == [weather("Paris")]


def test_under_a_grammar_a_close_tag_inside_a_calls_json_strings_is_text() -> None:
    """Strict arguments may quote the chat format; the grammar makes the JSON well-formed, so the
    block ends after its JSON value. Without a grammar the first close tag ends it, as before."""
    arguments = {"t": 'x</tool_call>y \\" } ] {', "n": [1, {"m": "</tool_call>"}]}
    block = '<tool_call>\n{"name": "f", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"
    text = "Sure." + block + "\n" + call("Oslo") + " done"
    expected = [("text", "Sure."), ("call", "f", json.dumps(arguments)), weather("Oslo"), ("text", " done")]
    for cuts in ([], range(len(text)), [7, 30, 31, 60]):
        assert parse(text, options(tools=True, constrained=True), split(text, cuts)) == expected
    # Without a grammar, the first close tag ends the block: broken JSON, released as text; the
    # next call is still found.
    unconstrained = parse(text, options(tools=True))
    assert [piece[1] for piece in unconstrained if piece[0] == "call"] == ["get_weather"]
    assert unconstrained[0][1].startswith("Sure." + block[: block.index("</tool_call>")])


def test_a_stray_close_tag_is_text() -> None:
    assert parse("a</tool_call>b", options(tools=True)) == [("text", "a</tool_call>b")]


def test_a_partial_open_tag_is_held_back() -> None:
    parser = HermesToolParser()
    assert parser.feed("abc <tool_") == [TextSegment("abc ")]
    assert parser.feed("call>") == []
    assert parser.feed('{"name": "f", "arguments": {}}</tool_call>') == [ToolCallSegment("f", "{}")]
    assert parser.feed("<tool_x") == [TextSegment("<tool_x")]
    assert parser.finish() == []


def test_tool_markup_stays_text_when_tools_are_off() -> None:
    text = "Let me check.\n" + call("Oslo")
    assert parse(text, options(tools=True, tools_enabled=False)) == [("text", text)]
    assert parse(text, options()) == [("text", text)]


# --- the chain --------------------------------------------------------------------------------------


def test_registered_names() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert TOOL_PARSERS == ("hermes",)


@pytest.mark.parametrize(
    "bad",
    [{"reasoning_parser": "nope"}, {"tool_parser": "nope"}, {"tool_parser": "nope", "tools_enabled": True}],
)
def test_unknown_names_raise(bad: dict[str, Any]) -> None:
    with pytest.raises(UnknownParserError):
        make_parser(ProcessingOptions(model="tiny", **bad))


def test_stages_follow_the_options() -> None:
    chain = make_parser(options("qwen3", tools=True))
    assert isinstance(chain.reasoning, ReasoningParser) and isinstance(chain.tools, HermesToolParser)
    assert make_parser(options("qwen3", tools=True, tools_enabled=False)).tools is None
    plain = make_parser(options())
    assert plain.reasoning is None and plain.tools is None and not plain.tracks_reasoning
    assert plain.feed("<think>x") == [TextSegment("<think>x")]


def test_reasoning_then_call() -> None:
    text = "<think>\nI need the weather.\n</think>\n\n" + call("Oslo")
    assert parse(text, options("qwen3", tools=True)) == [
        ("reasoning", "I need the weather."),
        weather("Oslo"),
    ]


def test_reasoning_interrupting_a_call_releases_it_as_text() -> None:
    text = "A <tool_call>{<think>r</think>}</tool_call>"
    assert parse(text, options("qwen3", tools=True)) == [
        ("text", "A <tool_call>{"),
        ("reasoning", "r"),
        ("text", "}</tool_call>"),
    ]


# --- any chunking -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    opts: ProcessingOptions
    text: str
    expected: list[Piece]
    markup_in_text: bool = False
    """The raw tool-call markup is expected in text (released, or tools off)."""


CASES = [
    Case(
        "reasoning_then_text",
        options("qwen3"),
        FIXTURE_REASONING,
        [("reasoning", "Two plus two equals four."), ("text", "The answer is 4.")],
    ),
    Case(
        "text_then_call",
        options("qwen3", tools=True),
        "Let me check.\n" + call("Oslo"),
        [("text", "Let me check.\n"), weather("Oslo")],
    ),
    Case(
        "two_calls",
        options(tools=True),
        call("Paris") + "\n" + call("Rome"),
        [weather("Paris"), weather("Rome")],
    ),
    Case(
        "call_cut_off",
        options("qwen3", tools=True),
        "Sure.\n" + call("Oslo")[:-3],
        [("text", "Sure.\n" + call("Oslo")[:-3])],
        markup_in_text=True,
    ),
    Case(
        "invalid_json_call",
        options(tools=True),
        "\n" + call("Oslo").replace('"Oslo"', "Oslo") + "\n" + call("Rome"),
        [("text", "\n" + call("Oslo").replace('"Oslo"', "Oslo") + "\n"), weather("Rome")],
        markup_in_text=True,
    ),
    Case(
        "unicode",
        options("qwen3", tools=True),
        "<think>\n考えています… 😀\n</think>\n\nこんにちは、世界！ 😀\n" + call("東京") + "\n",
        [("reasoning", "考えています… 😀"), ("text", "こんにちは、世界！ 😀\n"), weather("東京")],
    ),
    Case(
        "template_opened_think",
        options("deepseek_r1", tools=True),
        "\nLet me think.\n</think>\n\n" + call("Rome") + "\n" + call("Oslo"),
        [("reasoning", "Let me think."), weather("Rome"), weather("Oslo")],
    ),
    Case(
        "qwen3_empty_template_block",
        options("qwen3", tools=True),
        " \n</think>\n\nHi <b>" + call("Oslo"),
        [("text", "Hi <b>"), weather("Oslo")],
    ),
    Case(
        "stray_tags",
        options("qwen3"),
        "  Hi <thi there </think> done<think> more </think>\n end",
        [("text", "  Hi <thi there  done"), ("reasoning", "more"), ("text", "end")],
    ),
    Case(
        "call_inside_reasoning",
        options("qwen3", tools=True),
        "<think>maybe " + call("Oslo") + "</think>ok",
        [("reasoning", "maybe " + call("Oslo")), ("text", "ok")],
        markup_in_text=True,
    ),
    Case(
        "tools_off",
        options("qwen3", tools=True, tools_enabled=False),
        "<think>r</think>" + call("Oslo"),
        [("reasoning", "r"), ("text", call("Oslo"))],
        markup_in_text=True,
    ),
    Case(
        # One run of answer text for the tool parser, two slices of the output.
        "stray_close_inside_answer_with_tools",
        options("qwen3", tools=True),
        "Hi </think>there " + call("Oslo") + " bye",
        [("text", "Hi there "), weather("Oslo"), ("text", " bye")],
    ),
    Case(
        "one_call_allowed",
        options(tools=True, max_calls=1),
        call("Paris") + "\n" + call("Rome") + "\nafter",
        [weather("Paris")],
    ),
    Case(
        "one_call_allowed_after_reasoning_and_text",
        options("qwen3", tools=True, max_calls=1),
        "<think>r</think>Let me check.\n" + call("Oslo") + "<think>more</think>text " + call("Rome"),
        [("reasoning", "r"), ("text", "Let me check.\n"), weather("Oslo")],
    ),
]


def watched_tags(opts: ProcessingOptions) -> tuple[str, ...]:
    """The tags whose start the chain must hold back (a tail like ``<tool_`` must not leak)."""
    tags: tuple[str, ...] = THINK_TAGS if opts.reasoning_parser else ()
    if opts.tool_parser and opts.tools_enabled:
        tags += ("<tool_call>",)
    return tags


def check_run(case: Case, chunks: list[str], reference: Run) -> None:
    assert "".join(chunks) == case.text
    result = run(make_parser(case.opts), chunks)
    assert result.pieces == case.expected, chunks
    assert result.spans == reference.spans, chunks
    tags = watched_tags(case.opts)
    for segments in result.fed:
        for segment in segments:
            if isinstance(segment, ToolCallSegment | ReasoningEnd):
                continue
            assert segment.text, "empty segment"
            # Tool calls are only looked for in the answer, never in reasoning.
            watched = THINK_TAGS if isinstance(segment, ReasoningSegment) else tags
            assert partial_tag_length(segment.text, watched) == 0, f"partial markup leaked: {segment!r}"
    for segment in itertools.chain(*result.fed, result.finished):
        if isinstance(segment, ToolCallSegment | ReasoningEnd):
            continue
        if isinstance(segment, TextSegment):
            # Every text segment is the slice of the output it says it is (logprobs rely on it).
            assert case.text[segment.start : segment.start + len(segment.text)] == segment.text, segment
        forbidden = THINK_TAGS if case.markup_in_text else ALL_TAGS
        assert not any(tag in segment.text for tag in forbidden), segment


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_fixed_chunkings(case: Case) -> None:
    reference = run(make_parser(case.opts), [case.text])
    assert reference.pieces == case.expected
    check_run(case, [case.text], reference)
    check_run(case, list(case.text), reference)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_gives_the_same_segments(case: Case, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(case.text) - 1)), max_size=40))
    reference = run(make_parser(case.opts), [case.text])
    check_run(case, split(case.text, cuts), reference)


@pytest.mark.parametrize("reasoning", REASONING_PARSERS)
def test_think_tags_split_at_every_pair_of_positions(reasoning: str) -> None:
    text = "<think>\nab\n</think>\n\ncd"
    case = Case("split", options(reasoning), text, [("reasoning", "ab"), ("text", "cd")])
    reference = run(make_parser(case.opts), [text])
    for first, second in itertools.combinations_with_replacement(range(1, len(text)), 2):
        check_run(case, split(text, (first, second)), reference)


# --- token counting and the processor ---------------------------------------------------------------


def test_counter_gives_empty_tokens_the_next_character() -> None:
    counter = ReasoningTokenCounter()
    for length in (0, 3, 2, 0, 0, 1):
        counter.add_token(length)
    # Characters 0..3 are reasoning: tokens 0 and 1 count; token 2 (chars 3..5) too.
    counter.settle([(0, 4)], resolved=5)
    assert counter.count == 3
    counter.finish([(5, 6)])  # the empty tokens at 5 stand for char 5, like the last token
    assert counter.count == 6


CORPUS = [
    "Two plus two equals four. The answer is 4. Let me check the weather.",
    "こんにちは、世界！ 😀 考えています… I need the weather in Oslo.",
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
]


@lru_cache(maxsize=2)
def tiny_tokenizer(with_markup_tokens: bool) -> TextTokenizer:
    """A byte-level BPE trained in-process; markup tags as added non-special tokens, like Qwen3."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    if with_markup_tokens:
        bpe.add_tokens([AddedToken(tag, special=False) for tag in ALL_TAGS])
    tokenizer_json = bpe.to_str()
    card = ModelCard(
        name="tiny",
        context_length=256,
        chat_template="{{ messages }}",
        special_tokens={"eos_token": "<|im_end|>"},
        eos_token_ids=[bpe.token_to_id("<|im_end|>")],
        tokenizer_sha256=tokenizer_sha256(tokenizer_json),
        created=0,
        source="test",
    )
    return TextTokenizer(card=card, tokenizer=bpe)


RESPONSE_ID = "resp_" + "1" * 32
CREATED: dict[str, Any] = {
    "id": RESPONSE_ID,
    "object": "response",
    "created_at": 1,
    "status": "queued",
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
    "model": "tiny",
    "output": [],
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
}
EVENT = TypeAdapter(ResponseStreamEvent)
ANSWER = "<think>\n考えています… 😀 I need the weather.\n</think>\n\nLet me check.\n" + call("Oslo")


def expected_reasoning_tokens(tokenizer: TextTokenizer, text: str) -> int:
    """Independently: tokens whose source characters touch the reasoning block (tags included)."""
    block_end = text.index("</think>") + len("</think>")
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return sum(1 for start, end in encoding.offsets if start < block_end and end > 0)


def process(
    tokenizer: TextTokenizer, chunks: list[list[int]], opts: ProcessingOptions
) -> tuple[list[bytes], int]:
    proc = ResponseProcessor(RESPONSE_ID, CREATED, tokenizer, opts)
    encoded = proc.on_entry(StartEntry(prompt_tokens=5))
    output_tokens = sum(len(chunk) for chunk in chunks)
    for chunk in chunks:
        encoded += proc.on_entry(TokensEntry(chunk))
    encoded += proc.on_entry(FinishEntry("stop", 5, output_tokens))
    finished = proc.final_response()
    encoded.append(proc.terminal_event(finished.status, finished.response_json))
    return [event.data for event in encoded], proc.reasoning_tokens


def random_chunkings(token_ids: list[int], count: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    result = [[[token] for token in token_ids], [token_ids]]
    while len(result) < count:
        cuts = rng.sample(range(1, len(token_ids)), rng.randint(1, min(12, len(token_ids) - 1)))
        result.append([token_ids[a:b] for a, b in itertools.pairwise([0, *sorted(cuts), len(token_ids)])])
    return result


@pytest.mark.parametrize("with_markup_tokens", [True, False], ids=["tags_as_tokens", "tags_split"])
def test_processor_events_and_reasoning_tokens_for_any_token_chunking(
    with_markup_tokens: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # completed_at is the only clock reading in the events: fix it so runs compare byte for byte.
    monkeypatch.setattr(processor_module, "time", pytypes.SimpleNamespace(time=lambda: 1_700_000_000))
    tokenizer = tiny_tokenizer(with_markup_tokens)
    token_ids = tokenizer.encode(ANSWER)
    assert tokenizer.decode(token_ids) == ANSWER
    if with_markup_tokens:
        assert tokenizer.tokenizer.token_to_id("<think>") in token_ids
    expected_count = expected_reasoning_tokens(tokenizer, ANSWER)
    assert 0 < expected_count < len(token_ids)
    opts = options("qwen3", tools=True)

    reference: list[bytes] | None = None
    shape: tuple[Any, ...] | None = None
    for chunks in random_chunkings(token_ids, 32, seed=11):
        events, reasoning_tokens = process(tokenizer, chunks, opts)
        assert reasoning_tokens == expected_count
        if reference is None:
            reference = events  # one token per entry: one delta per token
            shape = chunking_invariant(events)
        # The deltas follow the entries (one per item an entry touches); the text they carry,
        # the items and the final Response never depend on the chunking.
        assert chunking_invariant(events) == shape

    assert reference is not None
    decoded = [jsonutil.loads(data) for data in reference]
    for event in decoded:
        EVENT.validate_python(event)
    final = decoded[-1]["response"]
    Response.model_validate(final)
    assert decoded[-1]["type"] == event_types.COMPLETED
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == expected_count
    output = final["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"][0]["text"] == "考えています… 😀 I need the weather."
    assert output[1]["content"][0]["text"] == "Let me check.\n"
    assert (output[2]["name"], json.loads(output[2]["arguments"])) == ("get_weather", {"city": "Oslo"})
    deltas = "".join(event["delta"] for event in decoded if event["type"] == event_types.OUTPUT_TEXT_DELTA)
    assert deltas == "Let me check.\n"


def chunking_invariant(events: list[bytes]) -> tuple[Any, ...]:
    """What of a processor's events does not depend on how the tokens were chunked."""
    decoded = [jsonutil.loads(data) for data in events]
    deltas: dict[str, str] = {}
    for event in decoded:
        if event["type"].endswith(".delta"):
            deltas[event["type"]] = deltas.get(event["type"], "") + event["delta"]
    items = [event["item"] for event in decoded if event["type"] == event_types.OUTPUT_ITEM_DONE]
    final = decoded[-1]["response"]
    return deltas, items, {key: value for key, value in final.items() if key != "id"}


def test_one_entry_of_many_tokens_makes_one_delta_per_item() -> None:
    """A stream interval's chunk walks the parser token by token, then joins what it found."""
    tokenizer = tiny_tokenizer(True)
    token_ids = tokenizer.encode(ANSWER)
    events, _ = process(tokenizer, [token_ids], options("qwen3", tools=True))
    types_seen = [jsonutil.loads(data)["type"] for data in events]
    assert types_seen.count(event_types.REASONING_TEXT_DELTA) == 1
    assert types_seen.count(event_types.OUTPUT_TEXT_DELTA) == 1
    per_token, _ = process(tokenizer, [[token] for token in token_ids], options("qwen3", tools=True))
    assert chunking_invariant(events) == chunking_invariant(per_token)


def test_processor_without_reasoning_parser_counts_nothing() -> None:
    tokenizer = tiny_tokenizer(True)
    token_ids = tokenizer.encode(ANSWER)
    events, reasoning_tokens = process(tokenizer, [token_ids], options(tools=True))
    assert reasoning_tokens == 0
    final = jsonutil.loads(events[-1])["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"].startswith("<think>\n")


# --- forced calls, call limits ----------------------------------------------------------------------


@pytest.mark.parametrize("reasoning", [None, *REASONING_PARSERS])
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_a_forced_opening_continued_by_the_model_parses_as_the_call(
    reasoning: str | None, name: str | None
) -> None:
    prefix = forced_call_prefix(reasoning, "hermes", name)
    assert prefix.startswith("</think>\n\n<tool_call>" if reasoning == "deepseek_r1" else "<tool_call>")
    whole = call("Oslo")
    rest = whole[len(prefix.removeprefix("</think>\n\n")) :]
    assert (prefix.removeprefix("</think>\n\n") + rest) == whole, (
        "the opening is how the template writes calls"
    )
    assert parse(prefix + rest, options(reasoning, tools=True)) == [weather("Oslo")]


def test_forced_prefix_names_are_json_escaped_and_unknown_parsers_refused() -> None:
    assert forced_call_prefix(None, "hermes", "a.b-c").endswith('"name": "a.b-c", "arguments":')
    assert call_end_tag("hermes") == "</tool_call>"
    with pytest.raises(UnknownParserError):
        forced_call_prefix(None, "nope", None)
    with pytest.raises(UnknownParserError):
        call_end_tag("nope")


def test_the_call_limit_only_applies_where_calls_are_parsed() -> None:
    text = call("Paris") + call("Rome")
    assert parse(text, options(tools=True, tools_enabled=False, max_calls=1)) == [("text", text)]
    assert make_parser(options(tools=True, max_calls=1)).max_calls == 1


def test_tokens_the_model_did_not_sample_are_never_counted() -> None:
    counter = ReasoningTokenCounter()
    counter.add_token(len("</think>"), sampled=False)
    counter.add_token(len("\n\n"), sampled=False)
    counter.add_token(len("<think>"))
    counter.finish([(0, len("</think>\n\n<think>"))])
    assert counter.count == 1


# --- both protocols ---------------------------------------------------------------------------------

CHAT_CREATED: dict[str, Any] = {
    "id": "chatcmpl-" + "1" * 32,
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "system_fingerprint": "resq",
    "service_tier": "default",
}


@dataclass(frozen=True)
class Answer:
    """What a client of either protocol ends up with."""

    text: str
    reasoning: str
    calls: list[tuple[str, str]]
    logprobs: list[dict[str, Any]]
    reasoning_tokens: int
    tool_calls_finish: bool
    """Responses: completed with a function call; chat: ``finish_reason`` ``tool_calls``."""


def final_object(
    tokenizer: TextTokenizer, chunks: list[list[int]], opts: ProcessingOptions
) -> dict[str, Any]:
    created = CHAT_CREATED if opts.protocol == "chat" else CREATED
    proc = ResponseProcessor(RESPONSE_ID, created, tokenizer, opts)
    proc.on_entry(StartEntry(prompt_tokens=5))
    position = 0
    for chunk in chunks:
        logprobs = [-0.25 - position - i for i in range(len(chunk))] if opts.logprobs else None
        proc.on_entry(TokensEntry(chunk, logprobs))
        position += len(chunk)
    proc.on_entry(FinishEntry("stop", 5, position))
    final: dict[str, Any] = jsonutil.loads(proc.final_response().response_json)
    return final


def responses_answer(final: dict[str, Any]) -> Answer:
    Response.model_validate(final)
    text, reasoning, calls, logprobs = "", "", [], []
    for item in final["output"]:
        if item["type"] == "message":
            for part in item["content"]:
                text += part["text"]
                logprobs += part["logprobs"]
        elif item["type"] == "reasoning":
            reasoning += "".join(part["text"] for part in item["content"])
        else:
            assert item["type"] == "function_call", item
            calls.append((item["name"], item["arguments"]))
    return Answer(
        text,
        reasoning,
        calls,
        logprobs,
        final["usage"]["output_tokens_details"]["reasoning_tokens"],
        final["status"] == "completed" and bool(calls),
    )


def chat_answer(final: dict[str, Any]) -> Answer:
    ChatCompletion.model_validate(final, strict=False)
    [choice] = final["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return Answer(
        message["content"] or "",
        message.get("reasoning_content", ""),
        calls,
        choice["logprobs"]["content"] if choice["logprobs"] is not None else [],
        final["usage"]["completion_tokens_details"]["reasoning_tokens"],
        choice["finish_reason"] == "tool_calls",
    )


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_both_protocols_carry_the_same_answer_for_any_chunking(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(CASES), label="case")
    tokenizer = tiny_tokenizer(data.draw(st.booleans(), label="with_markup_tokens"))
    token_ids = tokenizer.encode(case.text)
    assert tokenizer.decode(token_ids) == case.text
    cuts = data.draw(st.lists(st.integers(min_value=1, max_value=len(token_ids) - 1), max_size=12))
    bounds = [0, *sorted(set(cuts)), len(token_ids)]
    chunks = [token_ids[a:b] for a, b in itertools.pairwise(bounds)]
    stop: tuple[str, ...] = ()
    if data.draw(st.booleans(), label="with_stop"):
        at = data.draw(st.integers(min_value=0, max_value=len(case.text) - 1), label="stop_at")
        stop = (case.text[at : at + data.draw(st.integers(min_value=1, max_value=4), label="stop_len")],)
    opts = case.opts.model_copy(update={"stop": stop, "logprobs": data.draw(st.booleans(), label="logprobs")})

    response = final_object(tokenizer, chunks, opts)
    responses = responses_answer(response)
    chat = chat_answer(final_object(tokenizer, chunks, opts.model_copy(update={"protocol": "chat"})))
    assert chat == responses
    if not stop:
        # Without a stop sequence, both are the parsers' answer.
        pieces = case.expected
        assert responses.text == "".join(p[1] for p in pieces if p[0] == "text")
        assert responses.reasoning == "".join(p[1] for p in pieces if p[0] == "reasoning")
        assert responses.calls == [(p[1], p[2]) for p in pieces if p[0] == "call"]
    else:
        # Each run of answer text (one message item) ends before the stop sequence.
        for item in response["output"]:
            if item["type"] == "message":
                assert stop[0] not in "".join(part["text"] for part in item["content"])


# --- a newcomer's check: a tool-call format is one parser and one row ------------------------------


class ToyCallParser:
    """A toy format: a line ``CALL name {json}`` is a call, everything else is text."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> list[Segment]:
        self._held += text
        out: list[Segment] = []
        while "\n" in self._held:
            line, self._held = self._held.split("\n", 1)
            out += self._line(line + "\n")
        return out

    def finish(self) -> list[Segment]:
        held, self._held = self._held, ""
        return self._line(held) if held else []

    def _line(self, line: str) -> list[Segment]:
        if line.startswith("CALL "):
            name, arguments = line[5:].strip().split(" ", 1)
            return [ToolCallSegment(name, arguments)]
        return [TextSegment(line)]


def test_a_new_tool_call_format_is_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from resq.grammars import CallEnvelope
    from resq.postprocess import parsers
    from resq.settings import Settings

    row = parsers.ToolCallFormat(
        make=lambda _raw, _constrained: ToyCallParser(),
        envelope=CallEnvelope("CALL ", "\n"),
        forced_opening=lambda name: f"CALL {name} " if name else "CALL ",
    )
    monkeypatch.setitem(parsers.TOOL_CALL_FORMATS, "toy", row)
    assert Settings(tool_parser="toy").tool_parser == "toy"
    chain = make_parser(ProcessingOptions(model="m", tool_parser="toy", tools_enabled=True))
    segments = chain.feed('Let me look.\nCALL get_weather {"city": "Oslo"}\n') + chain.finish()
    assert [type(segment).__name__ for segment in segments] == ["TextSegment", "ToolCallSegment"]
    assert segments[1] == ToolCallSegment("get_weather", '{"city": "Oslo"}')
    assert forced_call_prefix(None, "toy", "get_weather") == "CALL get_weather "
    assert call_end_tag("toy") == "\n"
