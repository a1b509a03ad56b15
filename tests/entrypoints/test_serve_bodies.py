"""Request bodies over real HTTP: a deadline, bodies cut short, one byte limit per field, errors naming the field.

One `vllm-omni serve tiny/hunyuan-video-1.5` for the module, with a queue of 3 places, a body deadline
of 2 s (`--body-read-timeout`) and a 1 MB upload limit, so a body past the server's cap (the
uploads as data URLs plus three text fields at their limit: about 4.5 MB) is cheap to send. Raw
sockets send what no client library would: headers and a byte, then silence; a body cut short;
a client that leaves mid-body. The queue places a silent upload takes are seen through 429s; that a
refused body ran nothing, through the videos list and the scheduler's log lines.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time

import httpx
import pytest
from openai import BadRequestError, OpenAI
from server_process import HTTP_TIMEOUT_S, start_server

from vllm_omni.entrypoints.openai.body_limits import BodyLimits

MODEL = "tiny/hunyuan-video-1.5"
PROMPT = "A cat walks on the grass, realistic style."
QUEUE = 3
BODY_TIMEOUT_S = 2
UPLOAD_LIMIT = 1_000_000
FIELD_LIMIT = BodyLimits().max_field_bytes  # the documented default: a text field's value, UTF-8
FAST = {"size": "64x48", "num_frames": 1, "num_inference_steps": 1}
BOUNDARY = "vllmomnibodytest"
POLL_S = 0.05
QUEUED = r"Request video-\w+ queued"  # the scheduler's line for a job it queued

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-bodies")
    args = [MODEL, "--max-queue", str(QUEUE), "--body-read-timeout", str(BODY_TIMEOUT_S)]
    args += ["--max-upload-bytes", str(UPLOAD_LIMIT), "--video-dir", str(root / "videos")]
    srv = start_server(args, root / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


# ---- helpers --------------------------------------------------------------------------------------


def wait_until(condition, what: str, timeout: float = HTTP_TIMEOUT_S):
    """Poll `condition` until it returns something true (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"never happened: {what}")


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def videos(server) -> list[dict]:
    return httpx.get(f"{server.url}/v1/videos", params={"limit": 100}).json()["data"]


def wait_idle(server) -> None:
    """Every job finished: the queue's places are all free."""
    wait_until(lambda: all(v["status"] in ("completed", "failed") for v in videos(server)), "the jobs finished")


def probe(server) -> int:
    """The status of a request that takes a queue place and is then refused: 400 while a place is free, 429 not."""
    return httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, "num_stepz": 1}).status_code


def multipart(fields: list[tuple[str, str | tuple[str, bytes]]]) -> bytes:
    """A multipart/form-data body (boundary BOUNDARY): text fields, and (filename, data) file parts."""
    out = b""
    for name, value in fields:
        if isinstance(value, tuple):
            disposition = f'form-data; name="{name}"; filename="{value[0]}"\r\nContent-Type: image/png'
            data = value[1]
        else:
            disposition, data = f'form-data; name="{name}"', value.encode()
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


MULTIPART_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def raw_post(server, path: str, content_type: str, body: bytes, length: int | None = None) -> socket.socket:
    """POST on a raw socket, Content-Length `length` (default: the body's), and leave it open."""
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
    head += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + body)
    return sock


def answer_of(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The status, headers and body of the answer on `sock`, read until the server closes the connection."""
    sock.settimeout(HTTP_TIMEOUT_S)  # a hang guard
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def png_bytes(size: int) -> bytes:
    """A PNG signature padded to `size` bytes: the size checks come before any image check."""
    return b"\x89PNG\r\n\x1a\n" + bytes(size - 8)


# ---- a deadline on the body ----------------------------------------------------------------------


def test_silent_uploads_get_408_and_give_back_the_queue_places_they_held(server):
    wait_idle(server)
    start = server.log_size()
    # Headers and one byte of a body announced as 1000 bytes, then silence: to both upload routes.
    stalled = [
        raw_post(server, "/v1/videos", MULTIPART_TYPE, b"-", length=1000),
        raw_post(server, "/v1/videos", "application/json", b"{", length=1000),
        raw_post(server, "/v1/images/edits", MULTIPART_TYPE, b"-", length=1000),
    ]
    # Each holds a queue place while its body is awaited: the queue is full for everyone else ...
    wait_until(lambda: probe(server) == 429, "the silent uploads filled the queue")
    # ... until the deadline: each is answered 408 and its connection closed.
    for sock in stalled:
        status, headers, body = answer_of(sock)
        assert status == 408 and headers["connection"] == "close", body
        error = json.loads(body)["error"]
        assert error["code"] == "body_timeout" and f"within {BODY_TIMEOUT_S} s" in error["message"], error
        assert "1 of 1000 bytes" in error["message"]
    # The places are free again: a request is accepted and runs.
    assert probe(server) == 400
    response = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, **FAST})
    assert response.status_code == 200, response.text
    wait_idle(server)
    log = server.log(start)
    assert log.count("the body did not arrive within") == 3
    assert "Traceback" not in log and "ERROR" not in log, log


def test_a_client_that_leaves_mid_body_is_one_info_line_and_queues_nothing(server):
    wait_idle(server)
    before = [v["id"] for v in videos(server)]
    start = server.log_size()
    body = multipart([("prompt", PROMPT), ("seed", "7")])
    raw_post(server, "/v1/videos", MULTIPART_TYPE, body[: len(body) // 2], length=len(body)).close()
    line = server.wait_for_log(r"(?m)^.*POST /v1/videos: the client disconnected after \d+ of \d+ bytes.*$", start)
    assert line.group(0).startswith("INFO"), line.group(0)
    assert probe(server) == 400  # its place was given back
    log = server.log(start)
    assert "Traceback" not in log and "ERROR" not in log and "ClientDisconnect" not in log, log
    assert not re.search(QUEUED, log) and [v["id"] for v in videos(server)] == before


# ---- bodies cut short ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cut,param",
    [
        (lambda body: body[: body.index(b"123456") + 3], "seed"),  # inside a field: "123" of "123456"
        (lambda body: body[: body.rindex(b"--")], "seed"),  # whole fields, no closing boundary
    ],
    ids=["inside-a-field", "without-the-closing-boundary"],
)
def test_a_multipart_body_cut_short_is_a_400_naming_the_field_and_runs_nothing(server, cut, param):
    wait_idle(server)
    before = [v["id"] for v in videos(server)]
    start = server.log_size()
    body = multipart([("prompt", PROMPT), *((k, str(v)) for k, v in FAST.items()), ("seed", "123456")])
    response = httpx.post(
        f"{server.url}/v1/videos", content=cut(body), headers={"Content-Type": MULTIPART_TYPE}, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and "closing boundary" in error["message"], error
    assert [v["id"] for v in videos(server)] == before
    assert not re.search(QUEUED, server.log(start))
    # The whole body, sent again, is a job with the seed it gives.
    complete = httpx.post(f"{server.url}/v1/videos", content=body, headers={"Content-Type": MULTIPART_TYPE})
    assert complete.status_code == 200 and complete.json()["seed"] == 123456, complete.text
    wait_idle(server)


# ---- one limit per field, named ------------------------------------------------------------------


@pytest.mark.parametrize("size", [2 * FIELD_LIMIT, 6 * FIELD_LIMIT], ids=["within-the-body-cap", "past-the-body-cap"])
def test_a_prompt_over_the_field_limit_is_the_same_400_in_json_and_in_multipart(server, client, size):
    prompt = "p" * size
    by_json = httpx.post(f"{server.url}/v1/videos", json={"prompt": prompt, **FAST}, timeout=HTTP_TIMEOUT_S)
    assert by_json.status_code == 400, by_json.text
    with pytest.raises(BadRequestError) as by_form:  # the openai client sends a multipart form
        client.videos.create(model=MODEL, prompt=prompt, extra_body=FAST)
    expected = f"prompt is larger than the limit of {FIELD_LIMIT} bytes for a text field"
    assert error_of(by_json)["param"] == by_form.value.body["param"] == "prompt"
    assert error_of(by_json)["message"] == by_form.value.body["message"] == expected


def test_an_input_reference_over_the_upload_limit_is_the_same_400_as_a_file_and_as_a_data_url(server, client):
    image = png_bytes(UPLOAD_LIMIT + 1)
    with pytest.raises(BadRequestError) as as_file:
        client.videos.create(model=MODEL, prompt=PROMPT, input_reference=("cat.png", image, "image/png"))
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    as_url = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, "input_reference": {"image_url": data_url}})
    expected = f"input_reference is larger than the upload limit of {UPLOAD_LIMIT} bytes"
    assert as_url.status_code == 400 and error_of(as_url)["message"] == as_file.value.body["message"] == expected
    assert error_of(as_url)["param"] == as_file.value.body["param"] == "input_reference"


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"seconds": ["4"]}, "seconds", "got list"),
        ({"seconds": {"value": 4}}, "seconds", "got dict"),
        ({"seconds": 10**400}, "seconds", "far too large"),
        ({"seed": "x", "prompt": "p" * (FIELD_LIMIT + 1)}, "prompt", "text field"),
    ],
    ids=["seconds-list", "seconds-object", "seconds-400-digits", "a-field-too-large-is-named-before-a-bad-one"],
)
def test_a_json_field_of_the_wrong_shape_is_a_400_naming_it(server, body, param, words):
    response = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, **body}, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "content,param",
    [
        (b'{"prompt": "a cat", "seed": tru}', "seed"),
        (b'{"prompt": "a cat", "seconds": ' + b"9" * 5000 + b"}", "seconds"),
        (b'{"prompt": "caf\xe9"}', "prompt"),
    ],
    ids=["bad-literal", "integer-beyond-python", "not-utf8"],
)
def test_json_that_does_not_parse_names_the_field_where_it_stops(server, content, param):
    response = httpx.post(f"{server.url}/v1/videos", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text
    assert "not valid JSON" in error_of(response)["message"]


def test_seconds_of_400_digits_in_a_form_is_a_400_naming_seconds(client):
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(model=MODEL, prompt=PROMPT, seconds="9" * 400, extra_body=FAST)
    assert refused.value.body["param"] == "seconds", refused.value.body


def test_two_input_reference_files_are_a_400_naming_input_reference(server):
    files = [("input_reference", ("a.png", png_bytes(64), "image/png"))] * 2
    response = httpx.post(f"{server.url}/v1/videos", data={"prompt": PROMPT}, files=files)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "input_reference" and "at most 1" in error["message"], error


@pytest.mark.parametrize(
    "content_type",
    ["APPLICATION/JSON", "application/json; charset=UTF-8", f"Multipart/Form-Data; boundary={BOUNDARY}"],
    ids=["upper-case-json", "json-with-charset", "mixed-case-multipart"],
)
def test_media_types_are_compared_without_case_and_parameters(server, content_type):
    fields = {"prompt": PROMPT, **FAST, "seed": 5}
    if content_type.lower().startswith("multipart"):
        body = multipart([(k, str(v)) for k, v in fields.items()])
    else:
        body = json.dumps(fields).encode()
    response = httpx.post(f"{server.url}/v1/videos", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text
    assert response.json()["seed"] == 5
    wait_idle(server)
