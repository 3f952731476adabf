"""Grammars whose compile recurses deeper than a normal thread's stack (:mod:`resq.deep_stack`)."""

from __future__ import annotations

from typing import Any

LARK_CHAIN_RULES = 3_000
"""A Lark chain of rules (66 KB) whose compile overflowed an 8 MB stack."""
SCHEMA_CHAIN_LEVELS = 1_100
"""A chain of ``anyOf``/``$ref`` definitions (75 KB) whose compile overflowed an 8 MB stack."""


def lark_chain(rules: int = LARK_CHAIN_RULES) -> str:
    """``start`` is ``r0``, each ``r{i}`` either the next rule or ``"x{i}"``, the last ``"end"``."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} | "x{i}"\n' for i in range(rules)) + f'r{rules}: "end"\n'


def schema_chain(levels: int = SCHEMA_CHAIN_LEVELS) -> dict[str, Any]:
    """Each definition either an integer or a reference to the next, the last a string."""
    definitions: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]} for i in range(levels)
    }
    definitions[f"d{levels}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": definitions}
