"""JSON responses encoded with orjson, and pre-encoded bodies passed through as they are."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from resq import jsonutil


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``content`` encoded as JSON."""
    return Response(
        jsonutil.dumps(content), status_code=status_code, headers=headers, media_type="application/json"
    )


def raw_json_response(body: bytes, status_code: int = 200) -> Response:
    """A body that is JSON already (a stored Response), sent byte for byte."""
    return Response(body, status_code=status_code, media_type="application/json")
