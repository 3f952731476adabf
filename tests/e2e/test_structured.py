"""Structured outputs over the wire: ``text.format`` json_schema / json_object and strict tools.

Two stacks: the fixture model with the qwen3 reasoning and hermes tool parsers (reasoning
first, then JSON; ``responses.parse``; an openai-agents Agent with ``output_type``), and a
stack of its own on the built-in random-weight model, whose answers follow a schema only
because constrained decoding makes them.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import lark
import openai
import pytest
import redis
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel

from tests.e2e.conftest import Stack, start_stack
from tests.fixture_model.scenarios import GET_WEATHER_TOOL
from tests.support.deep_grammars import schema_chain
from tests.support.metrics import scrape, value
from tests.support.processes import START_TIMEOUT_S, ProcessGroup, model_registered, wait_until
from tests.support.schemas import SCHEMAS, WEATHER_PARAMETERS, follows

pytestmark = pytest.mark.e2e

FIXTURE = "fixture"
TINY = "resq-tiny"
TINY_REDIS_DB = 14
"""The random-model stack's own Redis database: its GPU worker must not take the fixture's jobs."""


def json_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}}


# --- the fixture model, with reasoning and tool parsers ---------------------------------------------


class Answer(BaseModel):
    answer: Literal[4]


ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"const": 4}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_reasoning_runs_free_and_the_answer_is_the_json(client: OpenAI) -> None:
    response = client.responses.create(
        model=FIXTURE, input="What is 2+2? Think first.", temperature=0, text=json_format(ANSWER_SCHEMA)
    )
    assert response.status == "completed"
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content
    assert reasoning.content[0].text == "Two plus two equals four."
    assert json.loads(response.output_text) == {"answer": 4}
    assert "<think>" not in response.output_text and "{" not in reasoning.content[0].text


def test_text_format_is_echoed_exactly_as_sent(client: OpenAI) -> None:
    sent = {
        "type": "json_schema",
        "name": "answer",
        "schema": ANSWER_SCHEMA,
        "strict": True,
        "description": "The sum.",
    }
    response = client.responses.create(
        model=FIXTURE, input="What is 2+2? Think first.", temperature=0, text={"format": sent}
    )
    assert response.text.format is not None
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == sent
    stored = client.responses.retrieve(response.id)
    assert stored.text.format == response.text.format


def test_an_unsent_strict_is_echoed_as_what_resq_does(client: OpenAI) -> None:
    """The Open Responses spec requires `strict` and `description`; the schema is always enforced."""
    sent = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}
    response = client.responses.create(
        model=FIXTURE, input="What is 2+2? Think first.", temperature=0, text={"format": sent}
    )
    echoed = response.text.format.model_dump(by_alias=True)  # type: ignore[union-attr]
    assert echoed["strict"] is True and echoed["description"] is None and echoed["schema"] == ANSWER_SCHEMA


def test_responses_parse_fills_output_parsed(client: OpenAI) -> None:
    parsed = client.responses.parse(
        model=FIXTURE, input="What is 2+2? Think first.", temperature=0, text_format=Answer
    )
    assert parsed.output_parsed == Answer(answer=4)


def test_streamed_json_deltas_add_up_to_the_answer(client: OpenAI) -> None:
    with client.responses.stream(
        model=FIXTURE, input="What is 2+2? Think first.", temperature=0, text_format=Answer
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert json.loads("".join(deltas)) == {"answer": 4}
    assert final.output_parsed == Answer(answer=4)


def test_json_object_format(client: OpenAI) -> None:
    response = client.responses.create(
        model=FIXTURE,
        input="What is 2+2? Think first.",
        temperature=0,
        max_output_tokens=120,
        text={"format": {"type": "json_object"}},
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut by max_output_tokens: partial JSON, as documented
        assert response.status == "incomplete" and response.output_text.startswith("{")


WEATHER_TOOL_PARAMETERS: dict[str, Any] = GET_WEATHER_TOOL["function"]["parameters"]
STRICT_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": WEATHER_TOOL_PARAMETERS,
    "strict": True,
}
"""The fixture's own tool (it answers it from memory, and a tool it was not trained on makes it
ramble past any budget), strict: the grammar checks every call."""


def test_a_strict_tool_call_follows_its_parameters(client: OpenAI) -> None:
    parameters, tool = WEATHER_TOOL_PARAMETERS, STRICT_WEATHER_TOOL
    for choice in ("auto", "required", {"type": "function", "name": "get_weather"}):
        response = client.responses.create(
            model=FIXTURE,
            input="What is the weather in Paris?",
            temperature=0,
            tools=[tool],
            tool_choice=choice,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) >= 1, (choice, response.output)
        assert all(follows(call.arguments, parameters) for call in calls)
        assert calls[0].name == "get_weather"


def test_a_structured_answer_leaves_room_for_calls_of_tools_that_are_not_strict(client: OpenAI) -> None:
    """LangChain's tools are not strict; with a structured output the grammar must still allow
    their calls (it once allowed the JSON alone: no call could ever come)."""
    tool = {**STRICT_WEATHER_TOOL, "strict": False}
    response = client.responses.create(
        model=FIXTURE,
        input="What is the weather in Paris?",
        temperature=0,
        tools=[tool],  # type: ignore[list-item]
        tool_choice="auto",
        text=json_format(ANSWER_SCHEMA),  # type: ignore[arg-type]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) >= 1, response.output
    assert calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments), dict)


def test_an_agent_resending_its_strict_tools_has_them_compiled_once(stack: Stack) -> None:
    """Turn after turn the same tools: the API compiles their grammar at most once (an earlier test
    may have sent the same grammar), and every turn's calls still follow it (the GPU worker
    constrains each one)."""
    client = stack.client()
    parameters, tool = WEATHER_TOOL_PARAMETERS, STRICT_WEATHER_TOOL
    before = scrape(f"{stack.base_url}/metrics")
    for _ in range(3):
        response = client.responses.create(
            model=FIXTURE,
            input="What is the weather in Paris?",
            temperature=0,
            tools=[tool],
            tool_choice="required",
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(follows(call.arguments, parameters) for call in calls), response.output
    after = scrape(f"{stack.base_url}/metrics")
    compiled, remembered = (
        value(after, "resq_grammar_checks_total", result=result)
        - value(before, "resq_grammar_checks_total", result=result)
        for result in ("compiled", "remembered")
    )
    assert compiled + remembered == 3 and compiled <= 1, (compiled, remembered)


@pytest.mark.parametrize(
    ("text", "param", "fragment"),
    [
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
            "text.format.schema",
            "nonsense",
        ),
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/missing"}}},
            "text.format.schema",
            "missing",
        ),
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(a"}}},
            "text.format.schema",
            "regex",
        ),
        (
            {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}},
            "text.format.name",
            "pattern",
        ),
        ({"format": {"type": "json_schema", "schema": {}}}, "text.format.name", "Missing"),
        # Compile, but cannot take a first step: the GPU worker failed the response with them.
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}},
            "text.format.schema",
            "refers back to itself",
        ),
        (
            {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {
                        "$ref": "#/$defs/a",
                        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    },
                }
            },
            "text.format.schema",
            "refers back to itself",
        ),
        ({"format": {"type": "yaml"}}, "text.format", "type"),
    ],
)
def test_a_schema_that_cannot_constrain_is_a_400_naming_it(
    client: OpenAI, text: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=FIXTURE, input="Hi", text=text)  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert fragment.lower() in error["message"].lower(), error
    # The server is fine afterwards.
    assert client.responses.create(model=FIXTURE, input="Say hello.", temperature=0).output_text


def test_a_strict_tool_with_a_bad_schema_is_a_400_naming_the_tool(client: OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": 7}}},
        "strict": True,
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=FIXTURE, input="Hi", tools=[tool])  # type: ignore[list-item]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools[0].parameters"


@pytest.mark.parametrize("strict", [True, False])
def test_a_function_whose_arguments_are_not_an_object_is_a_400_as_openai_says(
    client: OpenAI, strict: bool
) -> None:
    """The tool parser reads an object's arguments only: such a function could never be called."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "string"}, "strict": strict}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=FIXTURE, input="Hi", tools=[tool], tool_choice="required")  # type: ignore[list-item]
    assert caught.value.body == {
        "message": "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', "
        "got 'type: \"string\"'.",
        "type": "invalid_request_error",
        "param": "tools[0].parameters",
        "code": "invalid_function_parameters",
    }


def test_an_openai_agents_agent_with_output_type(stack: Stack) -> None:
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-test", max_retries=0)
    agent = Agent(
        name="math",
        instructions=None,
        model=OpenAIResponsesModel(model=FIXTURE, openai_client=client),
        output_type=Answer,
        model_settings=ModelSettings(temperature=0),
    )
    result = asyncio.run(
        Runner.run(agent, "What is 2+2? Think first.", run_config=RunConfig(tracing_disabled=True))
    )
    assert result.final_output == Answer(answer=4)


# --- the built-in random-weight model ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_stack(base_env: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """A GPU worker on the random built-in model and an API (inline post-processing), on their own Redis db."""
    redis_url = base_env["RESQ_REDIS_URL"].rsplit("/", 1)[0] + f"/{TINY_REDIS_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    env = {
        **base_env,
        "RESQ_REDIS_URL": redis_url,
        "RESQ_MODEL": "builtin",
        "RESQ_MODEL_NAME": TINY,
        "RESQ_REASONING_PARSER": "",
        "RESQ_MAX_BATCH": "48",
    }
    group = ProcessGroup(log_dir, env)
    worker = group.start("gpu-worker", "gpu-worker-tiny")
    try:
        wait_until(
            lambda: model_registered(redis_url, TINY), START_TIMEOUT_S, "the tiny GPU worker", [worker]
        )
        stack = start_stack(env, log_dir, 0, "tiny")
    except BaseException:
        group.stop_all()
        raise
    try:
        yield stack
    finally:
        stack.group.stop_all()
        group.stop_all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_follow_every_schema(tiny_stack: Stack, temperature: float) -> None:
    client = tiny_stack.client()

    def ask(item: tuple[str, dict[str, Any]]) -> tuple[str, str, str]:
        name, schema = item
        response = client.responses.create(
            model=TINY,
            input="Answer in JSON.",
            temperature=temperature,
            max_output_tokens=200,
            text=json_format(schema, name),
        )
        return name, response.status or "", response.output_text

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(ask, SCHEMAS.items()))
    for name, status, text in results:
        assert status == "completed", (name, status, text)
        assert follows(text, SCHEMAS[name]), (name, text)


@pytest.mark.parametrize(
    "schema",
    [
        # llguidance's parser limit at run time: "Current row has 2500 items; max is 2000".
        {"enum": [{"id": index} for index in range(2500)]},
        # Forced text that llguidance spells with an added token, then refuses as special.
        {"type": "object", "properties": {"a": {"const": "<tool_call>"}}, "required": ["a"]},
    ],
    ids=["parser-limit", "markup-const"],
)
def test_a_grammar_that_fails_while_decoding_fails_the_response(
    tiny_stack: Stack, schema: dict[str, Any]
) -> None:
    """Compiling such a grammar could not foresee its failure; the answer can then no longer follow
    it. The response fails, streamed or not (it once ended "completed" with text that is not JSON),
    as the request's fault: ``invalid_prompt``, and a chat completion's 400 (it was a 500)."""
    client = tiny_stack.client()
    response = client.responses.create(
        model=TINY, input="Answer in JSON.", max_output_tokens=300, text=json_format(schema)
    )
    assert response.status == "failed" and response.error is not None, response
    assert response.error.code == "invalid_prompt" and "grammar" in response.error.message
    with client.responses.stream(
        model=TINY, input="Answer in JSON.", max_output_tokens=300, text=json_format(schema)
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.failed" and "response.completed" not in [e.type for e in events]
    assert events[-1].response.error is not None and events[-1].response.error.code == "invalid_prompt"
    chat_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_completion_tokens=300,
            response_format=chat_format,  # type: ignore[arg-type]
        )
    assert refused.value.code == "invalid_prompt" and "grammar" in refused.value.message


def test_random_weights_without_the_format_do_not(tiny_stack: Stack) -> None:
    client = tiny_stack.client()

    def ask(name: str) -> str:
        return client.responses.create(
            model=TINY, input="Answer in JSON.", temperature=1.0, max_output_tokens=60
        ).output_text

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        texts = dict(zip(SCHEMAS, pool.map(ask, SCHEMAS), strict=True))
    assert [name for name, text in texts.items() if follows(text, SCHEMAS[name])] == []


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_random_weights_make_strict_calls(tiny_stack: Stack, choice: Any) -> None:
    client = tiny_stack.client()
    tools = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True},
        {"type": "function", "name": "get_time", "parameters": SCHEMAS["flat"], "strict": True},
    ]
    for temperature in (0.0, 1.0):
        response = client.responses.create(
            model=TINY,
            input="Weather?",
            temperature=temperature,
            tools=tools,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_output_tokens=120,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert response.status == "completed" and len(calls) == 1, response.output
        schema = WEATHER_PARAMETERS if calls[0].name == "get_weather" else SCHEMAS["flat"]
        assert follows(calls[0].arguments, schema), calls[0]
        if isinstance(choice, dict):
            assert calls[0].name == "get_weather"


QUOTING_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "v": {
            "type": "array",
            "items": {"type": "string", "pattern": "^</tool_cal(l|x)>$"},
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["v"],
    "additionalProperties": False,
}
"""Arguments that quote the chat format: random weights, greedy, write "</tool_call>" in them."""


def forced_quoting_call(stack: Stack, **fields: Any) -> Any:
    """A greedy, forced call of a strict function whose arguments quote the close tag."""
    return stack.client().responses.create(
        model=TINY,
        input="Go.",
        temperature=0,
        tools=[{"type": "function", "name": "f", "parameters": QUOTING_PARAMETERS, "strict": True}],
        tool_choice="required",
        **fields,
    )


def test_a_strict_call_whose_arguments_quote_the_close_tag_is_one_call(tiny_stack: Stack) -> None:
    """The grammar makes a call's JSON well-formed, so a close tag inside its strings is text of
    the arguments (it once ended the block: the call came back as markup text, or not at all)."""
    response = forced_quoting_call(tiny_stack, parallel_tool_calls=False, max_output_tokens=200)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1 and response.output_text == "", response.output
    assert follows(calls[0].arguments, QUOTING_PARAMETERS) and "</tool_call>" in calls[0].arguments


def test_a_strict_call_cut_by_max_output_tokens_leaves_no_markup(tiny_stack: Stack) -> None:
    response = forced_quoting_call(tiny_stack, max_output_tokens=12)
    assert response.status == "incomplete", response
    assert response.output_text == "" and [item.type for item in response.output] == [], response.output


CODE_TOOL: dict[str, Any] = {
    "type": "custom",
    "name": "code",
    "description": "Submit a code.",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{2}( [a-z]{1,5})?"},
}


def forced_custom_call(stack: Stack, tools: list[Any], name: str, temperature: float) -> Any:
    """Stream one forced call of the custom tool ``name``; the call, once its events add up to it."""
    with stack.client().responses.stream(
        model=TINY,
        input="Go.",
        temperature=temperature,
        tools=tools,
        tool_choice={"type": "custom", "name": name},
        parallel_tool_calls=False,
        max_output_tokens=200,
    ) as stream:
        events = list(stream)
        response = stream.get_final_response()
    calls = [item for item in response.output if item.type == "custom_tool_call"]
    assert response.status == "completed" and len(calls) == 1, response.output
    (call,) = calls
    assert call.name == name
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    done = [e.input for e in events if e.type == "response.custom_tool_call_input.done"]
    assert deltas == call.input and done == [call.input]
    return call


def test_a_schema_chained_deeper_than_a_threads_stack_constrains_answers(tiny_stack: Stack) -> None:
    """A schema chaining 1,100 definitions (75 KB): compiling it overflowed an 8 MB thread stack
    and killed the API with SIGSEGV (the GPU worker compiles it next) before compiles ran on a
    deep stack (resq.deep_stack). As a tool's parameters it would not fit this model's context;
    tests/unit/test_deep_stack.py compiles Lark chains in both roles."""
    client = tiny_stack.client()  # a 120 s timeout: a lost request would fail, not hang
    response = client.responses.create(
        model=TINY, input="Go.", temperature=0, max_output_tokens=32, text=json_format(schema_chain())
    )
    assert response.status == "completed", response
    assert isinstance(json.loads(response.output_text), int | str)
    # Neither the API nor the GPU worker died: a plain request is answered.
    assert tiny_stack.api.alive()
    plain = client.responses.create(model=TINY, input="Go.", max_output_tokens=4)
    assert plain.status in ("completed", "incomplete")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_write_regex_custom_tool_inputs(tiny_stack: Stack, temperature: float) -> None:
    call = forced_custom_call(tiny_stack, [CODE_TOOL], "code", temperature)
    assert re.fullmatch(CODE_TOOL["format"]["definition"], call.input), call


def test_a_custom_tool_call_and_its_output_go_back_into_the_conversation(tiny_stack: Stack) -> None:
    client = tiny_stack.client()
    first = client.responses.create(
        model=TINY,
        input="Code?",
        temperature=0,
        tools=[CODE_TOOL],
        tool_choice={"type": "custom", "name": "code"},  # type: ignore[list-item]
        max_output_tokens=80,
    )
    call = next(item for item in first.output if item.type == "custom_tool_call")
    history: list[Any] = [
        {"role": "user", "content": "Code?"},
        call.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "accepted"},
    ]
    second = client.responses.create(model=TINY, input=history, tools=[CODE_TOOL], max_output_tokens=8)  # type: ignore[list-item]
    assert second.status in ("completed", "incomplete")
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in listed] == ["message", "custom_tool_call", "custom_tool_call_output"]
    # previous_response_id carries the custom call along too.
    third = client.responses.create(
        model=TINY,
        previous_response_id=first.id,
        tools=[CODE_TOOL],
        max_output_tokens=8,  # type: ignore[list-item]
        input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "accepted"}],
    )
    assert third.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    ("syntax", "definition"),
    [
        ("regex", "(unclosed"),
        ("lark", "start: undefined_rule"),
        # llguidance's token and grammar references reach outside the tool's own text.
        ("lark", 'start: <[0]> "a"'),
        ("lark", "start: @tool_0"),
        # Valid once wrapped (^(?:[0-9]+)|(.*)$ matches anything): checked before the wrapping.
        ("regex", "[0-9]+)|(.*"),
        # Compiles, but cannot take a first step (the GPU worker failed the response with it).
        ("lark", "start: start"),
    ],
)
def test_a_custom_tool_grammar_that_cannot_constrain_is_a_400(
    tiny_stack: Stack, syntax: str, definition: str
) -> None:
    format_ = {"type": "grammar", "syntax": syntax, "definition": definition}
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_stack.client().responses.create(
            model=TINY,
            input="Hi",
            tools=[{**CODE_TOOL, "format": format_}],  # type: ignore[list-item]
        )
    body = caught.value.body
    assert isinstance(body, dict), body
    assert (body["param"], body["code"]) == ("tools[0].format.definition", "invalid_value"), body
    # One sentence that says why, not the first line of llguidance's report.
    assert body["message"].endswith(".") and not body["message"].endswith(":."), body
    if syntax == "regex":
        assert "group" in body["message"], body


def test_a_namespaced_custom_tools_regex_is_checked_before_it_is_wrapped(tiny_stack: Stack) -> None:
    namespace = {
        "type": "namespace",
        "name": "codes",
        "description": "Codes.",
        "tools": [{**CODE_TOOL, "format": {"type": "grammar", "syntax": "regex", "definition": "a)|(b"}}],
    }
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_stack.client().responses.create(model=TINY, input="Hi", tools=[namespace])  # type: ignore[list-item]
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "tools[0].tools[0].format.definition", body


PATCH_GRAMMAR = r"""
start: begin hunk~1..2 end
begin: "*** Begin Patch\n"
end: "*** End Patch"
hunk: "*** Add File: " FILENAME "\n" line~1..3
line: "+" LINE "\n"
FILENAME: /[a-z]{1,8}\.txt/
LINE: /[a-z ]{1,12}/
"""
"""A bounded cousin of Codex's apply_patch grammar (every input ends well within the budget)."""
PATCH_TOOL: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_write_lark_custom_tool_inputs(tiny_stack: Stack, temperature: float) -> None:
    tools: list[Any] = [
        PATCH_TOOL,
        {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True},
    ]
    call = forced_custom_call(tiny_stack, tools, "apply_patch", temperature)
    lark.Lark(PATCH_GRAMMAR).parse(call.input)  # raises if the input does not follow the grammar


def test_whichever_tool_random_weights_pick_among_lark_and_json_tools_its_call_is_valid(
    tiny_stack: Stack,
) -> None:
    client = tiny_stack.client()
    tools: list[Any] = [
        PATCH_TOOL,
        {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True},
    ]
    for attempt in range(6):
        response = client.responses.create(
            model=TINY,
            input=f"Do something {attempt}.",
            temperature=1.0,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
        )
        (call,) = [item for item in response.output if item.type in ("custom_tool_call", "function_call")]
        if call.type == "custom_tool_call":
            lark.Lark(PATCH_GRAMMAR).parse(call.input)
        else:
            assert follows(call.arguments, WEATHER_PARAMETERS), call
