"""POST /v1/chat/completions for every image model, in upstream vLLM-Omni's shape: HTTP <-> the images routes' path.

The prompt is the last user message's text (its text parts joined by newlines); its `image_url`
parts (base64 data URLs) are the input images of an edit model, passed on as compressed bytes like
/v1/images/edits uploads. Other messages (system, assistant, earlier user turns) are read for their
role only: a diffusion model has no conversation. The sampling fields are the images routes' (the
declared ones, `height` and `width` also apart from `size`), at the top level or in a literal
`extra_body` object. The answer is a chat completion whose message content is one `image_url`
part per image. Limits, the body's reading, the queue place, the connection watch and the errors are the images
routes' own (images.py): nothing here is model-specific.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.diffusion.request import RequestError
from vllm_omni.entrypoints.openai.errors import ApiError, request_error
from vllm_omni.entrypoints.openai.protocol import (
    ChatAssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatImagePart,
    ChatImageURL,
)
from vllm_omni.entrypoints.openai.routes.bodies import (
    BodySpec,
    body_spec,
    check_text_values,
    decode_data_url,
    parse_fields,
    read_json_object,
)
from vllm_omni.entrypoints.openai.routes.images import (
    finish_image_job,
    image_params,
    result_fields,
    submit_image_job,
)

router = APIRouter()

EXTRA_BODY = "extra_body"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_CHAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema()}},
    }
}
_INDEXED_IMAGE = re.compile(r"image\[(\d+)\]")  # the engine names the i-th of several input images so


@dataclass(frozen=True)
class _UserTurn:
    """The last user message, as a request: its prompt and images, and where each is in the body."""

    prompt: str
    content_param: str  # "messages[2].content"
    images: list[bytes]
    image_params: list[str]  # "messages[2].content[1].image_url.url", one per image

    def param_of_image(self, message: str) -> str:
        """The part the engine's message about "image" or "image[i]" is about."""
        indexed = _INDEXED_IMAGE.match(message)
        if indexed and int(indexed.group(1)) < len(self.image_params):
            return self.image_params[int(indexed.group(1))]
        return self.image_params[0] if len(self.image_params) == 1 else self.content_param


@router.post("/v1/chat/completions", response_model=ChatCompletion, openapi_extra=_CHAT_BODY)
async def completions(http: Request) -> JSONResponse:
    settings = http.app.state.settings
    spec = body_spec(http, max_files=settings.engine.limits.max_input_images, data_urls=True)
    fields = _merge_extra_body(await read_json_object(http, spec), spec)
    body = parse_fields(ChatCompletionRequest, fields)
    _refuse_what_only_an_llm_gives(body)
    turn = _last_user_turn(body.messages, spec)
    params = image_params(http, body, turn.prompt, turn.images)
    bad_input = partial(_bad_input, turn=turn, body=body)
    job = await submit_image_job(http, params, bad_input)
    fmt = body.output_format or "png"
    output, encoded = await finish_image_job(http, job, bad_input, fmt, body.output_compression)
    parts = [ChatImagePart(image_url=ChatImageURL(url=f"data:image/{fmt};base64,{b64}")) for b64 in encoded]
    completion = ChatCompletion(
        id=job.id,
        created=int(time.time()),
        model=body.model or settings.served_model_name or settings.engine.model,
        choices=[ChatChoice(message=ChatAssistantMessage(content=parts))],
        seeds=output.seeds,
        **result_fields(output),
    )
    return JSONResponse(completion.model_dump(), headers={"X-Request-Id": job.id})


def _merge_extra_body(fields: dict[str, Any], spec: BodySpec) -> dict[str, Any]:
    """The body's fields with those of a literal `extra_body` object at the top level (the openai client merges
    its `extra_body` itself; some clients send the object)."""
    extra = fields.pop(EXTRA_BODY, None)
    if extra is None:
        return fields
    if not isinstance(extra, dict):
        raise ApiError(400, f"{EXTRA_BODY} must be an object of request fields", param=EXTRA_BODY)
    for key in extra:
        if key in fields:
            raise ApiError(400, f"{key} is given twice: at the top level and in {EXTRA_BODY}", param=key)
    check_text_values(extra, spec)
    return {**fields, **extra}  # an extra_body inside extra_body is then an unknown field


def _refuse_what_only_an_llm_gives(body: ChatCompletionRequest) -> None:
    """A 400 for keys that ask for an answer an image model cannot give (the harmless ones are ignored)."""
    if body.stream:
        raise ApiError(400, "stream=true is not supported: the images come back whole, in one answer", "stream")
    if body.logprobs or body.top_logprobs:
        param = "logprobs" if body.logprobs else "top_logprobs"
        raise ApiError(400, f"{param} is not supported: an image model samples no tokens", param=param)
    for param in ("tools", "functions"):
        if getattr(body, param):
            raise ApiError(400, f"{param} is not supported: an image model calls no tools", param=param)
    if body.audio is not None:
        raise ApiError(400, "audio is not supported: the answer is images", param="audio")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(
            400, "response_format is not supported: the answer is images (only {'type': 'text'})", "response_format"
        )


def _last_user_turn(messages: list[Any], spec: BodySpec) -> _UserTurn:
    """The prompt and images of the last user message; a 400 naming the message or part at fault."""
    last_user = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", param=f"messages[{i}].role"
            )
        if role == "user":
            last_user = i
    if last_user is None:
        raise ApiError(400, "messages has no user message: the prompt is the last user message's text", "messages")
    where = f"messages[{last_user}].content"
    content = messages[last_user].get("content")
    if isinstance(content, str):
        return _UserTurn(content, where, [], [])
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text and image_url parts", param=where)
    texts: list[str] = []
    images: list[bytes] = []
    image_params: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, f"{at}.text must be a string", param=f"{at}.text")
            if len(text.encode("utf-8", "surrogatepass")) > spec.field_bytes:
                raise ApiError(400, f"{at}.text is larger than the limit of {spec.field_bytes} bytes", f"{at}.text")
            texts.append(text)
        elif kind == "image_url":
            image_url = part.get("image_url")
            if not isinstance(image_url, dict):
                raise ApiError(400, f"{at}.image_url must be an object {{'url': 'data:...'}}", f"{at}.image_url")
            images.append(decode_data_url(image_url.get("url"), spec, f"{at}.image_url.url"))
            image_params.append(f"{at}.image_url.url")
        elif isinstance(part, dict):
            raise ApiError(400, f"{at}.type {kind!r} is not supported: parts are 'text' or 'image_url'", f"{at}.type")
        else:
            raise ApiError(400, f"{at} must be an object with a type ('text' or 'image_url')", param=at)
    return _UserTurn("\n".join(texts), where, images, image_params)


def _bad_input(exc: RequestError, turn: _UserTurn, body: ChatCompletionRequest) -> ApiError:
    """The engine's verdict, naming the part of `messages` the prompt or an image came from, and `width` or
    `height` where the request gave them apart (else `size`)."""
    if exc.param == "prompt":
        return ApiError(400, f"{turn.content_param}: {exc}", param=turn.content_param)
    if exc.param == "image":
        param = turn.param_of_image(str(exc))
        return ApiError(400, f"{param}: {exc}", param=param)
    if exc.param in ("width", "height") and (body.width is not None or body.height is not None):
        return ApiError(400, str(exc), param=exc.param)
    return request_error(exc, body.size)
