"""The settings table of the docs, generated from :class:`resq.settings.Settings`.

``python -m resq.settings_doc`` prints it (``--write README.md`` updates it); ``tests/unit/test_docs.py`` fails when
the copy in the README is stale.
"""

from __future__ import annotations

from resq.settings import Settings

BEGIN_MARKER = "<!-- settings-table:begin -->"
END_MARKER = "<!-- settings-table:end -->"


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    value = field.default
    if value is None:
        return "(unset)"
    return f"`{value}`"


def settings_table() -> str:
    """A Markdown table: variable, default, meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `RESQ_{name.upper()}` | {_default(name)} | {description} |")
    return "\n".join(rows)


def replace_table(document: str) -> str:
    """``document`` with the text between the markers replaced by the current table."""
    head, rest = document.split(BEGIN_MARKER, 1)
    _, tail = rest.split(END_MARKER, 1)
    return f"{head}{BEGIN_MARKER}\n{settings_table()}\n{END_MARKER}{tail}"


def main() -> None:
    """Print the table, or with ``--write FILE`` update it in place."""
    import sys
    from pathlib import Path

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        path = Path(sys.argv[2])
        text = path.read_text()
        path.write_text(replace_table(text))
    else:
        print(settings_table())


if __name__ == "__main__":
    main()
