"""The docs stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from resq.settings_doc import BEGIN_MARKER, END_MARKER, REGIONS, regenerate, replace_table

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("README.md", ".env.example", "docker-compose.yml", "deploy/compose.gpu-host.yml")


def test_readme_settings_table_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert BEGIN_MARKER in readme and END_MARKER in readme
    assert replace_table(readme) == readme, "stale: run python -m resq.settings_doc --write README.md"


@pytest.mark.parametrize("name", GENERATED)
def test_generated_settings_regions_are_current(name: str) -> None:
    text = (ROOT / name).read_text()
    assert any(region.begin in text for region in REGIONS), f"{name} has no generated region"
    assert regenerate(text) == text, f"{name} is stale: run `make docs`"


def test_readme_shows_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme


def registered_metrics() -> set[str]:
    """Every resq metric the roles define (importing a role's metrics module registers them)."""
    from prometheus_client import REGISTRY

    import api.metrics
    import gpu_worker.metrics
    import resq.postprocess.metrics

    assert api.metrics.REQUESTS and gpu_worker.metrics.GENERATED_TOKENS and resq.postprocess.metrics.LAG
    return {family.name for family in REGISTRY.collect() if family.name.startswith("resq_")}


def test_the_operations_guide_lists_exactly_the_metrics_there_are() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(resq_[a-z_]+)`", guide, flags=re.MULTILINE))
    # prometheus-client names a counter's family without its `_total` sample suffix.
    documented = {name.removesuffix("_total") for name in documented}
    assert documented == registered_metrics()


@pytest.mark.parametrize("page", ["architecture.md", "scaling.md", "operations.md", "clients.md"])
def test_docs_pages_exist_and_the_readme_links_them(page: str) -> None:
    assert (ROOT / "docs" / page).is_file()
    assert f"docs/{page}" in (ROOT / "README.md").read_text()


def _defines(module: str, test: str) -> bool:
    """Whether ``module`` defines ``test`` (a trailing ``*`` matches any test with that prefix)."""
    name = re.escape(test.rstrip("*")) + (r"\w*" if test.endswith("*") else "")
    return re.search(rf"def {name}\(", (ROOT / module).read_text()) is not None


def test_every_test_the_clients_page_names_exists() -> None:
    """docs/clients.md says which test runs each snippet: each named test must be there."""
    page = (ROOT / "docs" / "clients.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+\*?))?", page)
    assert len(named) >= 8, named
    for module, test in named:
        assert (ROOT / module).is_file(), f"docs/clients.md names {module}, which does not exist"
        if test:
            assert _defines(module, test), f"docs/clients.md names {module}::{test}, which does not exist"
    modules = {module for module, _ in named}
    for test in re.findall(r"`::(\w+)`", page):  # "`::test`" continues the module named before it
        assert any(_defines(module, test) for module in modules), f"docs/clients.md names ::{test}"
