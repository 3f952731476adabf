"""Stop sequences: the answer text ends before the first one, whatever the chunking."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resq.postprocess.segments import ReasoningSegment, Segment, TextSegment, ToolCallSegment
from resq.postprocess.stops import StopSequences

Piece = tuple[str, ...]
"""("text", t), ("reasoning", t) or ("call", name, arguments): what a client sees, merged."""

CALL = ToolCallSegment("get_weather", '{"city": "Oslo"}')


def split(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = [0, *sorted({cut for cut in cuts if 0 < cut < len(text)}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def merge(segments: Iterable[Segment]) -> list[Piece]:
    """Adjacent segments of the same kind joined (what a client makes of the deltas)."""
    pieces: list[Piece] = []
    for segment in segments:
        if isinstance(segment, ToolCallSegment):
            pieces.append(("call", segment.name, segment.arguments))
            continue
        assert isinstance(segment, TextSegment | ReasoningSegment)
        kind = "text" if isinstance(segment, TextSegment) else "reasoning"
        if pieces and pieces[-1][0] == kind:
            pieces[-1] = (kind, pieces[-1][1] + segment.text)
        else:
            pieces.append((kind, segment.text))
    return pieces


@dataclass
class Stream:
    """Segments as the parser chain would hand them over, with the output they were cut from."""

    batches: list[list[Segment]]
    """What each ``feed`` gets (the last one goes to ``finish``)."""
    output: str
    """The decoded output: text segments say where they lie in it (``start``)."""


def stream(items: Sequence[str | Segment], *, batch_size: int = 1) -> Stream:
    """Text chunks (strings) and other segments as batches of ``batch_size`` items.

    Every string becomes a TextSegment with its offset in the output; reasoning adds its
    text to the output too, so text offsets are not simply offsets in the answer text.
    """
    output = ""
    segments: list[Segment] = []
    for item in items:
        if isinstance(item, str):
            if item:
                segments.append(TextSegment(item, start=len(output)))
            output += item
        else:
            if isinstance(item, ReasoningSegment):
                output += item.text
            segments.append(item)
    batches = [segments[i : i + batch_size] for i in range(0, len(segments), batch_size)] or [[]]
    return Stream(batches, output)


@dataclass
class Result:
    fed: list[list[Segment]]
    finished: list[Segment]
    stopped: bool

    @property
    def segments(self) -> list[Segment]:
        return [*itertools.chain.from_iterable(self.fed), *self.finished]

    @property
    def pieces(self) -> list[Piece]:
        return merge(self.segments)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments if isinstance(s, TextSegment))


def run(stops: tuple[str, ...], data: Stream) -> Result:
    cutter = StopSequences(stops)
    fed = [cutter.feed(batch) for batch in data.batches[:-1]]
    finished = cutter.finish(data.batches[-1])
    return Result(fed, finished, cutter.stopped)


def expected(items: Sequence[str | Segment], stops: tuple[str, ...]) -> tuple[list[Piece], bool]:
    """Independently: each run of text (between other segments) cut at its earliest stop sequence."""
    runs: list[Piece] = []
    for item in items:
        if isinstance(item, str):
            if runs and runs[-1][0] == "text":
                runs[-1] = ("text", runs[-1][1] + item)
            elif item:
                runs.append(("text", item))
        else:
            runs += merge([item])
    out: list[Piece] = []
    for piece in runs:
        if piece[0] == "text":
            found = [at for at in (piece[1].find(stop) for stop in stops if stop) if at >= 0]
            if found:
                if min(found):
                    out.append(("text", piece[1][: min(found)]))
                return merge_pieces(out), True
        out.append(piece)
    return merge_pieces(out), False


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for piece in pieces:
        if piece[0] != "call" and merged and merged[-1][0] == piece[0]:
            merged[-1] = (piece[0], merged[-1][1] + piece[1])
        else:
            merged.append(piece)
    return merged


def check(items: Sequence[str | Segment], stops: tuple[str, ...], *, batch_size: int = 1) -> Result:
    data = stream(items, batch_size=batch_size)
    result = run(stops, data)
    pieces, stopped = expected(items, stops)
    assert result.pieces == pieces, items
    assert result.stopped == stopped, items
    for segment in result.segments:
        if isinstance(segment, TextSegment):
            assert segment.text, f"empty text segment: {segment!r}"
            # Where it says it lies (logprobs go by it).
            assert data.output[segment.start : segment.start + len(segment.text)] == segment.text, segment
    return result


# --- every pair of split positions --------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    stops: tuple[str, ...]
    answer: str
    """The text a client sees."""
    stopped: bool = True


CASES = [
    Case("one_stop", "Hello world. STOP here", ("STOP",), "Hello world. "),
    Case("no_stop", "Hello world.", ("STOP",), "Hello world.", stopped=False),
    Case("stop_first", "STOPabc", ("STOP",), ""),
    Case("stop_is_all", "STOP", ("STOP",), ""),
    Case("stop_last", "abcSTOP", ("STOP",), "abc"),
    Case("earliest_of_several", "one, two; three", ("three", ";", "two"), "one, "),
    Case("earliest_of_several_reversed", "one, two; three", ("two", ";", "three"), "one, "),
    Case("same_start_longer_and_shorter", "xx abcd yy", ("abcd", "ab"), "xx "),
    Case("same_end_suffix", "xx abcd yy", ("abcd", "cd"), "xx "),
    Case("false_start_then_stop", "abcab abcd!", ("abcd",), "abcab "),
    Case("false_start_at_the_end", "it ends with <|en", ("<|end|>",), "it ends with <|en", stopped=False),
    Case("false_starts_only", "<|e <| <|en|> <", ("<|end|>",), "<|e <| <|en|> <", stopped=False),
    Case("self_overlapping_stop", "xaaab", ("aab",), "xa"),
    Case("repeated_prefix", "ababac", ("abac",), "ab"),
    Case("newline_stop", "line one\nline two", ("\n",), "line one"),
    Case("unicode", "こんにちは、世界！😀終わり", ("世界", "😀"), "こんにちは、"),
    Case("empty_stops_ignored", "abc", ("", "x"), "abc", stopped=False),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_pair_of_split_positions(case: Case) -> None:
    positions = range(1, len(case.text))
    for first, second in itertools.combinations_with_replacement(positions, 2):
        result = check(split(case.text, (first, second)), case.stops)
        assert result.text == case.answer
        assert result.stopped == case.stopped
    assert check([case.text], case.stops).text == case.answer
    assert check(list(case.text), case.stops).text == case.answer
    # Several chunks in one feed call.
    assert check(list(case.text), case.stops, batch_size=3).text == case.answer


# --- random chunkings ---------------------------------------------------------------------------------

SMALL = st.text(alphabet="ab<|", min_size=0, max_size=14)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=SMALL,
    stop=st.text(alphabet="ab<|", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=13), max_size=8),
)
def test_one_stop_any_chunking(text: str, stop: str, cuts: list[int]) -> None:
    # A tiny alphabet: partial matches that turn out not to be ones are everywhere.
    result = check(split(text, cuts), (stop,))
    at = text.find(stop)
    assert result.text == (text[:at] if at >= 0 else text)
    assert stop not in result.text


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=SMALL,
    stops=st.lists(st.text(alphabet="ab<|", min_size=3, max_size=3), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=13), max_size=8),
    batch_size=st.integers(min_value=1, max_value=3),
)
def test_several_stops_of_one_length_any_chunking(
    text: str, stops: list[str], cuts: list[int], batch_size: int
) -> None:
    # Of one length, the stop sequence that starts first also ends first: no ambiguity.
    result = check(split(text, cuts), tuple(stops), batch_size=batch_size)
    assert not any(stop in result.text for stop in stops)


ITEM = st.one_of(
    st.text(alphabet="ab<|", min_size=1, max_size=6),
    st.builds(ReasoningSegment, st.text(alphabet="ab<|r", min_size=1, max_size=4)),
    st.just(CALL),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(ITEM, max_size=8),
    stop=st.text(alphabet="ab<|", min_size=1, max_size=4),
    batch_size=st.integers(min_value=1, max_value=4),
)
def test_reasoning_and_calls_pass_through_any_chunking(
    items: list[str | Segment], stop: str, batch_size: int
) -> None:
    """Only answer text is searched; other segments end a run of text (and are dropped after a stop)."""
    check(items, (stop,), batch_size=batch_size)


# --- exact behaviour ------------------------------------------------------------------------------------


def test_partial_match_is_held_then_released() -> None:
    cutter = StopSequences(("<|end|>",))
    assert cutter.feed([TextSegment("abc <|e", start=0)]) == [TextSegment("abc ", start=0)]
    released = cutter.feed([TextSegment("x", start=7)])
    assert released == [TextSegment("<|e"), TextSegment("x")]
    assert [segment.start for segment in released] == [4, 7]  # type: ignore[union-attr]
    assert not cutter.stopped


def test_held_text_at_the_end_is_released_by_finish() -> None:
    cutter = StopSequences(("<|end|>",))
    assert cutter.feed([TextSegment("abc <|en", start=0)]) == [TextSegment("abc ")]
    finished = cutter.finish([])
    assert finished == [TextSegment("<|en")]
    assert finished[0].start == 4  # type: ignore[union-attr]
    assert not cutter.stopped


def test_finish_with_segments_then_held_text() -> None:
    cutter = StopSequences(("STOP",))
    assert cutter.feed([TextSegment("aS", start=0)]) == [TextSegment("a")]
    finished = cutter.finish([TextSegment("T", start=2)])
    # Held: nothing more can complete the stop, so it is shown, each piece where it lies.
    assert merge(finished) == [("text", "ST")]
    assert [segment.start for segment in finished] == [1, 2]  # type: ignore[union-attr]


def test_held_text_is_released_before_reasoning_and_calls() -> None:
    cutter = StopSequences(("STOP",))
    out = cutter.feed(
        [
            TextSegment("ab ST", start=0),
            ReasoningSegment("STOP inside reasoning"),
            CALL,
            TextSegment("OP", start=26),
        ]
    )
    assert out == [
        TextSegment("ab "),
        TextSegment("ST"),
        ReasoningSegment("STOP inside reasoning"),
        CALL,
        TextSegment("OP"),
    ]
    assert [s.start for s in out if isinstance(s, TextSegment)] == [0, 3, 26]
    assert not cutter.stopped


def test_everything_after_the_stop_is_dropped() -> None:
    cutter = StopSequences(("STOP",))
    out = cutter.feed(
        [TextSegment("aSTOPb", start=0), ReasoningSegment("r"), CALL, TextSegment("c", start=8)]
    )
    assert out == [TextSegment("a")]
    assert cutter.stopped
    assert cutter.feed([TextSegment("more", start=9), CALL]) == []
    assert cutter.finish([TextSegment("end", start=13)]) == []


def test_a_stop_spanning_chunks_shows_nothing_of_it() -> None:
    cutter = StopSequences(("STOP",))
    assert cutter.feed([TextSegment("xS", start=0)]) == [TextSegment("x")]
    assert cutter.feed([TextSegment("T", start=2)]) == []
    assert cutter.feed([TextSegment("O", start=3)]) == []
    assert cutter.feed([TextSegment("Py", start=4)]) == []
    assert cutter.stopped
    assert cutter.finish([]) == []


def test_only_empty_stops_cut_nothing() -> None:
    cutter = StopSequences(("",))
    assert cutter.feed([TextSegment("abc", start=0)]) == [TextSegment("abc")]
    assert cutter.finish([]) == []
    assert not cutter.stopped


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("xabcdy", ("abcd", "bc"), "xa"),
        ("The answer is 4.", ("answer is", "swer"), "The an"),
        ("xabcd", ("abcd", "c"), "xab"),
    ],
)
def test_overlapping_stops_give_one_answer_for_any_chunking(
    text: str, stops: tuple[str, ...], expected: str
) -> None:
    """The stop that completes first wins, as a check after every token would find it."""
    answers = {
        run(stops, stream(split(text, (a, b)))).text for a, b in itertools.pairwise(range(len(text) + 1))
    }
    answers |= {run(stops, stream([text])).text, run(stops, stream(list(text))).text}
    assert answers == {expected}
