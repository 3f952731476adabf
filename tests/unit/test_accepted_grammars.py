"""Checking a grammar once per vocabulary (``resq.grammars.AcceptedGrammars``), on llguidance itself."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from gpu_worker.builtin_model import ensure_builtin_model
from resq import grammars
from resq.grammars import AcceptedGrammars, AnswerShape, GrammarError, build_grammar


def schema_grammar(properties: dict[str, Any]) -> str:
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    grammar = build_grammar(AnswerShape(reasoning=None, json_schema=schema, calls=None), lambda _: None)
    assert grammar is not None
    return grammar


BROKEN = '{"grammars": [{"lark_grammar": "start: undefined_rule\\n"}]}'


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The grammars llguidance was asked to compile (each still compiled for real)."""
    seen: list[str] = []
    validate = LLMatcher.validate_grammar_with_warnings

    def counted(grammar: str, tokenizer: Any = None) -> Any:
        seen.append(grammar)
        return validate(grammar, tokenizer)

    monkeypatch.setattr(grammars.LLMatcher, "validate_grammar_with_warnings", counted)
    return seen


def test_a_grammar_accepted_once_is_not_compiled_again(compiles: list[str]) -> None:
    checks = AcceptedGrammars(None)
    first, second = schema_grammar({"a": {"type": "integer"}}), schema_grammar({"b": {"type": "string"}})
    assert checks.check(first) is True
    assert checks.check(first) is False
    assert checks.check(second) is True
    assert checks.check(first) is False
    assert compiles == [first, second]


def test_a_refused_grammar_is_compiled_and_refused_every_time(compiles: list[str]) -> None:
    checks = AcceptedGrammars(None)
    for _ in range(2):
        with pytest.raises(GrammarError):
            checks.check(BROKEN)
    assert compiles == [BROKEN, BROKEN]


def test_only_the_most_recently_used_grammars_are_kept(compiles: list[str]) -> None:
    checks = AcceptedGrammars(None, kept=2)
    a, b, c = (schema_grammar({name: {"type": "integer"}}) for name in "abc")
    checks.check(a)
    checks.check(b)
    checks.check(a)  # a is now the most recent: c pushes b out
    checks.check(c)
    assert [checks.check(grammar) for grammar in (a, c, b)] == [False, False, True]
    assert compiles == [a, b, c, b]


def test_checks_from_many_threads_agree(compiles: list[str]) -> None:
    checks = AcceptedGrammars(None, kept=4)
    grammars_used = [schema_grammar({f"p{index}": {"type": "integer"}}) for index in range(8)]
    failures: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for round_number in range(50):
                checks.check(grammars_used[(offset + round_number) % len(grammars_used)])
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=hammer, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert set(compiles) == set(grammars_used)  # every grammar compiled for real, none skipped unchecked
    for grammar in grammars_used:  # and the memo still works after the contention
        checks.check(grammar)
        assert checks.check(grammar) is False


def test_a_grammar_whose_further_checks_fail_is_not_remembered(compiles: list[str]) -> None:
    checks = AcceptedGrammars(None)
    grammar = schema_grammar({"a": {"type": "string"}})

    def refuse() -> None:
        raise GrammarError("no")

    with pytest.raises(GrammarError):
        checks.check(grammar, then=refuse)
    assert not checks.remembers(grammar)
    assert checks.check(grammar, then=lambda: None) is True
    assert checks.remembers(grammar)
    assert len(compiles) == 2


# --- a grammar's first step -----------------------------------------------------------------


@pytest.fixture(scope="module")
def vocabulary() -> LLTokenizer:
    return LLTokenizer((ensure_builtin_model() / "tokenizer.json").read_text())


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    ],
    ids=["itself", "a-loop"],
)
def test_a_schema_that_refers_back_to_itself_first_compiles_but_cannot_start(
    schema: dict[str, Any], vocabulary: LLTokenizer
) -> None:
    grammar = grammars.schema_grammar(schema)
    grammars.check_grammar(grammar, vocabulary)  # what the compile alone accepts
    with pytest.raises(GrammarError, match="refers back to itself"):
        grammars.check_first_step(grammar, vocabulary)


def test_a_lark_rule_defined_by_itself_cannot_start(vocabulary: LLTokenizer) -> None:
    with pytest.raises(GrammarError, match="refers back to itself"):
        grammars.check_first_step(LLMatcher.grammar_from_lark("start: start\n"), vocabulary)


def test_a_recursive_schema_that_makes_progress_starts(vocabulary: LLTokenizer) -> None:
    tree = {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["children"],
    }
    grammars.check_first_step(grammars.schema_grammar(tree), vocabulary)


def test_a_grammar_that_does_not_compile_fails_its_first_step_with_the_compilers_message(
    vocabulary: LLTokenizer,
) -> None:
    with pytest.raises(GrammarError, match="undefined_rule"):
        grammars.check_first_step(BROKEN, vocabulary)
