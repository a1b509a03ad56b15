"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every answer that is not a 2xx.

`ApiError` is what the routes raise (routes/bodies.py for bodies that are late, cut short, too
large or unparsable); `install_error_handlers` makes the app answer everything else in the same
shape too: the scheduler's refusals (503, 429 with Retry-After), bad input found by the engine
(`RequestError`, 400 with its `param`; an adapter not served, `LoraNotFound`, 404), pydantic's
validation errors, Starlette's own 404 / 405, a client gone mid-body (one log line), and
unexpected exceptions (500, one line; the traceback goes to the log). `job_error` maps a failed or
cancelled job to its answer (a request that ran out of device memory: 507, code "out_of_memory").
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vllm_omni.diffusion.engine.adapters import LoraNotFound
from vllm_omni.diffusion.engine.job import JobError, one_line
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.engine.queue_admission import InternalError, QueueFull
from vllm_omni.diffusion.engine.request_fields import FIELDS_BY_NAME
from vllm_omni.diffusion.request import RequestError
from vllm_omni.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it, but the access log does
INSUFFICIENT_STORAGE = 507  # a request that ran out of device memory (the closest standard status)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    CLIENT_CLOSED: "cancelled",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = ERROR_TYPES.get(self.status, "server_error")
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def request_error(exc: RequestError, size: str | None = None) -> ApiError:
    """The engine's RequestError as a 400; height and width travel in `size` over HTTP. An adapter that is not
    served is a 404 with code "model_not_found" (vLLM's answer for a model it does not serve)."""
    param, message = exc.param, str(exc)
    if isinstance(exc, LoraNotFound):
        return ApiError(404, message, param=param, code="model_not_found")
    if param in FIELDS_BY_NAME and FIELDS_BY_NAME[param].in_size:
        param = "size"
        if size is not None:
            message = f"size {size!r}: {message}"
    return ApiError(400, message, param=param)


def scheduler_error(exc: Exception) -> ApiError:
    """The scheduler's refusals of `submit` as answers."""
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), code=exc.state)
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, InternalError):
        return ApiError(500, str(exc))
    raise TypeError(f"not a scheduler error: {exc!r}")


def job_error(error: JobError, size: str | None = None) -> ApiError:
    """A job that did not complete, as the answer to the request that made it."""
    if error.code == "invalid_request":
        return request_error(RequestError(error.message, error.param), size)
    if error.code == "shutting_down":
        return ApiError(503, error.message, code="shutting_down")
    if error.code == "cancelled":
        return ApiError(CLIENT_CLOSED, error.message, code="cancelled")
    if error.code == "out_of_memory":  # this request's size, not the server's state: 507, not 503
        return ApiError(INSUFFICIENT_STORAGE, error.message, code="out_of_memory")
    return ApiError(500, error.message)


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic errors -> one 400 naming the first bad field (the top-level one: not a union member's tag)."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    name = loc[0] if loc else None  # None: the body as a whole (param null, as for every fault of the whole body)
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {name!r}", param=name)
    if first.get("type") == "missing":
        return ApiError(400, f"{name or 'the request body'} is required", param=name)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{name or 'the request body'}: {message}", param=name)


def _http_exception(request: Request, exc: StarletteHTTPException) -> ApiError:
    """Starlette's and FastAPI's own refusals, reworded."""
    if exc.status_code == 404:
        return ApiError(404, f"no such endpoint: {request.method} {request.url.path}")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        hint = f"; use {allowed}" if allowed else ""
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}{hint}", headers=exc.headers)
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return request_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_exception(request, exc).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # Where the routes' body reader did not see it first: a client gone is not a server error.
        logger.info("%s %s: the client disconnected", request.method, request.url.path)
        return ApiError(CLIENT_CLOSED, "the client disconnected", code="cancelled").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return ApiError(500, f"internal error: {one_line(f'{type(exc).__name__}: {exc}')}").response()
