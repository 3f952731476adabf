"""Calls on a deep stack, and the grammars whose compile overflowed a normal thread's stack.

A native stack overflow kills the process, so the grammar checks run in a subprocess each:
without the deep stack, it dies of SIGSEGV (exit status -11) instead of printing its answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from resq.deep_stack import DEEP_STACK_THREADS, on_deep_stack
from tests.support.deep_grammars import lark_chain, schema_chain


def test_a_call_returns_its_result_from_another_thread() -> None:
    def where(label: str, *, suffix: str) -> tuple[str, str]:
        return label + suffix, threading.current_thread().name

    assert on_deep_stack(where, "a", suffix="b") == ("ab", "resq-deep-stack")


def test_a_calls_exception_reaches_the_caller() -> None:
    def fails() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        on_deep_stack(fails)


def test_the_processs_stack_setting_is_left_as_it_was() -> None:
    # threading.stack_size is process-wide: raised only while the deep thread starts. (That the
    # thread's stack is deep is what the subprocess tests below show: they overflow without it.)
    before = threading.stack_size()
    on_deep_stack(lambda: None)
    assert threading.stack_size() == before


def test_deep_calls_wait_for_a_slot() -> None:
    running = 0
    most = 0
    lock = threading.Lock()
    release = threading.Event()

    def hold() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(5)
        with lock:
            running -= 1

    callers = [threading.Thread(target=on_deep_stack, args=(hold,)) for _ in range(DEEP_STACK_THREADS + 2)]
    for caller in callers:
        caller.start()
    threading.Event().wait(0.3)
    release.set()
    for caller in callers:
        caller.join(10)
    assert not any(caller.is_alive() for caller in callers)
    assert most == DEEP_STACK_THREADS


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("kind", ["lark", "schema"])
def test_the_apis_check_compiles_a_long_chain(kind: str) -> None:
    grammar = (
        f"LLMatcher.grammar_from_lark({lark_chain()!r})"
        if kind == "lark"
        else f"LLMatcher.grammar_from_json_schema(json.loads({json.dumps(schema_chain())!r}))"
    )
    done = _run(
        f"""
        import json
        from llguidance import LLMatcher
        from resq.grammars import check_grammar
        check_grammar({grammar})
        print("compiled")
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "compiled"), done.stderr[-2000:]


def test_the_gpu_workers_matcher_compiles_a_long_chain() -> None:
    done = _run(
        f"""
        from llguidance import LLMatcher
        from gpu_worker.builtin_model import ensure_builtin_model
        from gpu_worker.constraints import GrammarConstraints
        tokenizer_json = (ensure_builtin_model(None) / "tokenizer.json").read_text()
        constraints = GrammarConstraints(tokenizer_json, 2054, [2], parallel=False)
        constraints.add("r", LLMatcher.grammar_from_lark({lark_chain()!r}), [])
        print("compiled")
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "compiled"), done.stderr[-2000:]
