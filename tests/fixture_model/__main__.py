"""``python -m tests.fixture_model [--out DIR]``: build (or find) the fixture model, print its path."""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.fixture_model.build import ensure_fixture_model


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, ensure the model exists and print its directory on stdout."""
    parser = argparse.ArgumentParser(prog="python -m tests.fixture_model", description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="cache root to build into (default: $RESQ_FIXTURE_CACHE or ~/.cache/resq/fixture-model)",
    )
    args = parser.parse_args(argv)
    print(ensure_fixture_model(args.out))


if __name__ == "__main__":
    main()
