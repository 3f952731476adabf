"""Structural rules: roles import resq/ only; the API never imports torch or transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("api", "workers", "gpu_worker")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("role", ROLES)
def test_a_role_never_imports_another(role: str) -> None:
    others = set(ROLES) - {role}
    for path in (ROOT / role).rglob("*.py"):
        assert not imported_modules(path) & others, f"{path} imports another role"


def test_shared_core_imports_no_role() -> None:
    for path in (ROOT / "resq").rglob("*.py"):
        if path.name in ("cli.py",):  # the launcher starts roles, lazily, by design
            continue
        assert not imported_modules(path) & set(ROLES), f"{path} imports a role"


def test_api_and_postprocess_workers_load_without_torch_or_transformers() -> None:
    code = (
        "import sys, api.main, workers.main; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"imported: {result.stdout} {result.stderr[-2000:]}"


def test_celery_is_configured_with_json_only() -> None:
    from resq.celery_app import make_celery
    from resq.settings import Settings

    conf = make_celery(Settings()).conf
    assert conf.task_serializer == "json"
    assert list(conf.accept_content) == ["json"]
    assert conf.result_serializer == "json"
