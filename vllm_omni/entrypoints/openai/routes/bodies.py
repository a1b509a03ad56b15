"""Request bodies read against a deadline and one byte limit per field: multipart or url-encoded forms, JSON objects.

Used by the routes that take bodies (images.py, chat.py, videos.py). The limits are the same in JSON and in forms:
- a text field's value: at most `BodyLimits.max_field_bytes`, as UTF-8 (body_limits.py);
- a file (a form's file part, or a data URL's bytes): at most `EngineLimits.max_upload_bytes`;
- the whole body: at most `BodySpec.cap`, what the largest valid request needs (413 beyond it: at
  once, unread, when its Content-Length says so).
A refusal names the field it is about (`param`): the one too large, the one a multipart body was cut
in, the one whose JSON value does not parse. A fault of the body as a whole (no Content-Type, too
large by its header, JSON cut short or not UTF-8, late) has `param` null. A multipart body without
its closing boundary is a 400: none of it is used.

A body is read before its request takes a queue place (the route submits once it has arrived), and
only when the request could be queued: a loading server or a full queue is answered first. At most
`BodyLimits.max_reads` bodies are read at once (`BodyReads`; more get 429): that bounds the memory
of uploads in flight. The whole body must arrive within `BodyLimits.read_timeout_s` of the reader
starting, or it is a 408 and the connection closes. A client that disconnects mid-body is logged in
one line. A body refused before its end is read to its end and dropped (within the same deadline
and cap), so the client reads the answer rather than a reset; one refused from its headers alone is
not read, and its connection closes after the answer.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

from fastapi import Request
from pydantic import BaseModel, ValidationError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, QuerystringParser, parse_options_header

from vllm_omni.diffusion.engine.job import one_line
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.engine.queue_admission import QueueFull
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.entrypoints.openai.errors import CLIENT_CLOSED, ApiError, scheduler_error, validation_error
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MAX_FORM_FIELDS = 64
DATA_URL_SLACK_CHARS = 256  # 'data:image/png;base64,' and the JSON around a data URL
NOT_A_JSON_OBJECT = "the request body must be a JSON object of request fields (Content-Type: application/json)"

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class BodySpec:
    """What one endpoint's body may hold (`body_spec` builds it from the server's settings)."""

    file_field: str | None  # the field that carries files ('image', 'input_reference'); None: no files
    max_files: int
    data_urls: bool  # the endpoint also takes its files as text: base64 data URLs (4/3 of their bytes)
    file_bytes: int  # each file, decoded (--max-upload-bytes)
    field_bytes: int  # each text field's value, UTF-8
    timeout_s: float  # the whole body (--body-read-timeout)

    @property
    def file_as_text_chars(self) -> int:
        """The most characters of a file given as text (a data URL), or of any value of a file field."""
        return 4 * math.ceil(self.file_bytes / 3) + DATA_URL_SLACK_CHARS if self.data_urls else self.field_bytes

    @property
    def cap(self) -> int:
        """The largest body of a valid request: its files (as data URLs where they may be), the prompt and the
        negative prompt at their limit, and as much again for the short fields and the framing."""
        return self.max_files * max(self.file_bytes, self.file_as_text_chars) + 3 * self.field_bytes

    def limit(self, param: str) -> int:
        """The most bytes a text value of the field `param` may have."""
        return self.file_as_text_chars if param == self.file_field else self.field_bytes

    def too_large(self, param: str) -> ApiError:
        if param == self.file_field:
            return ApiError(400, f"{param} is larger than the upload limit of {self.file_bytes} bytes", param=param)
        return ApiError(
            400, f"{param} is larger than the limit of {self.field_bytes} bytes for a text field", param=param
        )

    def body_too_large(self, param: str | None, declared: int | None = None) -> ApiError:
        where = f" (it passed that in {param!r})" if param else ""
        if declared is not None:
            where = f" (its Content-Length is {declared})"
        return ApiError(
            413, f"the request body is larger than {self.cap} bytes, the most a request takes{where}", param
        )


def body_spec(http: Request, file_field: str | None = None, max_files: int = 0, data_urls: bool = False) -> BodySpec:
    settings = http.app.state.settings
    return BodySpec(
        file_field,
        max_files,
        data_urls,
        settings.engine.limits.max_upload_bytes,
        settings.bodies.max_field_bytes,
        settings.bodies.read_timeout_s,
    )


def media_type(http: Request) -> str:
    """The Content-Type's media type, lower-case and without its parameters ('' when there is none)."""
    kind, _ = parse_options_header(http.headers.get("content-type"))
    return kind.decode("latin-1")


def body_media_type(http: Request, accepted: str) -> str:
    """The body's media type (`media_type`); a 400 when the request has no Content-Type: a body of no declared
    type is not guessed at (`accepted`: what the route takes, for the message)."""
    kind = media_type(http)
    if not kind:
        raise unread(ApiError(400, f"the request has no Content-Type: {http.method} {http.url.path} takes {accepted}"))
    return kind


def is_json(kind: str) -> bool:
    """A JSON media type."""
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def unread(error: ApiError) -> ApiError:
    """`error` for a request whose body is not read to its end: the connection closes after the answer, so what
    the client still sends is never read as its next request."""
    error.headers = {**(error.headers or {}), "Connection": "close"}
    return error


def field_param(name: str) -> str:
    """A form field's name as errors name it: `image[]`, `image[0]` -> `image`; `input_reference[image_url]` ->
    `input_reference`."""
    return name.split("[", 1)[0] or name


def parse_fields(model: type[Model], fields: dict[str, Any]) -> Model:
    """The body's fields as `model`; a 400 naming the first bad field."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


# ---- reading ------------------------------------------------------------------------------------


class BodyReads:
    """The bodies being read now, at most `limit` at once (--max-body-reads) on every route together: a request
    takes its queue place only once its body is read, so this bounds the memory of uploads in flight. One per app
    (app.state.body_reads)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._deadlines: list[float] = []  # each body's, on the event loop's clock

    @property
    def active(self) -> int:
        return len(self._deadlines)

    @contextlib.contextmanager
    def slot(self, deadline: float) -> Iterator[None]:
        """Held while one body is read (it ends by `deadline`); a 429 when every slot is taken."""
        if len(self._deadlines) >= self.limit:
            wait = min(self._deadlines) - asyncio.get_running_loop().time()  # a slot is free by then at the latest
            raise unread(
                ApiError(
                    429,
                    f"{self.limit} request bodies are being read already, the most at once (--max-body-reads); "
                    "retry later",
                    code="too_many_bodies",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
            )
        self._deadlines.append(deadline)
        try:
            yield
        finally:
            self._deadlines.remove(deadline)


@contextlib.contextmanager
def _reading(http: Request, spec: BodySpec) -> Iterator[_BodyStream]:
    """The body as a stream, once its headers and the queue allow it to be read; a read slot is held meanwhile.

    Refused unread: a Content-Length over the cap (413), a server that takes no work or a full queue (503, 429:
    the request could not be queued once its body arrived), every read slot taken (429)."""
    declared = _declared_length(http)
    if declared is not None and declared > spec.cap:
        raise unread(spec.body_too_large(None, declared))
    scheduler: Scheduler = http.app.state.scheduler
    try:
        scheduler.check_accepting()
        scheduler.check_capacity()
    except (Unavailable, QueueFull) as exc:
        raise unread(scheduler_error(exc)) from None
    stream = _BodyStream(http, spec)
    with http.app.state.body_reads.slot(stream.deadline):
        yield stream


def _declared_length(http: Request) -> int | None:
    """The Content-Length header's value (the HTTP server has refused a malformed one); None without it."""
    length = http.headers.get("content-length")
    return int(length) if length is not None and length.strip().isdigit() else None


class _BodyStream:
    """The body's chunks as they arrive, within the deadline."""

    def __init__(self, http: Request, spec: BodySpec) -> None:
        self.http, self.spec = http, spec
        self.deadline = asyncio.get_running_loop().time() + spec.timeout_s
        self.received = 0
        self.ended = False

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end; a 408 past the deadline, a 499 when the client leaves."""
        while not self.ended:
            message = await self._receive()
            if message is None:
                raise self._timed_out()
            if message["type"] == "http.disconnect":
                raise self._disconnected()
            chunk = message.get("body", b"")
            self.ended = not message.get("more_body", False)
            self.received += len(chunk)
            if chunk:
                return chunk
        return None

    async def refuse(self, error: ApiError) -> ApiError:
        """`error`, once the rest of the body has been read and dropped (within the deadline, and up to twice the
        cap in all) so the client reads it; when the body does not end by then the answer closes the connection."""
        while not self.ended and self.received <= 2 * self.spec.cap:
            message = await self._receive()
            if message is None or message["type"] == "http.disconnect":
                break
            self.received += len(message.get("body", b""))
            self.ended = not message.get("more_body", False)
        return unread(error) if not self.ended else error

    async def _receive(self) -> dict | None:
        """The next ASGI message, None once the deadline has passed."""
        remaining = self.deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return None
        try:
            return await asyncio.wait_for(self.http.receive(), remaining)
        except asyncio.TimeoutError:
            return None

    def _progress(self) -> str:
        length = self.http.headers.get("content-length")
        return f"{self.received} of {length}" if length else str(self.received)

    def _timed_out(self) -> ApiError:
        timeout = self.spec.timeout_s
        logger.info(
            "%s %s: the body did not arrive within %g s (%s bytes came): 408",
            self.http.method,
            self.http.url.path,
            timeout,
            self._progress(),
        )
        return unread(
            ApiError(
                408,
                f"the request body did not arrive within {timeout:g} s ({self._progress()} bytes came)",
                code="body_timeout",
            )
        )

    def _disconnected(self) -> ApiError:
        logger.info(
            "%s %s: the client disconnected after %s bytes of the body; nothing was queued",
            self.http.method,
            self.http.url.path,
            self._progress(),
        )
        return ApiError(CLIENT_CLOSED, "the client disconnected before the body was complete", code="cancelled")


# ---- JSON ---------------------------------------------------------------------------------------


async def read_json_object(http: Request, spec: BodySpec) -> dict[str, Any]:
    """The JSON object in the body, each text value within its limit; a 400 (413 past the cap) otherwise."""
    if not is_json(body_media_type(http, "application/json")):
        raise unread(ApiError(400, NOT_A_JSON_OBJECT))
    chunks: list[bytes] = []
    with _reading(http, spec) as stream:
        while (chunk := await stream.next_chunk()) is not None:
            chunks.append(chunk)
            if stream.received > spec.cap:
                raise await stream.refuse(_json_too_large(b"".join(chunks)[: spec.cap + 1], spec))
    value = _parse_json(b"".join(chunks))
    if not isinstance(value, dict):
        raise ApiError(400, NOT_A_JSON_OBJECT)
    check_text_values(value, spec)
    return value


def check_text_values(fields: dict[str, Any], spec: BodySpec) -> None:
    """A 400 naming the first text value of `fields` over its limit (also for fields nested in a JSON object)."""
    for key, item in fields.items():
        if isinstance(item, str) and len(item.encode("utf-8", "surrogatepass")) > spec.limit(key):
            raise spec.too_large(key)


def decode_data_url(url: Any, spec: BodySpec, param: str) -> bytes:
    """A file given as a base64 data URL ('data:image/png;base64,...') -> its bytes, within the upload limit; a 400
    naming `param` otherwise. The server fetches nothing: other URLs are refused."""
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ApiError(
            400,
            f"{param} must be a base64 data URL ('data:image/png;base64,...'); the server fetches nothing from "
            "the network",
            param=param,
        )
    payload = url.split(";base64,", 1)[1]
    if len(payload) > spec.file_as_text_chars:  # decoded, it could only be larger than the limit
        raise ApiError(400, f"{param} is larger than the upload limit of {spec.file_bytes} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param} is not valid base64", param=param) from None
    if len(data) > spec.file_bytes:
        raise ApiError(400, f"{param} is larger than the upload limit of {spec.file_bytes} bytes", param=param)
    return data


def _parse_json(raw: bytes) -> Any:
    """json.loads; a 400 naming the top-level field where the text stops being JSON, or none (`param` null) where
    the whole body is at fault: not UTF-8, or cut short (it ends before the JSON does)."""
    if not raw.strip():
        raise ApiError(400, f"the request body is empty: {NOT_A_JSON_OBJECT}")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid JSON: it is not UTF-8 text") from None
    except RecursionError:
        param = _json_field_at(raw.decode("utf-8", "ignore"))
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply", param=param) from None
    except json.JSONDecodeError as exc:
        if _cut_short(exc):
            raise ApiError(400, f"the request body is not valid JSON: it is cut short ({one_line(exc)})") from None
        param = _json_field_at(exc.doc[: exc.pos])
        raise ApiError(400, f"the request body is not valid JSON: {one_line(exc)}", param=param) from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        param = _json_field_at(raw.decode("utf-8", "ignore"))
        raise ApiError(400, "the request body is not valid JSON: a number has too many digits", param=param) from None


_LAST_TOKEN = re.compile(r'[^\s,:\[\]{}"]*\s*')  # what may follow a parse error in a text that merely stops early


def _cut_short(exc: json.JSONDecodeError) -> bool:
    """The JSON text ends before its value does ('{"prompt": "a ca', '{"seed": 12', '{"seed": tr'), rather than
    going wrong before its end: an unterminated string runs to the end by definition."""
    return exc.msg.startswith("Unterminated string") or _LAST_TOKEN.fullmatch(exc.doc, exc.pos) is not None


def _json_too_large(prefix: bytes, spec: BodySpec) -> ApiError:
    """A JSON body past the cap (`prefix`: up to the first byte beyond it): the field that byte is in, itself too
    large or not."""
    text = prefix.decode("utf-8", "ignore")
    at = _json_value_at(text)
    if at is None:
        return spec.body_too_large(None)
    key, start = at
    if _json_text_bytes(text[start:]) > spec.limit(key):
        return spec.too_large(key)
    return spec.body_too_large(key)


_SPACE = re.compile(r"[ \t\n\r]*")


def _json_value_at(text: str) -> tuple[str, int] | None:
    """The top-level field of a JSON object at which `text` stops being JSON (its value cut short or not
    parsing), and where that value starts; None when the object's own punctuation is at fault."""
    decoder = json.JSONDecoder()
    pos = _SPACE.match(text).end()
    if not text.startswith("{", pos):
        return None
    pos += 1
    while True:
        pos = _SPACE.match(text, pos).end()
        if not text.startswith('"', pos):
            return None
        try:
            key, pos = json.decoder.scanstring(text, pos + 1)
        except ValueError:
            return None
        pos = _SPACE.match(text, pos).end()
        if not text.startswith(":", pos):
            return None
        start = _SPACE.match(text, pos + 1).end()
        try:
            _, pos = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            return key, start
        if pos == len(text):
            return key, start  # a number or a literal may go on past the cut
        pos = _SPACE.match(text, pos).end()
        if not text.startswith(",", pos):
            return None
        pos += 1


def _json_field_at(text: str) -> str | None:
    at = _json_value_at(text)
    return at[0] if at else None


def _json_text_bytes(value: str) -> int:
    """The bytes of a JSON value cut short: a string's as UTF-8 (escapes take more room than what they spell)."""
    if value.startswith('"'):
        for end in range(len(value), max(len(value) - 7, 0), -1):  # the cut may have split an escape
            try:
                return len(json.loads(value[:end] + '"').encode("utf-8", "surrogatepass"))
            except ValueError:
                continue
    return len(value.encode("utf-8", "surrogatepass"))


# ---- forms --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilePart:
    """An uploaded file of a multipart form."""

    filename: str
    content_type: str
    data: bytes


async def read_form(http: Request, spec: BodySpec) -> list[tuple[str, str | FilePart]]:
    """A multipart or url-encoded form's fields in order (text, or files); a 400 (413 past the cap) naming the
    field otherwise. The caller has checked that the media type is one of FORM_TYPES."""
    with _reading(http, spec) as stream:
        return await _read_form(http, spec, stream)


async def _read_form(http: Request, spec: BodySpec, stream: _BodyStream) -> list[tuple[str, str | FilePart]]:
    kind, options = parse_options_header(http.headers.get("content-type"))
    form = _Form(spec)
    if kind == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            no_boundary = "the multipart body has no boundary (Content-Type: multipart/form-data; boundary=...)"
            raise await stream.refuse(ApiError(400, no_boundary))
        parser: MultipartParser | QuerystringParser = MultipartParser(boundary, form.multipart_callbacks())
    else:
        parser = QuerystringParser(form.urlencoded_callbacks())
    while True:
        chunk = await stream.next_chunk()
        try:
            if chunk is None:
                parser.finalize()
                break
            room = spec.cap - (stream.received - len(chunk))
            parser.write(chunk[:room])  # up to the cap: a field over its own limit is named first
            if len(chunk) > room:
                raise spec.body_too_large(form.param)
        except ApiError as exc:
            raise await stream.refuse(exc) from None
        except FormParserError as exc:
            raise await stream.refuse(ApiError(400, f"the form is malformed: {one_line(exc)}", form.param)) from None
    if not form.complete:
        param = form.param or form.last_param
        inside = f" (inside {param!r})" if form.param else ""
        raise ApiError(400, f"the multipart body ends before its closing boundary{inside}: it was cut short", param)
    return form.items


class _Form:
    """A form's items, from the parser's callbacks, each within its limit."""

    def __init__(self, spec: BodySpec) -> None:
        self.spec = spec
        self.items: list[tuple[str, str | FilePart]] = []
        self.complete = False  # the closing boundary (multipart) or the body's end (url-encoded) was reached
        self.param: str | None = None  # the field being read, as errors name it
        self.last_param: str | None = None
        self._files = self._fields = 0
        self._started = False  # url-encoded: the field's name is complete, its value is being read
        self._raw_name = bytearray()
        self._name = ""
        self._filename: str | None = None
        self._content_type = ""
        self._data = bytearray()
        self._header = [bytearray(), bytearray()]
        self._headers: dict[bytes, bytes] = {}
        self._urlencoded = False

    # multipart: a part's headers name it (and make it a file when they give a filename), then its data.

    def multipart_callbacks(self) -> dict:
        return {
            "on_part_begin": self._on_part_begin,
            "on_header_field": lambda data, start, end: self._header[0].extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header[1].extend(data[start:end]),
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": lambda data, start, end: self._add(data[start:end]),
            "on_part_end": self._end,
            "on_end": self._on_end,
        }

    def _on_part_begin(self) -> None:
        self._header, self._headers = [bytearray(), bytearray()], {}

    def _on_header_end(self) -> None:
        self._headers[bytes(self._header[0]).lower()] = bytes(self._header[1])
        self._header = [bytearray(), bytearray()]

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b"").decode("latin-1"))
        if b"name" not in options:
            raise ApiError(400, 'a form part has no name (Content-Disposition: form-data; name="...")')
        filename = options.get(b"filename")
        self._content_type = self._headers.get(b"content-type", b"").decode("latin-1")
        self._begin(_decode_name(options[b"name"]), None if filename is None else _decode_name(filename))

    def _on_end(self) -> None:
        self.complete = True

    # url-encoded: name=value&...; percent-encoded, so up to 3 bytes arrive for each one of the value.

    def urlencoded_callbacks(self) -> dict:
        self._urlencoded = True
        return {
            "on_field_start": self._on_field_start,
            "on_field_name": self._on_field_name,
            "on_field_data": self._on_field_data,
            "on_field_end": self._on_field_end,
            "on_end": self._on_end,
        }

    def _on_field_start(self) -> None:
        self._started, self._raw_name = False, bytearray()

    def _on_field_name(self, data: bytes, start: int, end: int) -> None:
        self._raw_name.extend(data[start:end])
        if len(self._raw_name) > 3 * self.spec.field_bytes:
            raise ApiError(400, f"a form field's name is longer than {self.spec.field_bytes} bytes")

    def _on_field_data(self, data: bytes, start: int, end: int) -> None:
        self._begin_urlencoded()
        self._add(data[start:end])

    def _on_field_end(self) -> None:
        self._begin_urlencoded()
        self._end()

    def _begin_urlencoded(self) -> None:
        if not self._started:
            self._started = True
            self._begin(_decode_name(_unquote_plus(self._raw_name)), None)

    # both

    def _begin(self, name: str, filename: str | None) -> None:
        self._name, self._filename, self.param = name, filename, field_param(name)
        self._data = bytearray()
        if filename is not None:
            self._files += 1
            if self._files > self.spec.max_files:
                most = f"at most {self.spec.max_files}" if self.spec.max_files else "none"
                raise ApiError(400, f"too many files: {most} per request ({name!r} is one more)", param=self.param)
        else:
            self._fields += 1
            if self._fields > MAX_FORM_FIELDS:
                raise ApiError(400, f"more than {MAX_FORM_FIELDS} form fields ({name!r} is one more)", self.param)

    def _add(self, data: bytes) -> None:
        if self._filename is not None:
            limit = self.spec.file_bytes
        else:
            limit = self.spec.limit(self.param) * (3 if self._urlencoded else 1)
        if len(self._data) + len(data) > limit:
            raise self.spec.too_large(self.param)
        self._data.extend(data)

    def _end(self) -> None:
        if self._filename is not None:
            item: str | FilePart = FilePart(self._filename, self._content_type, bytes(self._data))
        else:
            data = _unquote_plus(self._data) if self._urlencoded else bytes(self._data)
            if len(data) > self.spec.limit(self.param):
                raise self.spec.too_large(self.param)
            try:
                item = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"{self.param} is not UTF-8 text", param=self.param) from None
        self.items.append((self._name, item))
        self.last_param, self.param = self.param, None


def _unquote_plus(data: bytes | bytearray) -> bytes:
    return unquote_to_bytes(bytes(data).replace(b"+", b" "))


def _decode_name(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")
