"""Response bodies as text: JSON made in small pieces (so one large body never holds the GIL for long) and
server-sent events."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

SCALARS_PER_DUMP = 4096    # list elements per json.dumps call when they are numbers or strings
CONTAINERS_PER_DUMP = 64   # ... when they are lists or dicts (logprob entries)


def dumps(obj: Any) -> str:
    """JSON text of obj, made by many small json.dumps calls: one call holds the GIL for its whole argument (a
    million-token body: a quarter of a second), and the event loop must get it back within milliseconds."""
    out: list[str] = []

    def nested(v: Any) -> bool:   # a dict holding containers, or a long list: encoded piece by piece
        return (isinstance(v, dict) and any(isinstance(x, (dict, list)) for x in v.values())) or (
            isinstance(v, list) and len(v) > CONTAINERS_PER_DUMP)

    def encode(v: Any) -> None:
        if isinstance(v, dict) and nested(v):
            out.append("{")
            for i, (k, x) in enumerate(v.items()):
                out.append(("," if i else "") + json.dumps(str(k), ensure_ascii=False) + ":")
                encode(x)
            out.append("}")
        elif isinstance(v, list) and any(nested(x) for x in v[:CONTAINERS_PER_DUMP]):
            out.append("[")
            for i, x in enumerate(v):
                out.append("," if i else "")
                encode(x)
            out.append("]")
        elif isinstance(v, list) and len(v) > CONTAINERS_PER_DUMP:
            step = CONTAINERS_PER_DUMP if any(isinstance(x, (dict, list)) for x in v) else SCALARS_PER_DUMP
            out.append("[" + ",".join(json.dumps(v[k:k + step], ensure_ascii=False, allow_nan=False)[1:-1]
                                      for k in range(0, len(v), step)) + "]")
        else:
            out.append(json.dumps(v, ensure_ascii=False, allow_nan=False))
    encode(obj)
    return "".join(out)


def sse(obj: dict | str) -> str:
    """One server-sent event: `obj` as JSON (a string, such as [DONE], as it is)."""
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n"


def render(obj: dict) -> Response:
    """A JSON response rendered by the caller (in the worker pool: a body of a million tokens takes seconds)."""
    return Response(dumps(obj).encode(), media_type="application/json")
