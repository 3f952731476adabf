"""Schemathesis against a running API's own ``/openapi.json``: no generated request may get a 5xx.

Every operation is fuzzed with schema-conforming (positive) and schema-violating
(negative) requests. Half of the create requests name the served model, so that valid
ones reach tokenising, the queue and the GPU worker rather than stopping at a 404.
Hypothesis is derandomised by default: the same schema gives the same requests on every run;
``randomised`` draws new ones each run (``make fuzz RESQ_FUZZ_RANDOM=1``), so that runs repeated
by hand explore further, and a failure is reported with the request that caused it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

REQUEST_TIMEOUT_S = 120.0
"""A request that takes longer counts as a failure (a hang), like a 5xx."""


def _with_model(case: Any, model: str | None) -> Any:
    if model is not None and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
    return case


def _describe(case: Any, outcome: str) -> str:
    return f"{case.method} {case.formatted_path} query={case.query} body={str(case.body)[:500]}: {outcome}"


@dataclass
class FuzzReport:
    """What a run sent and got."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    """Answers by operation label and status code."""
    failures: list[str] = field(default_factory=list)
    """One line per operation and mode that got a 5xx or no answer (the first such request)."""
    samples: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """The first few requests and answers per operation and status (what a failed check shows)."""


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    model: str,
    options: dict[str, Any],
    report: FuzzReport,
) -> None:
    """Fuzz one operation in one mode; the first failing request (shrunk, if asked) goes in ``report``."""
    session = requests.Session()
    label = operation.label

    @settings(**options)
    @given(st.tuples(operation.as_strategy(generation_mode=mode), st.sampled_from([model, None])))
    def check(drawn: tuple[Any, str | None]) -> None:
        case = _with_model(*drawn)
        try:
            response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            raise AssertionError(_describe(case, f"no answer ({exc!r})")) from exc
        report.statuses[label, response.status_code] += 1
        kept = report.samples.setdefault((label, response.status_code), [])
        if len(kept) < 3:
            kept.append(_describe(case, f"{response.status_code} {response.text[:300]}"))
        if response.status_code >= 500:
            raise AssertionError(_describe(case, f"{response.status_code} {response.text[:300]}"))

    try:
        check()
    except Unsatisfiable:
        pass  # nothing to violate (an operation without parameters has no negative cases)
    except AssertionError as exc:
        report.failures.append(f"{label} [{mode.value}]: {exc}")
    finally:
        session.close()


def fuzz_api(
    base_url: str, model: str, max_examples: int, shrink: bool = False, randomised: bool = False
) -> FuzzReport:
    """Fuzz every operation of the API at ``base_url``, with positive and negative requests."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    options: dict[str, Any] = {
        "max_examples": max_examples,
        "derandomize": not randomised,
        "database": None,
        "deadline": None,
        "phases": [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])],
        "suppress_health_check": list(HealthCheck),
        "report_multiple_bugs": False,
    }
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(result.ok(), mode, base_url, model, options, report)
    return report
