"""Request bodies read with a byte cap: multipart (or url-encoded) forms and JSON objects.

The cap is checked against Content-Length before anything is read and against the bytes that
actually arrive (chunked uploads have no length), so an upload cannot fill the server's memory.
Used by the routes that take uploads: images.py (edits) and videos.py (`input_reference`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData

from vllm_omni.entrypoints.openai.errors import ApiError
from vllm_omni.entrypoints.openai.scheduler import one_line


def capped_request(http: Request, body_cap: int, param: str | None) -> Request:
    """`http` reading at most `body_cap` bytes of body: more is a 413 naming `param`."""
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > body_cap:
        raise ApiError(413, f"request body is {length} bytes; at most {body_cap} accepted", param=param)
    received = 0

    async def receive_within_cap() -> dict:
        nonlocal received
        message = await http.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > body_cap:
                raise ApiError(413, f"request body exceeds {body_cap} bytes", param=param)
        return message

    return Request(http.scope, receive_within_cap)


async def read_form(http: Request, body_cap: int, param: str | None, max_files: int, max_fields: int = 64) -> FormData:
    """The multipart or url-encoded form (the caller closes it); a 400 when it does not parse."""
    try:
        return await capped_request(http, body_cap, param).form(max_files=max_files, max_fields=max_fields)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - starlette raises HTTPException / MultiPartException variants
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
        raise ApiError(400, f"cannot parse the multipart body: {detail}") from None


async def read_json_object(http: Request, body_cap: int, param: str | None) -> dict[str, Any]:
    """The JSON object in the body; a 400 for anything else."""
    raw = await capped_request(http, body_cap, param).body()
    try:
        value = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid JSON: it is not UTF-8 text") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object of request fields (Content-Type: application/json)")
    return value
