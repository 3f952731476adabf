"""``compose config`` without Docker: parse, interpolate and validate a compose file in Python.

Used by tests/unit/test_compose.py where neither ``docker-compose`` nor ``docker compose`` is
installed, so that ``make test`` needs nothing beyond Python and PyPI. It does what the
checks rely on, the way compose does it:

- YAML with anchors and merge keys (``<<``), as PyYAML's safe loader reads them;
- interpolation of every string value: ``$$`` (a literal ``$``), ``$NAME``, ``${NAME}``,
  ``${NAME:-default}`` / ``${NAME-default}``, ``${NAME:?message}`` / ``${NAME?message}``
  (an error when unset, or also when empty with ``:``);
- a service's ``environment`` entries without a value taken from the environment;
- validation against the Compose Specification's JSON schema, as vendored by
  ``check-jsonschema`` (a pinned dev dependency).

It does not normalise (long port syntax, list-form environments), which compose's own
``config`` output does; the checks read mappings, which both give.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<operator>:?[-?])(?P<argument>[^}]*))?\})"
)


class InterpolationError(ValueError):
    """A required variable (``${NAME:?message}``) is missing."""


def interpolate(text: str, environment: dict[str, str]) -> str:
    """``text`` with its ``$`` expressions replaced from ``environment``, as compose does."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["bare"] or match["name"]
        value = environment.get(name)
        operator = match["operator"]
        if operator is None:
            return value or ""
        unset = value is None or (operator.startswith(":") and value == "")
        if operator.endswith("-"):
            return match["argument"] if unset else str(value)
        if unset:
            raise InterpolationError(f"required variable {name} is missing a value: {match['argument']}")
        return str(value)

    return _VARIABLE.sub(replace, text)


def _interpolate_all(value: Any, environment: dict[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, environment)
    if isinstance(value, dict):
        return {key: _interpolate_all(item, environment) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate_all(item, environment) for item in value]
    return value


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines of a ``.env`` file (``#`` comments and blank lines ignored)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or "=" not in stripped:
            continue
        name, value = stripped.split("=", 1)
        values[name.strip()] = value.strip().strip("'\"")
    return values


def _pass_environment_through(config: Any, environment: dict[str, str]) -> None:
    """A service's ``environment`` entry without a value takes the variable from the environment
    running compose (dropped when unset there), as compose does."""
    services = config.get("services") if isinstance(config, dict) else None
    for service in (services or {}).values():
        variables = service.get("environment") if isinstance(service, dict) else None
        if isinstance(variables, dict):
            service["environment"] = {
                name: environment[name] if value is None else value
                for name, value in variables.items()
                if value is not None or name in environment
            }


@cache
def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema (check-jsonschema's vendored copy)."""
    files = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((files / "compose-spec.json").read_text())
    return schema


@dataclass(frozen=True)
class ConfigResult:
    """What ``compose config`` gives: an exit status, the resolved file as YAML, the errors."""

    returncode: int
    stdout: str
    stderr: str


def compose_config(compose_file: Path, environment: dict[str, str]) -> ConfigResult:
    """``compose_file`` parsed, interpolated from ``environment`` and validated, like ``compose config``."""
    try:
        loaded = yaml.safe_load(compose_file.read_text())
        resolved = _interpolate_all(loaded, environment)
        _pass_environment_through(resolved, environment)
        validator = jsonschema.validators.validator_for(compose_schema())(compose_schema())
        errors = sorted(validator.iter_errors(resolved), key=lambda error: list(error.absolute_path))
        if errors:
            where = ".".join(str(part) for part in errors[0].absolute_path) or "(top level)"
            return ConfigResult(1, "", f"{compose_file.name}: {where}: {errors[0].message}")
    except (yaml.YAMLError, InterpolationError) as exc:
        return ConfigResult(1, "", f"{compose_file.name}: {exc}")
    return ConfigResult(0, yaml.safe_dump(resolved, sort_keys=False), "")
