"""Every error the HTTP API answers, as OpenAI's error body: a refused request (:class:`ApiError`), FastAPI's
validation and routing errors, a body that is not JSON, and unexpected exceptions (a 500)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blend.errors import KVBlendError
from blend.serve.intake import ApiError
from blend.serve.jobs import ShuttingDownError
from blend.serve.protocol import ErrorType, error_body
from blend.serve.schemas import FieldError

log = logging.getLogger("blend.serve.app")  # the server's records keep one logger name

FASTAPI_BODY_ERROR = "There was an error parsing the body"  # FastAPI's detail for a body json.loads refused
# pydantic's error types for a body that is not an object at all (a model validator's errors have its location too)
BODY_NOT_AN_OBJECT = ("missing", "model_attributes_type", "model_type", "dict_type")


def json_error(status: int, message: str, kind: ErrorType, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error response.

    Args:
        status: the HTTP status.
        message, kind, param, code: the error object's fields.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).

    Returns:
        The response.
    """
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def error_for(error: BaseException) -> ApiError:
    """The API error a request's failure in the scheduler becomes.

    Args:
        error: what the request failed with.

    Returns:
        400 for a request the engine refuses, 503 ``shutting_down`` for a stopping server, else a 500.
    """
    if isinstance(error, KVBlendError):  # the request asked for something the engine refuses
        return ApiError(400, str(error))
    if isinstance(error, ShuttingDownError):  # not the request's fault, nor a bug: another replica may answer
        return ApiError(503, str(error), ErrorType.SERVER, code="shutting_down")
    log.error("request failed: %s: %s", type(error).__name__, error)
    return ApiError(500, f"internal error: {type(error).__name__}", ErrorType.SERVER)


def validation_error(exc: RequestValidationError) -> ApiError:
    """One 400 naming every offending field (``param``: the first).

    Args:
        exc: FastAPI's validation error of a request body.

    Returns:
        The 400 error: malformed JSON, a body that is not an object, or every field error joined.
    """
    parts, params = [], []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return ApiError(400, f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        if tuple(err.get("loc", ())) == ("body",) and err.get("type") in BODY_NOT_AN_OBJECT:  # [1, 2], or nothing
            return ApiError(400, "the request body must be a JSON object" + (
                " (it is empty)" if err.get("type") == "missing" else ""))
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError) and not loc:  # a request-level check that names its field
            loc = cause.param
        params.append(loc or None)
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return ApiError(400, "invalid request: " + "; ".join(parts), param=params[0] if params else None)


def not_json_error(content_type: str | None) -> ApiError | None:
    """The error of a body sent under a Content-Type that is not JSON (None for a JSON one).

    FastAPI parses a body only under ``application/json`` (or ``+json``) and hands any other's bytes to
    validation, whose "body: Input should be a valid dictionary" did not say what was wrong: a JSON body sent
    by ``curl -d`` (form-encoded) or without a Content-Type. It stays refused (a web page may send
    ``text/plain`` to another origin without asking), with the reason.

    Args:
        content_type: the request's Content-Type header, or None.

    Returns:
        The 400, or None when the Content-Type is JSON.
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    got = f"got {content_type[:80]!r}" if content_type else "no Content-Type was sent"
    return ApiError(400, f"the request body must be JSON sent with 'Content-Type: application/json' ({got})",
                    code="unsupported_content_type")


def body_parse_error(cause: BaseException | None) -> str:
    """The message of a body JSON parsing refused other than as malformed JSON (FastAPI says only that it
    could not parse the body).

    Args:
        cause: what ``json.loads`` raised.

    Returns:
        The message: bytes that are not UTF-8 and nesting too deep for the parser named as such.
    """
    if isinstance(cause, UnicodeDecodeError):
        return f"malformed JSON: the body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at offset " \
               f"{cause.start})"
    if isinstance(cause, RecursionError):
        return "malformed JSON: arrays or objects nested too deeply"
    return f"malformed JSON: {FASTAPI_BODY_ERROR.lower()}"


def add_error_handlers(app: FastAPI) -> None:
    """Every error the API raises, FastAPI's validation and routing errors and unexpected exceptions
    as OpenAI-style JSON error bodies.

    Args:
        app: the FastAPI app.
    """

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return json_error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = not_json_error(request.headers.get("content-type")) or validation_error(exc)
        return json_error(err.status, err.message, err.kind, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST
        message = str(exc.detail)
        if exc.status_code == 400 and message == FASTAPI_BODY_ERROR:
            message = body_parse_error(exc.__cause__)
        return json_error(exc.status_code, message, kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return json_error(500, f"internal error: {type(exc).__name__}", ErrorType.SERVER)
