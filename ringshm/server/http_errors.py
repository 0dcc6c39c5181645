"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure of
``ringshm.server.app``: an ``ApiError`` as it says, a pydantic validation error as a 400 naming the field (the
deepest path of the first field at fault, e.g. ``stop[1]``), Starlette's HTTP errors (404, 405, 413) and anything
unhandled as a 500 whose body says nothing of the cause (the log does)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringshm.server.openai_schema import ApiError, bad_request

log = logging.getLogger("ringshm.server.app")


def _field_path(loc) -> tuple[str | None, str]:
    """(top-level field, readable path such as ``stop[1]`` or ``messages[0].role``) of a pydantic error
    location, without "body" and pydantic's union branch tags (``constrained-str``, ``list[int]``)."""
    parts = [x for x in loc if x != "body"]
    out = ""
    for x in parts:
        if isinstance(x, int):
            out += f"[{x}]"
        elif "[" in x or "-" in x or x in ("str", "int", "float", "bool", "list", "dict"):
            continue
        else:
            out += f".{x}" if out else x
    field = next((x for x in parts if isinstance(x, str)), None)
    return field, out


def add_error_handlers(app: FastAPI, too_large: Callable[[], JSONResponse]) -> None:
    """Register the handlers of the module docstring on ``app``; ``too_large()`` is its 413 answer."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:
            # Of the errors about the first field, the deepest (a union's matching branch, e.g. stop[1]).
            field_of = [_field_path(e.get("loc", ())) for e in errs]
            same = [e for e, f in zip(errs, field_of) if f[0] == field_of[0][0]]
            best = max(same, key=lambda e: len(_field_path(e.get("loc", ()))[1]))
            param, path = _field_path(best.get("loc", ()))
            message = f"{path or 'body'}: {best.get('msg', 'invalid value')}"
        return JSONResponse(bad_request(message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 413:
            return too_large()
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(ApiError(500, "internal server error", "server_error").body(), status_code=500)
