"""The docs stay true to the code."""

from __future__ import annotations

from pathlib import Path

from resq.settings_doc import BEGIN_MARKER, END_MARKER, replace_table

ROOT = Path(__file__).resolve().parents[2]


def test_readme_settings_table_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert BEGIN_MARKER in readme and END_MARKER in readme
    assert replace_table(readme) == readme, "stale: run python -m resq.settings_doc --write README.md"


def test_readme_shows_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
