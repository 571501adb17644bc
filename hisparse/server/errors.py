"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the HTTP status to answer."""

from __future__ import annotations

import json
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


FIELD_FIRST = re.compile(r"^Value error, ([a-z_]+): ")


class APIError(Exception):
    """An error answered to the client: `status`, and the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(message: str, kind: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error echoes client text, which must render whatever it holds."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(e: APIError) -> JSONResponse:
    """The error as a response; a server error (5xx) also closes the connection (`Connection: close`), as the
    state of whatever failed is unknown, and the client learns it before reusing the connection."""
    headers = {"Connection": "close"} if e.status >= 500 else None
    return ErrorJSON(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=headers)


def validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's body validation errors -> one 400 whose message and param name the first bad field."""
    parts, param = [], None
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            parts.append(f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        named = FIELD_FIRST.match(err.get("msg", ""))   # a check across fields names its field first
        param = param or where or (named.group(1) if named else None)
        parts.append(f"{where}: {err.get('msg')}" if where else f"body: {err.get('msg')}")
    return APIError(400, "; ".join(parts) or "invalid request", param)
